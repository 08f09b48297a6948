"""The fine-tuning flow users run, on a real GPU: peft LoRA on a transformers Llama-shaped model
(random weights from a config), its frozen base offloaded at a budget below half of it, 20
AdamW steps beside the same run fully resident: every loss and every LoRA weight bitwise equal,
and the base's weights really moving in every step; then the adapters merged into the offloaded
base and out again, and adapters added after offload(), logits bitwise equal. Skipped without
CUDA, transformers or peft.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \\
        python -m pytest -q -s tests/gpu/test_peft_gpu.py
"""
from __future__ import annotations

import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import spillway.torch as spt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from models import moved, offloaded_bytes  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
STEPS = 20


def _llama():
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=2000,
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(DEV):  # random init on the device: fast
        return transformers.LlamaForCausalLM(cfg)


def _lora_config():
    return peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def _lora_llama():
    model = peft.get_peft_model(_llama(), _lora_config())
    with torch.no_grad():  # LoRA's B starts at zero: make every adapter matter from step one
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def test_peft_lora_on_an_offloaded_base_equals_resident_over_20_steps():
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = _lora_llama()
    model = copy.deepcopy(ref)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    budget = int(base_bytes * 0.45)
    off = spt.offload(model, budget=budget)
    assert offloaded_bytes(off) > budget
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    gen = torch.Generator(device=DEV).manual_seed(0)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, 2000, (4, 128), device=DEV, generator=gen)
        loss = moved(off, lambda: model(input_ids=ids, labels=ids).loss)
        want = ref(input_ids=ids, labels=ids).loss
        assert torch.equal(loss, want), (step, loss.item(), want.item())
        loss.backward()
        want.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    got = dict(model.named_parameters())
    n = 0
    for name, p in ref.named_parameters():
        if p.requires_grad:
            assert torch.equal(got[name], p), name
            n += 1
    st = off.stats()
    per_step = st["bytes_h2d"]["total"] / STEPS
    print(f"\npeft LoRA: {n} adapter tensors equal after {STEPS} steps; base {base_bytes / 2**20:.1f} MiB, "
          f"budget {budget / 2**20:.1f} MiB, moved {per_step / 2**20:.1f} MiB per step; "
          f"losses {losses[0]:.4f} -> {losses[-1]:.4f}")
    assert n > 0 and len(set(losses)) > 1  # the adapters moved the loss
    off.remove()


@pytest.mark.parametrize("fraction,frozen", [(0.45, False), (0.2, False), (0.2, True)])
def test_peft_merge_into_an_offloaded_base_equals_resident(fraction, frozen):
    """merge_adapter(), unmerge_adapter() and merge_and_unload() on a model whose base is
    offloaded: peft adds each adapter into its base weight through .data, with the adapters on
    the device and the base between forwards in host memory; the offload runs the add on a
    device copy and keeps the result. At a fifth of the base, the MLPs are split and their LoRA
    layers are units: merge_and_unload() puts their base layers in their places, which take over
    their hooks. Frozen adapters (a LoRA loaded for inference) are offloaded with the base, and
    the merge runs on device copies of them too. Logits bitwise equal to the same calls on the
    resident model, the base's weights moving throughout."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = _lora_llama()
    if frozen:
        ref.requires_grad_(False)
    model = copy.deepcopy(ref)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    # in pages (this stack streams in plain segments by default, whose units of a sixteenth of
    # the budget make LoRA layers units at either fraction)
    off = spt.offload(model, budget=int(base_bytes * fraction), vmm="on")
    lora_hooked = sum(hasattr(m, "base_layer") and id(m) in off._needs for m in model.modules())
    print(f"\npeft merge at {fraction:.2f} of the base{' (adapters frozen)' if frozen else ''}: "
          f"{len(off.units)} units, {lora_hooked} LoRA layers hooked")
    assert (lora_hooked > 0) == (fraction < 0.3)
    ids = torch.randint(0, 2000, (2, 64), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(moved(off, lambda: model(input_ids=ids).logits), ref(input_ids=ids).logits)
        model.merge_adapter()
        ref.merge_adapter()
        assert torch.equal(moved(off, lambda: model(input_ids=ids).logits), ref(input_ids=ids).logits)
        model.unmerge_adapter()
        ref.unmerge_adapter()
        assert torch.equal(moved(off, lambda: model(input_ids=ids).logits), ref(input_ids=ids).logits)
        merged, ref_merged = model.merge_and_unload(), ref.merge_and_unload()
        steps = off.stats()["offload"]["steps"]
        assert torch.equal(moved(off, lambda: merged(input_ids=ids).logits), ref_merged(input_ids=ids).logits)
        assert off.stats()["offload"]["steps"] == steps + 1  # the merged model's forward is a step
    off.remove()


@pytest.mark.parametrize("fraction", [0.45, 0.2])
def test_peft_adapters_added_after_offload_equal_resident(fraction):
    """LoRA adapters added to a model already offloaded (get_peft_model, load_adapter, a
    pipeline's load_lora_weights): peft makes them on the device of the weights they wrap, host
    memory between forwards, and the next forward takes them to the device. Logits bitwise equal
    to the same adapters on the resident model, then merged and unloaded."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = _llama().requires_grad_(False)
    model = copy.deepcopy(ref)
    base_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    off = spt.offload(model, budget=int(base_bytes * fraction))
    ids = torch.randint(0, 2000, (2, 64), device=DEV, generator=torch.Generator(device=DEV).manual_seed(0))
    with torch.no_grad():
        assert torch.equal(moved(off, lambda: model(input_ids=ids).logits), ref(input_ids=ids).logits)
    ref_p, model_p = peft.get_peft_model(ref, _lora_config()), peft.get_peft_model(model, _lora_config())
    want = dict(ref_p.named_parameters())
    with torch.no_grad():  # the same adapter values on both, B not zero
        for n, p in model_p.named_parameters():
            if "lora_" in n:
                if "lora_B" in n:
                    want[n].normal_(0, 0.02)
                p.copy_(want[n])
        for _ in range(2):
            assert torch.equal(moved(off, lambda: model_p(input_ids=ids).logits), ref_p(input_ids=ids).logits)
        assert all(p.device == DEV for n, p in model_p.named_parameters() if "lora_" in n)
        merged, ref_merged = model_p.merge_and_unload(), ref_p.merge_and_unload()
        assert torch.equal(moved(off, lambda: merged(input_ids=ids).logits), ref_merged(input_ids=ids).logits)
    off.remove()
