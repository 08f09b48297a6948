"""spillway.torch.offload on a real GPU (backend="cuda"): the emu checks again, plus a small
transformers Llama (random weights) when transformers is importable. Skipped without CUDA.

Run from the repository root after `make` (see README, "PyTorch"):
    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \
        python -m pytest -q -s tests/gpu/test_torch_offload_gpu.py
"""
from __future__ import annotations

import copy
import inspect
import os
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from torch import nn  # noqa: E402

import spillway  # noqa: E402
import spillway.torch as spt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from models import (QuantLinear, WithAdapter, check_backward_composes, frozen, greedy, make_decoder, make_stack,  # noqa: E402
                    moved, same)

MiB = 1 << 20
DEV = torch.device("cuda", torch.cuda.current_device())
CUDA = dict(backend="cuda")
_TorchOOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError



@pytest.fixture(autouse=True)
def _deterministic():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


def test_stack_equal_and_restored_on_device():
    m = frozen(make_stack(dim=1024)).to(DEV)  # six 4 MiB weights under a 10 MiB budget
    ref = copy.deepcopy(m)
    x = torch.randn(5, 1024, device=DEV)
    off = spt.offload(m, budget="10MiB", **CUDA)
    assert off.context.backend == "cuda"
    assert all(p.device.type == "cpu" for p in m.parameters())  # host views between forwards
    for _ in range(3):
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    off.remove()
    assert off.final_stats["pinned"]["current"] == 0 and off.final_stats["live"]["current"] == 0
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert p.device == DEV and torch.equal(p, q), n


def test_moving_an_offloaded_model_to_the_device_moves_nothing():
    """model.to("cuda") / .cuda() after offload() (pipe.to("cuda"), a trainer placing its model)
    keeps the weights in their packs: nothing is copied to the device beside the offload, and
    they still move each forward."""
    m = frozen(make_stack(dim=1024))
    ref = copy.deepcopy(m).to(DEV)
    x = torch.randn(5, 1024, device=DEV)
    off = spt.offload(m, budget="10MiB", **CUDA)
    before = torch.cuda.memory_allocated(DEV)
    assert m.to(DEV) is m and m.cuda() is m and m.to("cuda", torch.float32) is m
    assert torch.cuda.memory_allocated(DEV) == before
    assert all(p.device.type == "cpu" for p in m.parameters())
    assert torch.equal(moved(off, lambda: m(x)), ref(x))
    with pytest.raises(spillway.ConfigError, match="convert the model before offload"):
        m.to(DEV, torch.bfloat16)
    off.remove()
    m.cuda()
    assert all(p.device == DEV for p in m.parameters())


def test_weights_edited_between_forwards_are_uploaded_again():
    """load_state_dict and a .data replaced on an offloaded model whose units stay on the device
    across forwards: the next forward computes with the new weights."""
    m, other = frozen(make_stack(dim=1024, depth=8)), frozen(make_stack(seed=1, dim=1024, depth=8)).to(DEV)
    x = torch.randn(4, 1024, device=DEV)
    off = spt.offload(m, budget="20MiB", **CUDA)
    for _ in range(4):
        m(x)
    m.load_state_dict(other.state_dict())
    assert torch.equal(m(x), other(x))
    new = torch.randn(1024, 1024, device=DEV) / 32
    other[2].weight.data = new.clone()
    m[2].weight.data = new.cpu()
    assert torch.equal(m(x), other(x))
    assert off.stats()["offload"]["edit_evictions"] >= len(off.units) + 1
    off.remove()


def test_decoder_kv_loop_tied_and_plan_below_lru():
    ids = torch.randint(0, 97, (2, 7), device=DEV)
    ref = make_decoder(dim=128, layers=8).to(DEV)
    with torch.no_grad():
        want = greedy(ref, ids, 6)
    bytes_moved = {}
    for policy in ("lru", "plan"):
        m = frozen(copy.deepcopy(ref))
        off = spt.offload(m, budget="4MiB", policy=policy, prefetch="off", **CUDA)
        assert m.lm_head.weight is m.embed.weight
        with torch.no_grad():
            moved(off, lambda: m(ids))
            got = greedy(m, ids, 6)
            for _ in range(4):
                greedy(m, ids, 6)
        assert same(got, want)
        bytes_moved[policy] = off.stats()["bytes_h2d"]["total"]
        print(f"\n{policy}:\n{off.summary()}")
        off.remove()
    assert bytes_moved["plan"] < bytes_moved["lru"], bytes_moved


def test_no_host_sync_in_steady_state_and_hook_time():
    m = frozen(make_decoder(dim=128, layers=8)).to(DEV)
    ids = torch.randint(0, 97, (1, 16), device=DEV)
    off = spt.offload(m, budget="64MiB", **CUDA)  # all resident after the first pass
    with torch.no_grad():
        for _ in range(3):
            m(ids)
        torch.cuda.synchronize()
        h0 = off.hook_stats()
        torch.cuda.set_sync_debug_mode("error")  # any synchronizing torch call in the hooks raises
        try:
            for _ in range(50):
                m(ids)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    h = off.hook_stats()
    acquires = h["acquires"] - h0["acquires"]
    per = (h["hook_ns"] - h0["hook_ns"]) / max(acquires, 1) / 1000
    print(f"\nhook host time per acquire: {per:.1f} us over {acquires} acquires; views built {h['view_builds']}")
    assert h["view_builds"] == h0["view_builds"]  # same addresses: no view construction
    assert per < 60, per
    off.remove()


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base = base
        dev, dt = base.weight.device, base.weight.dtype
        self.a = nn.Parameter(torch.randn(r, base.in_features, device=dev, dtype=dt) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, r, device=dev, dtype=dt) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _check_grads(off, model, ref, loss_fn):
    for p in list(model.parameters()) + list(ref.parameters()):
        p.grad = None
    loss, loss_ref = moved(off, lambda: loss_fn(model)), loss_fn(ref)
    assert torch.equal(loss, loss_ref)
    loss.backward()
    loss_ref.backward()
    got = dict(model.named_parameters())
    n_checked = 0
    for n, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.equal(got[n].grad, p.grad), n
            n_checked += 1
    assert n_checked > 0


def test_backward_through_frozen_offloaded_decoder():
    torch.manual_seed(0)
    base = frozen(make_decoder(dim=128, layers=8)).to(DEV)
    for layer in base.layers:
        layer.attn.qkv = LoRA(layer.attn.qkv)
    ref = copy.deepcopy(base)
    ids = torch.randint(0, 97, (2, 6), device=DEV)
    target = torch.randint(0, 97, (2, 6), device=DEV)
    off = spt.offload(base, budget="4MiB", **CUDA)

    def loss_fn(model):
        logits, _ = model(ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    for _ in range(2):
        _check_grads(off, base, ref, loss_fn)
    assert off.hook_stats()["saved_reacquires"] > 0
    off.remove()


def test_oom_is_torch_oom_and_budget_errors():
    m = frozen(make_stack()).to(DEV)
    free, _ = torch.cuda.mem_get_info(DEV)
    with pytest.raises(spillway.ConfigError, match="above the free device memory"):
        spt.offload(m, budget=free + (1 << 30), **CUDA)
    with pytest.raises(spillway.ConfigError, match="below the largest unit"):
        spt.offload(m, budget="4KiB", **CUDA)
    assert "forward" not in m.__dict__ and all(p.device == DEV for p in m.parameters())

    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.own = nn.Parameter(torch.randn(400_000))
            self.blocks = nn.Sequential(nn.Linear(600, 600), nn.Linear(600, 600))

        def forward(self, x):
            return self.blocks(x) * self.own[:600]

    w = frozen(Wide()).to(DEV)
    with pytest.raises(spillway.ConfigError, match="below what blocks.1 holds at once"):
        spt.offload(w, budget="2MiB", **CUDA)
    off = spt.offload(w, budget="6MiB", on_exhaust="fail", **CUDA)  # room, but no eviction
    with pytest.raises(_TorchOOM):
        w(torch.randn(1, 600, device=DEV))
    assert off.stats()["pinned"]["current"] == 0
    off.remove()


# ---- transformers Llama, random weights ----

def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(DEV).eval()
    return model


def test_llama_forward_and_generate_equal():
    ref = _llama()
    model = frozen(copy.deepcopy(ref))
    ids = torch.randint(0, 1000, (2, 12), device=DEV)
    with torch.no_grad():
        want = ref(ids).logits
        want_gen = ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    off = spt.offload(model, budget="8MiB", **CUDA)  # below the ~11 MiB of weights
    names = [u.name for u in off.units]
    assert all(any(n.startswith(f"model.layers.{i}") for n in names) for i in range(4))  # layer by layer
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = moved(off, lambda: model(ids).logits)
        got_gen = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert torch.equal(got_gen, want_gen)
    st = off.stats()
    assert st["held"]["peak"] <= 8 * MiB and st["evictions_clean"]["total"] > 0
    print(f"\nllama:\n{off.summary()}")
    off.remove()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)


def test_llama_backward_with_adapters():
    ref = _llama()
    ref.requires_grad_(False)
    for layer in ref.model.layers:
        layer.self_attn.q_proj = LoRA(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRA(layer.self_attn.v_proj)
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 1000, (2, 10), device=DEV)
    off = spt.offload(model, budget="8MiB", **CUDA)
    assert "kept resident     16 trainable parameters" in off.summary()

    def loss_fn(m):
        return m(ids, labels=ids).loss

    for _ in range(2):
        _check_grads(off, model, ref, loss_fn)
    assert off.hook_stats()["saved_reacquires"] > 0
    off.remove()


@pytest.mark.parametrize("worker", ["off", "on"])
def test_plan_prefetch_from_the_worker_thread(worker):
    # prefetch_thread=on on a real device: the plan's prefetches come from the library's worker
    # while the forward enqueues kernels; outputs stay bitwise equal to the resident model's
    m = frozen(make_stack(dim=1024, depth=12)).to(DEV)  # 4 MiB weights, room for about half
    ref = copy.deepcopy(m)
    x = torch.randn(8, 1024, device=DEV)
    off = spt.offload(m, budget="28MiB", prefetch="on", **({"prefetch_thread": worker} if worker == "off" else {}),
                      **CUDA)
    assert off.context_options["prefetch_thread"] == worker  # on: offload's default on CUDA
    with torch.no_grad():
        want = ref(x)
        for _ in range(12):
            assert torch.equal(moved(off, lambda: m(x)), want)
    st = off.stats()
    assert st["plan_prefetch_bytes"]["total"] > 0 and st["plan_divergences"]["total"] == 0
    print(f"\nprefetch_thread={worker}: {off.summary().splitlines()[0]}")
    off.remove()


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint-reentrant", "save_on_cpu"])
def test_backward_composes_with_other_saved_tensor_hooks(how):
    """Activation checkpointing (both kinds) inside the offloaded model and save_on_cpu around
    it keep their role beside offload()'s saved-tensor records: gradients bitwise equal."""
    check_backward_composes(how, DEV, **CUDA)


def test_a_module_added_after_offload_is_taken_in_on_the_device():
    """peft's situation on a real device: a module made after offload() beside the weights' host
    copies (on the CPU) and used in the forward. torch 2 reports the registration, and the next
    forward first moves the new module's tensors to the device (the Parameter objects kept): the
    forward runs, equals the resident model's with the same module, and the weights still move."""
    m = frozen(WithAdapter(dim=1024)).to(DEV)  # 32 MiB fp32
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="12MiB", **CUDA)
    x = torch.randn(4, 1024, device=DEV)
    m.adapter = nn.Linear(1024, 1024)  # on the CPU, as the offloaded weights are between forwards
    ref.adapter = copy.deepcopy(m.adapter).to(DEV)
    weight = m.adapter.weight
    with torch.no_grad():
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    assert m.adapter.weight is weight and weight.device.type == "cuda"
    assert not off._acquired
    off.remove()


def test_weight_norm_and_pre_hooks_with_kwargs_see_the_device_copies():
    """An audio autoencoder's weight-normed convolutions (torch's weight_norm computes the weight
    in a forward pre-hook) and a torch 2 pre-hook taking kwargs, on CUDA: the hooks get the
    device copies (from the host views the forward would raise a device mismatch), the output
    equals resident, the weights move, and no computed weight stays on the device."""
    torch.manual_seed(0)

    def unit():
        return nn.Sequential(nn.utils.weight_norm(nn.Conv1d(256, 256, 7, padding=3)), nn.ELU(),
                             nn.utils.weight_norm(nn.Conv1d(256, 256, 1)))

    m = nn.Sequential(*[unit() for _ in range(6)]).to(DEV).eval().requires_grad_(False)  # 12.8 MiB
    x = torch.randn(2, 256, 64, device=DEV)
    with torch.no_grad():
        ref = m(x)
    seen = []
    if "with_kwargs" in inspect.signature(m[2][0].register_forward_pre_hook).parameters:  # torch 2
        m[2][0].register_forward_pre_hook(lambda mod, args, kwargs: seen.append(mod.weight_v.device) or None,
                                          with_kwargs=True)
    off = spt.offload(m, budget="8MiB", **CUDA)
    with torch.no_grad():
        out = moved(off, lambda: m(x))
        for _ in range(3):
            assert torch.equal(m(x), ref)
    assert torch.equal(out, ref)
    assert all(d.type == "cuda" for d in seen)
    assert all(c.weight.device.type == "cpu" for c in m.modules() if hasattr(c, "weight_g"))
    off.remove()


def test_quantized_weights_in_a_parameter_subclass_on_the_device():
    """int8 weights in a Parameter subclass whose scale is an attribute (a GGUF checkpoint's
    GGUFParameter), on CUDA: the forward reads the attribute from the device copy."""
    torch.manual_seed(0)
    m = nn.Sequential(*[QuantLinear(1024) for _ in range(12)]).requires_grad_(False)
    for q in m:
        q.weight.data = q.weight.data.to(DEV)
        q.bias.data = q.bias.data.to(DEV)
    x = torch.randn(4, 1024, device=DEV)
    with torch.no_grad():
        ref = m(x)
    off = spt.offload(m, budget="6MiB", **CUDA)
    with torch.no_grad():
        out = moved(off, lambda: m(x))
        assert torch.equal(m(x), ref)
    assert torch.equal(out, ref)
    off.remove()


def test_page_locked_memory_goes_to_the_weights_that_move_on_the_device():
    """pin_limit leaves the weights registered last pageable; the looks at step ends give the
    page-locked memory to the units that are uploaded every step, from those that stay on the
    device: on CUDA, page-locking and unlocking between steps, the outputs unchanged (the emu
    tests prove the share itself; the figures are printed)."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(2048, 2048, bias=False) for _ in range(12)]).to(torch.bfloat16)
    m.requires_grad_(False)
    ref = copy.deepcopy(m).to(DEV)
    x = torch.randn(64, 2048, device=DEV, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="could not be page-locked"):
        off = spt.offload(m, budget="40MiB", pin_limit="48MiB", backend="cuda")  # 96 MiB of weights, 6 of 12 locked
    per_step = []  # (bytes uploaded from pageable memory, bytes uploaded) a step
    with torch.no_grad():
        want = ref(x)
        for _ in range(40):  # past the plan's trials and the look at step 32
            st = off.context.stats()
            before = (st["h2d_pageable"]["total"], st["bytes_h2d"]["total"])
            assert torch.equal(m(x), want)
            torch.cuda.synchronize()
            st = off.context.stats()
            per_step.append((st["h2d_pageable"]["total"] - before[0], st["bytes_h2d"]["total"] - before[1]))
    assert off.context.stats()["repins"]["total"] > 0
    # Where the plan keeps a fixed set (its splits), what moves is page-locked as far as the 48
    # MiB go; where what it keeps rotates (no prefetch), every unit moves now and then and the
    # pageable share of the uploads stays about the pageable share of the weights, a half.
    last = per_step[-16:]
    assert sum(a for a, _ in last) <= 0.6 * sum(b for _, b in last), per_step
    print(f"\npageable MiB a step (of MiB moved): {[(a >> 20, b >> 20) for a, b in per_step]}")
    off.remove()
