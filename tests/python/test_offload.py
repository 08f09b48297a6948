"""spillway.torch.offload with CPU torch on the emu backend: outputs bitwise equal to the
resident module, the packing, the hooks' corner cases, backward, remove() and bad input."""
from __future__ import annotations

import copy
import io
import inspect
import json
import types
import weakref
from typing import Optional

import pytest
import torch
from torch import nn

import spillway
import spillway.torch as spt
from models import (WithAdapter, check_backward_composes, fail_at_call, frozen, greedy, make_decoder, make_stack,
                    moved, same)

MiB = 1 << 20
EMU = dict(backend="emu")



def snapshot(m: nn.Module):
    return {n: (t, t.data_ptr(), t.detach().clone(), t.stride(), t.device)
            for n, t in list(m.named_parameters()) + list(m.named_buffers())}


def assert_unchanged(m: nn.Module, snap) -> None:
    now = dict(list(m.named_parameters()) + list(m.named_buffers()))
    assert set(now) == set(snap)
    for n, (t, ptr, val, stride, dev) in snap.items():
        assert now[n] is t, n
        assert t.data_ptr() == ptr and t.stride() == stride and t.device == dev, n
        assert torch.equal(t, val), n
    for sub in m.modules():
        assert "forward" not in sub.__dict__ and "_apply" not in sub.__dict__
        assert not sub._forward_pre_hooks and not sub._forward_hooks


# ---- outputs ----

def test_sequential_stack_equal():
    m = frozen(make_stack(dim=1024))  # six 4 MiB weights under a 10 MiB budget
    ref = copy.deepcopy(m)
    x = torch.randn(5, 1024)
    off = spt.offload(m, budget="10MiB", **EMU)
    assert len(off.units) == 7  # each Linear of the Sequential is a block, the biases one more
    for _ in range(3):
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    assert off.stats()["offload"]["steps"] == 3
    off.remove()


def test_decoder_kv_cache_loop_equal_and_tied():
    m = make_decoder(dim=128, layers=8)
    ref = copy.deepcopy(m)
    frozen(m)
    ids = torch.randint(0, 97, (2, 7))
    off = spt.offload(m, budget="4MiB", **EMU)  # about 0.6 of the weights
    assert m.lm_head.weight is m.embed.weight
    with torch.no_grad():
        moved(off, lambda: m(ids))
        got = greedy(m, ids, 6)
        want = greedy(ref, ids, 6)
    assert same(got, want)
    st = off.stats()
    assert st["offload"]["steps"] == 8  # one per forward, the sequence length changing
    assert st["evictions_clean"]["total"] > 0 and st["bytes_d2h"]["total"] == 0
    assert st["held"]["peak"] <= 4 * MiB
    # the tied weight is stored once, in the embedding's unit
    owners = [u.name for u in off.units for e in u.entries if e.tensor is m.embed.weight]
    assert len(owners) == 1 and owners[0].startswith("embed")
    assert not any(u.name == "lm_head" for u in off.units)
    # between forwards the weights are CPU views of the host copy: state_dict reads real values
    sd = m.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    off.remove()


def test_block_packing_one_buffer_per_layer():
    m = frozen(make_decoder(layers=3))
    sigs = [inspect.signature(x.forward) for x in (m, m.layers[0])]
    off = spt.offload(m, budget="8MiB", blocks=list(m.layers), **EMU)
    # the wrapped forwards show the real parameters (generate() reads them)
    assert [inspect.signature(x.forward) for x in (m, m.layers[0])] == sigs
    names = [u.name for u in off.units]
    assert names[:3] == ["layers.0", "layers.1", "layers.2"]
    assert sorted(names[3:]) == ["embed", "norm", "rotary"]
    for i, layer in enumerate(m.layers):
        unit = off.units[i]
        assert {id(e.tensor) for e in unit.entries} == {id(p) for p in layer.parameters()}
        offsets = [e.offset for e in unit.entries]
        assert all(o % 256 == 0 for o in offsets) and offsets == sorted(offsets)
    st = off.stats()
    assert st["buffers_host"]["current"] + st["buffers_resident"]["current"] == len(off.units)
    # forwards wrapped only on blocks and on modules outside them that hold tensors, and the top
    hooked = {n for n, sub in m.named_modules() if "forward" in sub.__dict__}
    assert hooked == {"", "embed", "rotary", "layers.0", "layers.1", "layers.2", "norm", "lm_head"}
    off.remove()


def test_explicit_blocks():
    m = frozen(make_decoder(layers=2))
    off = spt.offload(m, budget="8MiB", blocks=[m.layers[0].mlp, m.layers[1]], **EMU)
    names = [u.name for u in off.units]
    assert names[:2] == ["layers.0.mlp", "layers.1"]
    assert "layers.0.attn.qkv" in names  # the rest of layer 0: one unit per module
    ref = copy.deepcopy(m)
    off.remove()
    ids = torch.randint(0, 97, (1, 5))
    off = spt.offload(m, budget="8MiB", blocks=[m.layers[0].mlp], **EMU)
    assert torch.equal(m(ids)[0], ref(ids)[0])
    off.remove()


class Inner(nn.Module):
    def __init__(self, lin: nn.Linear, w: nn.Parameter) -> None:
        super().__init__()
        self.lin = lin
        self.w = w

    def forward(self, x):
        return self.lin(self.lin(x) * self.w)


class Reuse(nn.Module):
    """One Linear called four times (twice inside another module), a tied parameter whose
    unit is already acquired when a submodule asks for it (nesting), blocks called out of
    registration order."""

    def __init__(self, dim: int = 1024) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(dim) + 0.5)
        self.lin = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(4))
        self.inner = Inner(self.lin, self.scale)
        self.order = [2, 0, 3, 1]

    def forward(self, x):
        x = self.lin(x) * self.scale
        for i in self.order:
            x = torch.tanh(self.blocks[i](x))
        return self.lin(self.inner(x))


def test_large_units_are_mapped_in_large_pages():
    # 8 MiB units: the offload's context maps them in 8 MiB pages (one physical allocation
    # each on cuda), so the device memory held is a whole number of them; a page never exceeds
    # what divides every unit, and the user's own choice stands
    m = frozen(nn.Sequential(*[nn.Linear(1024, 2048, bias=False) if i % 2 == 0 else nn.Linear(2048, 1024, bias=False)
                               for i in range(6)]))
    ref = copy.deepcopy(m)
    x = torch.randn(3, 1024)
    with pytest.raises(spillway.ConfigError, match="8.00 MiB pages"):
        spt.offload(copy.deepcopy(m), budget="6MiB", vmm="on", **EMU)
    # a page the user gives is rounded as the library rounds it: 12 MiB pages are 16 MiB ones
    with pytest.raises(spillway.ConfigError, match="16.00 MiB pages"):
        spt.offload(copy.deepcopy(m), budget="12MiB", vmm_large_page="12MiB", **EMU)
    off = spt.offload(m, budget="20MiB", vmm="on", **EMU)
    for _ in range(3):
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    held = off.stats()["held"]
    assert held["peak"] == 16 * MiB and held["current"] % (8 * MiB) == 0
    off.remove()
    assert spt._device._large_page([8 * MiB, 24 * MiB, 4096]) == 8 * MiB
    # a Llama layer and its embedding: 8 MiB pages round them up by 2.1%, 16 MiB ones by 3.3%
    assert spt._device._large_page([416 * MiB + 16384, 250 * MiB]) == 8 * MiB
    assert spt._device._large_page([416 * MiB + 16384] * 32 + [250 * MiB] * 2) == 8 * MiB
    # the same with its norms in the shared unit of small tensors: 416 MiB is 13 pages of 32 MiB
    assert spt._device._large_page([416 * MiB] * 32 + [250 * MiB] * 2) == 32 * MiB
    assert spt._device._large_page([128 * MiB] * 32) == 128 * MiB  # one physical allocation a unit
    assert spt._device._large_page([4 * 1024 * MiB]) == 1024 * MiB  # the library's largest page
    off = spt.offload(m, budget="20MiB", vmm_large_page="2MiB", **EMU)
    for _ in range(3):
        assert torch.equal(m(x), ref(x))
    # in 2 MiB pages the room beside a unit (used to start the next upload early) is mapped up
    # to the budget, which 8 MiB pages could not do
    assert off.stats()["held"]["peak"] == 20 * MiB
    off.remove()


class NormedBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)  # a 4 MiB weight with a 4 KiB bias
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def test_small_tensors_of_blocks_share_one_unit():
    # Blocks holding large and small tensors: the small ones (bias, norm) of every block go to
    # one unit, so each block's unit is its weight alone, a whole number of 4 MiB pages; a block
    # of small tensors only stays whole. Outputs stay bitwise equal, also with backward.
    torch.manual_seed(0)
    m = nn.Sequential(*[NormedBlock(1024) for _ in range(4)], nn.Sequential(nn.Linear(8, 1024), nn.LayerNorm(1024)))
    m = frozen(nn.Sequential(m[4], *m[:4]))
    ref = copy.deepcopy(m)
    x = torch.randn(3, 8)
    off = spt.offload(m, budget="12MiB", blocks=list(m), **EMU)
    sizes = {u.name: u.nbytes for u in off.units}
    assert [sizes[f"{i}"] for i in range(1, 5)] == [4 * MiB] * 4
    small = [u for u in off.units if u.name == "small tensors of the blocks"]
    assert len(small) == 1 and len(small[0].entries) == 4 * 3  # bias, norm weight, norm bias
    assert sizes["0"] == (8 * 1024 + 3 * 1024) * 4  # small tensors only: stays whole
    assert spt._device._large_page(sizes.values()) == 4 * MiB
    for _ in range(3):
        assert torch.equal(m(x), ref(x))
    a = torch.randn(3, 8, requires_grad=True)
    b = a.detach().clone().requires_grad_(True)
    moved(off, lambda: m(a).square().sum().backward())
    ref(b).square().sum().backward()
    assert torch.equal(a.grad, b.grad)
    assert off.stats()["offload"]["acquires"] > 0
    off.remove()
    for name, t in ref.state_dict().items():
        assert torch.equal(m.state_dict()[name], t), name


def test_reuse_nesting_and_out_of_order():
    torch.manual_seed(1)
    m = frozen(Reuse())
    ref = copy.deepcopy(m)
    x = torch.randn(3, 1024)
    off = spt.offload(m, budget="12MiB", policy="plan", **EMU)  # five 4 MiB weights
    for order in ([2, 0, 3, 1], [2, 0, 3, 1], [1, 3, 0, 2], [0, 1, 2, 3]):
        m.order = ref.order = order
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    h = off.stats()["offload"]
    assert h["acquires"] > 0 and h["view_hits"] > 0
    assert off.stats()["pinned"]["current"] == 0  # every nested acquire was released
    off.remove()


def test_plan_moves_fewer_bytes_than_lru():
    ids = torch.randint(0, 97, (1, 6))
    bytes_moved = {}
    for policy in ("lru", "plan"):
        m = frozen(make_decoder(dim=128, layers=8))
        off = spt.offload(m, budget="4MiB", policy=policy, prefetch="off", **EMU)
        with torch.no_grad():
            for _ in range(5):
                m(ids)
            moved(off, lambda: m(ids))  # the last step moves the weights too
        st = off.stats()
        bytes_moved[policy] = st["bytes_h2d"]["total"]
        if policy == "plan":
            assert st["plan_hits"]["total"] > 0
            assert "plan hits" in off.summary()
        off.remove()
    assert bytes_moved["plan"] < 0.8 * bytes_moved["lru"], bytes_moved


def test_explicit_steps_suspend_automatic_marking():
    m = frozen(make_stack())
    x = torch.randn(2, 64)
    off = spt.offload(m, budget="4MiB", **EMU)
    with off.step():
        m(x)
        m(x)
    assert off.stats()["offload"]["steps"] == 1
    m(x)
    assert off.stats()["offload"]["steps"] == 2
    off.remove()


def test_inference_mode_then_grad_mode():
    m = frozen(make_stack(dim=1024))
    ref = copy.deepcopy(m)
    x = torch.randn(2, 1024)
    off = spt.offload(m, budget="10MiB", **EMU)
    with torch.inference_mode():
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    xg = x.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    moved(off, lambda: m(xg).sum().backward())  # views cached under inference_mode are usable by autograd
    ref(xr).sum().backward()
    assert torch.equal(xg.grad, xr.grad)
    off.remove()


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(r, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, r) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def test_backward_through_frozen_offloaded_weights():
    base = make_decoder(dim=128, layers=8)
    frozen(base)
    for layer in base.layers:
        layer.attn.qkv = LoRA(layer.attn.qkv)  # adapters live inside the offloaded blocks
    ref = copy.deepcopy(base)
    ids = torch.randint(0, 97, (2, 6))
    target = torch.randint(0, 97, (2, 6))
    off = spt.offload(base, budget="4MiB", **EMU)
    adapters = {n for n, p in base.named_parameters() if p.requires_grad}
    assert len(adapters) == 16
    for u in off.units:  # trainable parameters stay resident, outside every unit
        assert not any(e.tensor.requires_grad for e in u.entries)
    assert "kept resident     16 trainable parameters" in off.summary()

    def loss_of(model):
        logits, _ = model(ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    for _ in range(2):
        for p in list(base.parameters()) + list(ref.parameters()):
            p.grad = None
        loss, loss_ref = moved(off, lambda: loss_of(base)), loss_of(ref)
        assert torch.equal(loss, loss_ref)
        loss.backward()
        loss_ref.backward()
        got = dict(base.named_parameters())
        for n, p in ref.named_parameters():
            if p.requires_grad:
                assert torch.equal(got[n].grad, p.grad), n
            else:
                assert got[n].grad is None
    h = off.stats()["offload"]
    assert h["saved_packed"] > 0 and h["saved_reacquires"] > 0
    assert off.stats()["pinned"]["current"] == 0
    off.remove()


def test_a_module_added_after_offload_on_another_device_is_named():
    """A module added after offload() on another device than the offload's (peft's adapters, made
    beside the host copies of the weights they wrap; here a module on "meta", the emu backend's
    device being the host): PyTorch's device mismatch becomes a ConfigError naming its tensors
    and what to do; the offload stays usable. Other errors of the forward pass through as they are."""
    m = WithAdapter()
    off = spt.offload(m, budget="4MiB", backend="emu")
    x = torch.randn(2, 512)
    m.adapter = nn.Linear(512, 512, device="meta")
    with pytest.raises(spillway.ConfigError, match=r"'adapter.weight' \(meta\), 'adapter.bias' \(meta\) not offloaded") as e:
        with torch.no_grad():
            m(x)
    assert "add them before offload()" in str(e.value) and "same device" in str(e.value.__cause__)
    m.adapter = nn.Linear(512, 7)  # a shape error of the caller's own: raised as PyTorch's
    with pytest.raises(RuntimeError) as e2, torch.no_grad():
        m(x)
    assert not isinstance(e2.value, spillway.ConfigError)
    m.adapter = None
    with torch.no_grad():
        assert m(x).shape == (2, 512) and not off._acquired
    off.remove()


def test_adapters_beside_blocks_called_one_by_one_get_exact_gradients():
    """Frozen blocks called one by one from the caller's loop (the offloaded module's own forward
    never runs), adapters added beside each: backward reads every weight as it was in forward,
    also when the weights really moved in between (a weight saved for backward as a device view
    would be read after its unit's memory held another unit)."""
    torch.manual_seed(0)
    base = frozen(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)]))
    ref = copy.deepcopy(base)
    adapters = [(torch.randn(1024, 8) * 0.02, torch.randn(8, 1024) * 0.02) for _ in base]
    ours = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in adapters]
    theirs = [(a.clone().requires_grad_(), b.clone().requires_grad_()) for a, b in adapters]
    x = torch.randn(4, 1024)

    def loss_of(model, ads):
        h = x
        for lin, (a, b) in zip(model, ads):
            h = lin(h) + h @ a @ b
        return h.square().mean()

    off = spt.offload(base, budget="8MiB", **EMU)  # 24 MiB of weights
    for _ in range(2):
        loss = moved(off, lambda: loss_of(base, ours))
        want = loss_of(ref, theirs)
        assert torch.equal(loss, want)
        before = off.context.stats()["bytes_h2d"]["total"]
        loss.backward()  # brings back the weights saved for it (all but the first layer's)
        assert off.context.stats()["bytes_h2d"]["total"] - before >= 3 * 4 * MiB
        want.backward()
        for (a, b), (ra, rb) in zip(ours, theirs):
            assert torch.equal(a.grad, ra.grad) and torch.equal(b.grad, rb.grad)
            a.grad = b.grad = ra.grad = rb.grad = None
    assert off.stats()["offload"]["saved_reacquires"] > 0
    off.remove()


def test_backward_after_remove_is_an_error():
    m = frozen(make_stack())
    x = torch.randn(2, 64, requires_grad=True)
    off = spt.offload(m, budget="4MiB", **EMU)
    y = m(x).sum()
    off.remove()
    with pytest.raises(RuntimeError, match="StateError.*before remove"):  # autograd re-wraps it
        y.backward()


class Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * self.calls


def test_buffer_mutated_in_place_is_written_through():
    torch.manual_seed(0)
    m = frozen(nn.Sequential(Counter(), Counter()))
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="4MiB", **EMU)
    x = torch.randn(2, 8)
    for _ in range(3):
        assert torch.equal(m(x), ref(x))
    assert m[0].calls.item() == 3.0
    assert off.stats()["offload"]["buffer_writebacks"] == 6
    assert off.stats()["offload"]["edit_evictions"] == 0  # the forward's own writes are not edits
    off.remove()
    assert torch.equal(m[1].calls, ref[1].calls)


def test_edits_of_the_weights_between_forwards_reach_the_device():
    """load_state_dict, an in-place op under no_grad, torch.nn.init and a .data replaced, between
    forwards, while the plan keeps units on the device across them: the next forward computes
    with the new weights, and the units edited (only those) are uploaded again. An in-place op
    on .data is not seen until refresh_weights(); a .data of another shape is a ConfigError."""
    m, other = frozen(make_stack(dim=1024, depth=8)), frozen(make_stack(seed=1, dim=1024, depth=8))
    x = torch.randn(4, 1024)
    off = spt.offload(m, budget="20MiB", **EMU)  # 32 MiB of weights: some stay across forwards
    for _ in range(4):
        m(x)
    h2d = lambda: off.context.stats()["bytes_h2d"]["total"]  # noqa: E731
    before = h2d()
    m(x)
    steady = h2d() - before
    assert off.stats()["offload"]["edit_evictions"] == 0

    def check(edit, evicted):
        edit()
        n0, b0 = off.stats()["offload"]["edit_evictions"], h2d()
        assert torch.equal(m(x), other(x))
        assert off.stats()["offload"]["edit_evictions"] - n0 == evicted
        return h2d() - b0

    moved_all = check(lambda: m.load_state_dict(other.state_dict()), len(off.units))
    assert moved_all >= sum(u.nbytes for u in off.units) > steady  # every unit came back
    def double_first(model):
        with torch.no_grad():
            model[0].weight.mul_(2)

    double_first(other)
    check(lambda: double_first(m), 1)
    with torch.no_grad():
        other[2].bias.zero_()
    check(lambda: nn.init.zeros_(m[2].bias), 1)
    new = torch.randn(1024, 1024) / 32
    other[4].weight.data = new.clone()
    check(lambda: setattr(m[4].weight, "data", new.clone()), 1)
    # the new values went into the pack, and the parameter is a view of it again
    assert any(u.pack.data_ptr() <= m[4].weight.data_ptr() < u.pack.data_ptr() + u.pack.numel() for u in off.units)
    with torch.no_grad():
        other[6].weight.add_(1)
    m[6].weight.data += 1  # not seen: a .data op bumps no version
    off.refresh_weights()
    assert torch.equal(m(x), other(x))
    m[0].weight.data = torch.zeros(8, 8)
    with pytest.raises(spillway.ConfigError, match="replaced by a torch.float32 tensor of shape"):
        m(x)
    off.remove()


class LoraLike(nn.Module):
    """peft's LoRA layer in miniature: a base layer, an adapter added to its output, and merge()
    and unmerge() that add the adapter into the base weight in place on .data, as peft does."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.1)
        self.merged = False

    def delta(self) -> torch.Tensor:
        return self.lora_B.weight @ self.lora_A.weight

    def merge(self, safe_merge: bool = False) -> None:
        self.seen = [t.data_ptr() for t in self.parameters()]  # where the merge found its tensors
        if safe_merge:  # peft's safe_merge: the sum checked in a copy, then put in place
            w = self.base_layer.weight.data.clone()
            w += self.delta()
            self.base_layer.weight.data = w
        else:
            self.base_layer.weight.data += self.delta()
        self.merged = True

    def unmerge(self) -> None:
        self.seen = [t.data_ptr() for t in self.parameters()]
        self.base_layer.weight.data -= self.delta()
        self.merged = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_layer(x)
        return y if self.merged else y + self.lora_B(self.lora_A(x))


def test_an_adapter_merged_into_its_offloaded_base_reaches_the_device():
    """An adapter layer's merge() and unmerge() write the base weight through .data (in place,
    or a new tensor with safe_merge), which no version counter sees (peft's merge_and_unload, a
    pipeline's fuse_lora): the offload runs them on device copies of the base weights, puts the
    result in the packs and drops the device copies of those units, so forwards compute with the
    merged weights, also for the units the plan keeps on the device across forwards."""
    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return frozen(nn.Sequential(*[nn.Sequential(LoraLike(nn.Linear(1024, 1024)), nn.Tanh()) for _ in range(8)]))

    m, ref = model(), model()
    x = torch.randn(4, 1024)
    off = spt.offload(m, budget="20MiB", **EMU)  # 32 MiB of weights: some stay across forwards
    for _ in range(4):
        assert torch.equal(m(x), ref(x))
    for i, (a, b) in enumerate(zip(m, ref)):
        a[0].merge(safe_merge=i % 2 == 1)
        b[0].merge(safe_merge=i % 2 == 1)
    assert torch.equal(m(x), ref(x))
    assert off.stats()["offload"]["edit_evictions"] >= 8
    packs = [(u.pack.data_ptr(), u.pack.data_ptr() + u.pack.numel()) for u in off.units]
    in_pack = lambda ptr: any(lo <= ptr < hi for lo, hi in packs)  # noqa: E731
    for a in m:  # the merged weights are in the packs: the parameters are their views still
        assert in_pack(a[0].base_layer.weight.data_ptr())
        # the merge ran on device copies of all the layer's offloaded tensors, the frozen
        # adapters' too (a pipeline's loaded LoRA): on CUDA host views would mix devices
        assert not any(map(in_pack, a[0].seen))
    for a, b in zip(m, ref):
        a[0].unmerge()
        b[0].unmerge()
        assert not any(map(in_pack, a[0].seen))
    assert torch.equal(m(x), ref(x))
    off.remove()
    assert "merge" not in m[0][0].__dict__  # the wrappers are gone


def _adapter_blocks() -> nn.Sequential:
    """Four blocks of four adapter layers over 1024 x 1024 bases (64 MiB in all): at a budget of
    40 MiB a block is split and the adapter layers are the units (or group two of them)."""
    torch.manual_seed(0)
    return frozen(nn.Sequential(*[nn.Sequential(*[LoraLike(nn.Linear(1024, 1024)) for _ in range(4)], nn.Tanh())
                                  for _ in range(4)]))


def _per_call(off, fn) -> tuple:
    s0 = off.stats()
    out = fn()
    s1 = off.stats()
    return out, s1["offload"]["acquires"] - s0["offload"]["acquires"], s1["bytes_h2d"]["total"] - s0["bytes_h2d"]["total"]


class PeftLike(nn.Module):
    """peft's PeftModel in miniature: a wrapper whose merge_and_unload() merges every adapter
    layer below it, puts the base layers in their places and returns the model it wraps."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.base_model = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_model(x)

    def merge_and_unload(self) -> nn.Module:
        for blk in self.base_model:
            for i, layer in enumerate(blk):
                if isinstance(layer, LoraLike):
                    layer.merge()
                    blk[i] = layer.base_layer
        return self.base_model


def test_the_model_merge_and_unload_returns_runs_the_plans_steps():
    """merge_and_unload() returns the wrapped model, whose forward is not the offloaded
    module's: it gets a top-level forward of its own, so that its forwards are steps (the plan
    learns them) and not loose acquires."""
    m, ref = PeftLike(_adapter_blocks()), PeftLike(_adapter_blocks())
    x = torch.randn(4, 1024)
    off = spt.offload(m, budget="40MiB", **EMU)
    for _ in range(2):
        m(x)
    merged, ref_merged = m.merge_and_unload(), ref.merge_and_unload()
    steps = off.stats()["offload"]["steps"]
    for _ in range(3):
        assert torch.equal(merged(x), ref_merged(x))
    assert off.stats()["offload"]["steps"] == steps + 3
    assert torch.equal(m(x), ref(x))  # the wrapper still runs, one step a forward
    assert off.stats()["offload"]["steps"] == steps + 4
    off.remove()
    assert "forward" not in merged.__dict__ and "merge_and_unload" not in m.__dict__


def test_modules_registered_after_offload_are_taken_in(monkeypatch):
    """Where torch reports module registrations (2.0 on; here on torch 1.x the hook is called as
    torch's Module.__setattr__ calls it), an adapter layer put into an offloaded model marks the
    offload, and its next forward takes the new modules in: their merges wrapped, watched from
    then on (on CUDA also their tensors moved to the device: tests/gpu/test_peft_gpu.py). A
    registration elsewhere marks nothing; remove() takes the hook out with the last offload."""
    from spillway.torch import _added
    hooks = []

    def register(h):
        hooks.append(h)
        return types.SimpleNamespace(remove=lambda: hooks.remove(h))

    monkeypatch.setattr(_added, "_register", register)
    monkeypatch.setattr(_added, "_handle", None)

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return frozen(nn.Sequential(*[nn.Sequential(nn.Linear(1024, 1024), nn.Tanh()) for _ in range(4)]))

    m, ref = model(), model()
    x = torch.randn(4, 1024)
    off = spt.offload(m, budget="6MiB", **EMU)
    m(x)
    assert len(hooks) == 1 and not off._added
    hooks[0](nn.Sequential(), "0", nn.Linear(2, 2))  # a module built elsewhere
    assert not off._added
    for mm in (m, ref):
        torch.manual_seed(1)
        mm[2][0] = LoraLike(mm[2][0])
    hooks[0](m[2], "0", m[2][0])
    assert off._added
    assert torch.equal(m(x), ref(x))
    assert not off._added and m[2][0] in off._watched and "merge" in m[2][0].__dict__
    m[2][0].merge()
    ref[2][0].merge()
    _, _, moved = _per_call(off, lambda: m(x))
    assert torch.equal(m(x), ref(x)) and moved > 0
    off.remove()
    assert hooks == [] and "merge" not in m[2][0].__dict__


def test_the_innermost_base_layer_of_stacked_adapter_layers_takes_over_their_hook():
    """Adapter layers stacked (one over another): peft puts the innermost base layer in place."""
    def stacked() -> LoraLike:
        inner = LoraLike(nn.Linear(1024, 1024))
        inner.in_features = inner.out_features = 1024
        return LoraLike(inner)

    def model() -> nn.Sequential:
        torch.manual_seed(0)
        return frozen(nn.Sequential(*[nn.Sequential(*[stacked() for _ in range(4)], nn.Tanh()) for _ in range(4)]))
    m, ref = model(), model()
    x = torch.randn(4, 1024)
    off = spt.offload(m, budget="40MiB", vmm="on", **EMU)  # pages: the adapter layers are units
    assert any(isinstance(h, LoraLike) and id(h) in off._needs for h in m.modules())
    for _ in range(2):
        m(x)
    for mm in (m, ref):
        for blk in mm:
            for i in range(4):
                blk[i] = blk[i].base_layer.base_layer
    out, acquires, moved = _per_call(off, lambda: m(x))
    assert torch.equal(out, ref(x)) and acquires >= 16 and moved > 0
    off.remove()


def test_a_base_layer_put_in_place_of_its_adapter_layer_takes_over_its_hook():
    """peft's merge_and_unload() (and unload(), a pipeline's unload_lora_weights()) puts each
    adapter layer's base layer in its place. Where the partition made adapter layers the units,
    the base layers must take over their hooks, or they compute from the host views unhooked
    (on CUDA a device mismatch); also when called from a submodule, as the model that
    merge_and_unload() returns is."""
    m, ref = _adapter_blocks(), _adapter_blocks()
    x = torch.randn(4, 1024)
    off = spt.offload(m, budget="40MiB", vmm="on", **EMU)  # pages: the adapter layers are units
    assert any(isinstance(h, LoraLike) and id(h) in off._needs for h in m.modules())  # the case: adapter layers are hooked
    for _ in range(3):
        m(x)
    _, acquires, moved = _per_call(off, lambda: m(x))
    assert moved > 0
    for mm in (m, ref):
        for blk in mm:
            for i in range(4):
                blk[i].merge()
                blk[i] = blk[i].base_layer
    for _ in range(2):
        assert torch.equal(m(x), ref(x))
    out, after, moved_after = _per_call(off, lambda: m(x))
    assert torch.equal(out, ref(x))
    assert after == acquires and moved_after > 0  # the base layers acquire the units that hold them
    out, inner, moved_inner = _per_call(off, lambda: m[3](m[2](x)))  # submodules called directly
    assert torch.equal(out, ref[3](ref[2](x)))
    assert inner >= 4 and moved_inner > 0
    off.remove()
    assert all("forward" not in s.__dict__ for s in m.modules())
    assert torch.equal(m(x), ref(x))


def test_remove_restores_exactly_and_leaves_nothing_held():
    m = make_decoder(layers=3)
    frozen(m)
    m.layers[1].mlp[0].weight.requires_grad_(True)  # one trainable parameter stays put
    ref = copy.deepcopy(m)
    snap = snapshot(m)
    ids = torch.randint(0, 97, (1, 4))
    off = spt.offload(m, budget="4MiB", **EMU)
    for _, (t, ptr, *_rest) in snap.items():
        if not t.requires_grad:
            assert t.data_ptr() != ptr  # it moved into the pack
    m(ids)
    stale = m.norm.forward  # the wrapper, kept past remove() by a caller
    ctx = off.context
    off.remove()
    assert ctx.closed
    x = torch.randn(1, 4, 32)
    assert torch.equal(stale(x), ref.norm(x))  # runs the plain forward: nothing to acquire
    assert off.final_stats["live"]["current"] == 0 and off.final_stats["pinned"]["current"] == 0
    assert off.final_stats["buffers_resident"]["current"] == 0
    now = dict(list(m.named_parameters()) + list(m.named_buffers()))
    for n, (t, _ptr, val, stride, dev) in snap.items():
        assert now[n] is t and torch.equal(t, val) and t.stride() == stride and t.device == dev, n
        assert t.requires_grad == dict(ref.named_parameters()).get(n, t).requires_grad
    assert m.lm_head.weight is m.embed.weight
    assert not any("forward" in s.__dict__ or s._forward_pre_hooks or s._forward_hooks for s in m.modules())
    assert torch.equal(m(ids)[0], ref(ids)[0])
    with pytest.raises(spillway.StateError, match="removed"):
        off.remove()
    off2 = spt.offload(m, budget="4MiB", **EMU)  # can be offloaded again
    off2.remove()




@pytest.mark.parametrize("stage", ["pack", "wrap_forward"])
def test_a_failure_midway_through_offload_puts_everything_back(monkeypatch, stage):
    """A failure after some units were packed (or some forwards wrapped) undoes them all: the
    same tensor objects with their values, devices and strides, no wrapper left, the model's
    class and its context gone; the module can be offloaded again."""
    from spillway.torch import _patch, _views
    m = make_decoder(layers=3)
    frozen(m)
    ref = copy.deepcopy(m)
    snap = snapshot(m)

    def storage_bytes(t):
        return (t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage()).nbytes()

    storage = {n: storage_bytes(t) for n, (t, *_r) in snap.items()}
    cls = type(m)
    owner = {"pack": _views, "wrap_forward": _patch}[stage]
    calls = fail_at_call(monkeypatch, owner, stage, 3)
    with pytest.raises(RuntimeError, match="injected failure"):
        spt.offload(m, budget="4MiB", **EMU)
    assert len(calls) == 3  # two went through before the failure: there was something to undo
    monkeypatch.undo()
    now = dict(list(m.named_parameters()) + list(m.named_buffers()))
    for n, (t, _ptr, val, stride, dev) in snap.items():
        assert now[n] is t and torch.equal(t, val) and t.stride() == stride and t.device == dev, n
        assert storage_bytes(t) == storage[n], n  # its own memory again, not a view of a pack
    assert type(m) is cls and m.lm_head.weight is m.embed.weight
    assert not any("forward" in s.__dict__ for s in m.modules())
    ids = torch.randint(0, 97, (1, 4))
    assert torch.equal(m(ids)[0], ref(ids)[0])
    off = spt.offload(m, budget="4MiB", **EMU)  # nothing of the failed one is left in the way
    with torch.no_grad():
        assert torch.equal(m(ids)[0], ref(ids)[0])
    off.remove()


def test_out_of_memory_during_forward_is_torch_oom(tmp_path):
    class Wide(nn.Module):
        def __init__(self):
            super().__init__()
            self.own = nn.Parameter(torch.randn(400_000))  # the top level's unit, held all forward
            self.blocks = nn.Sequential(nn.Linear(600, 600), nn.Linear(600, 600))

        def forward(self, x):
            return self.blocks(x) * self.own[:600]

    m = frozen(Wide())
    # the budget holds what the forward holds at once (the top level's unit, the blocks' biases
    # and one block, a 2 MiB page each), but with on_exhaust=fail the second block cannot evict
    # the first
    off = spt.offload(m, budget="6MiB", on_exhaust="fail", trace=str(tmp_path / "t.json"), **EMU)
    assert off.min_budget == 6 * MiB
    with pytest.raises(torch.cuda.OutOfMemoryError) as info:
        m(torch.randn(1, 600))
    assert isinstance(info.value, spillway.OutOfMemoryError)
    assert "budget 6.00 MiB" in str(info.value)
    assert off.stats()["pinned"]["current"] == 0  # the failed forward released what it held
    off.remove()
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert events


def test_a_budget_below_what_a_forward_holds_at_once_is_refused():
    """A block that shares a tied weight with another holds both units at once: a budget that
    holds the largest unit but not that pair is refused before anything moves."""
    torch.manual_seed(0)
    first = Big()
    m = frozen(nn.ModuleList([first, Big(shared=first.own)]))
    snap = snapshot(m)
    with pytest.raises(spillway.ConfigError, match=r"below what 1 holds at once, 2 units \(1, 0.*4.00 MiB"):
        spt.offload(m, budget="2MiB", **EMU)
    assert_unchanged(m, snap)
    off = spt.offload(m, budget="4MiB", **EMU)
    assert off.min_budget == 4 * MiB
    off.remove()


class Slicer(nn.Module):
    """Returns views of its own weight (a position table): alone, in a tuple (of one, or with
    another tensor), or in a dict."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(4096, 256))  # 4 MiB: three do not fit the budget
        self.kind = kind

    def forward(self, i: int):
        if self.kind == "tensor":
            return self.table[i]
        if self.kind == "tuple1":
            return (self.table[i],)
        if self.kind == "tuple":
            return self.table[i], self.table[i + 1] * 2  # a view and a fresh tensor
        return {"row": self.table[i]}


class Tables(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Slicer(kind) for _ in range(3))

    def forward(self, i: int):
        return [b(i) for b in self.blocks]


def flat(out):
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for v in out.values() for t in flat(v)]
    return [t for x in out for t in flat(x)]


@pytest.mark.parametrize("kind", ["tensor", "tuple1", "tuple", "dict"])
def test_outputs_viewing_a_released_unit_are_copies(kind):
    """A module output that views the unit its forward hook releases is replaced by a copy:
    nothing returned points into device memory that a later eviction reuses."""
    torch.manual_seed(0)
    m = frozen(Tables(kind))
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="8MiB", **EMU)
    for step in range(3):
        got, want = moved(off, lambda: m(step)), ref(step)
        for g, w in zip(got, want):
            assert same(flat(g), flat(w))
        ranges = [(u.dev_at, u.dev_at + u.nbytes) for u in off.units if u.dev_at]
        assert ranges
        for t in flat(got):
            assert not any(lo <= t.data_ptr() < hi for lo, hi in ranges)
    assert off.stats()["offload"]["outputs_cloned"] == 3 * len(m.blocks)  # one view per output
    off.remove()


class Big(nn.Module):
    def __init__(self, shared: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        self.own = nn.Parameter(torch.randn(450_000))  # 1.8 MB: two fit 4 MiB, three do not
        self.shared = shared

    def forward(self, x):
        s = self.own[:x.shape[-1]]
        if self.shared is not None:
            s = s * self.shared[:x.shape[-1]]
        return x * s


def test_failed_acquire_in_a_hook_releases_what_the_hook_acquired():
    """A block needing two units (its own and the one holding a weight it shares) that cannot
    have both: its wrapper raises torch's OOM and gives back the unit it did acquire, so the
    next call still runs under the budget."""
    torch.manual_seed(0)
    first = Big()
    m = frozen(nn.ModuleList([first, Big(shared=first.own), Big()]))
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="4MiB", on_exhaust="fail", **EMU)  # no eviction: the room is what is free
    assert [len(off._needs[id(b)]) for b in m] == [1, 2, 1]
    x = torch.randn(2, 8)
    assert torch.equal(m[2](x), ref[2](x))  # its unit stays cached, taking half of the budget
    with pytest.raises(torch.cuda.OutOfMemoryError):
        m[1](x)  # its own unit fits beside it, the shared one does not
    assert off.stats()["pinned"]["current"] == 0
    for u in off.units:  # every tensor points at its host copy again
        lo = u.pack.data_ptr()
        assert all(lo <= e.tensor.data_ptr() < lo + u.pack.numel() for e in u.entries)
    assert torch.equal(m[2](x), ref[2](x))
    off.remove()


class Boom(nn.Linear):
    """A Linear whose forward raises while .fail is set, after reading its weight."""

    fail = False

    def forward(self, x):
        y = super().forward(x)
        if self.fail:
            raise RuntimeError("boom")
        return y


@pytest.mark.parametrize("direct", [False, True], ids=["in-the-model", "called-alone"])
def test_an_exception_in_a_block_releases_it_and_own_hooks_still_run(direct):
    """A block's forward that raises gives its unit back (inside the model's forward, where its
    C release is deferred, and called alone); the caller's own forward hooks on a block run
    around offload()'s wrapper, a pre-hook present at offload() seeing the device copy (a plain
    tensor in the Parameter's slot), a forward hook the output."""
    torch.manual_seed(0)
    m = frozen(nn.Sequential(nn.Linear(64, 64), Boom(64, 64), nn.Linear(64, 64)))
    ref = copy.deepcopy(m)
    seen = []
    m[1].register_forward_pre_hook(lambda mod, args: seen.append(type(mod._parameters["weight"])))
    m[1].register_forward_hook(lambda mod, args, out: seen.append(out.shape))
    off = spt.offload(m, budget="4MiB", blocks=list(m), **EMU)
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    assert seen == [torch.Tensor, torch.Size([2, 64])]
    m[1].fail = True
    with torch.no_grad(), pytest.raises(RuntimeError, match="boom"):
        m[1](x) if direct else m(x)
    assert off.stats()["pinned"]["current"] == 0
    for u in off.units:  # every tensor points at its host copy again
        lo = u.pack.data_ptr()
        assert all(lo <= e.tensor.data_ptr() < lo + u.pack.numel() for e in u.entries)
        assert u.refs == 0
    assert not off._acquired and off._pend is None
    m[1].fail = False
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    off.remove()
    assert torch.equal(m(x), ref(x))


def test_a_deep_copy_of_an_offloaded_model_runs_its_own_tensors():
    """copy.deepcopy of an offloaded model (or of one block) gives a plain module on copies of
    the host views: it computes with its own weights and acquires nothing of the offload's."""
    m = frozen(make_stack())
    ref = copy.deepcopy(m)
    x = torch.randn(2, 64)
    off = spt.offload(m, budget="4MiB", **EMU)
    with torch.no_grad():
        m(x)
        twin, block = copy.deepcopy(m), copy.deepcopy(m[2])
        acquires = off.acquires
        assert torch.equal(twin(x), ref(x)) and torch.equal(block(x), ref[2](x))
        assert off.acquires == acquires
        twin[2].weight.zero_()
        block.weight.zero_()
        assert not torch.equal(twin(x), ref(x)) and torch.equal(block(x), torch.zeros(2, 64) + block.bias)
        assert torch.equal(m(x), ref(x))  # the offloaded model kept its weights
    assert off.acquires > acquires
    off.remove()


# ---- bad input: a clear exception, the module unchanged ----

def test_bad_inputs_leave_the_module_unchanged():
    m = frozen(make_decoder(layers=2))
    snap = snapshot(m)
    cases = [
        (dict(budget="lots"), spillway.ConfigError, "bad budget"),
        (dict(budget=True), spillway.ConfigError, "budget"),
        (dict(budget="1KiB"), spillway.ConfigError, "below the largest unit"),
        (dict(budget="64MiB", emu_capacity="32MiB"), spillway.ConfigError, "above the free device memory"),
        (dict(budget="4MiB", colour="red"), spillway.ConfigError, "unknown option 'colour'"),
        (dict(budget="4MiB", policy="fifo"), spillway.ConfigError, "policy"),
        (dict(budget="4MiB", blocks=[m.layers[0], m.layers[0]]), spillway.InvalidArgument, "twice"),
        (dict(budget="4MiB", blocks=[nn.Linear(2, 2)]), spillway.InvalidArgument, "not a submodule"),
        (dict(budget="4MiB", device="cuda"), spillway.ConfigError, "emu"),
    ]
    for kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            spt.offload(m, **kw, **EMU)
        assert_unchanged(m, snap)


def test_non_module_empty_module_trainable_module_and_twice():
    with pytest.raises(spillway.InvalidArgument, match="expected a torch.nn.Module"):
        spt.offload(torch.zeros(3), budget="4MiB", **EMU)
    with pytest.raises(spillway.InvalidArgument, match="no parameters"):
        spt.offload(nn.ReLU(), budget="4MiB", **EMU)
    trainable = make_stack()
    snap = snapshot(trainable)
    with pytest.raises(spillway.InvalidArgument, match="require grad.*requires_grad_"):
        spt.offload(trainable, budget="4MiB", offload_trainable=False, **EMU)
    assert_unchanged(trainable, snap)
    meta = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64, device="meta"))
    with pytest.raises(spillway.InvalidArgument, match="'meta' device; load its weights first"):
        spt.offload(meta, budget="4MiB", **EMU)
    meta[1]._hf_hook = object()  # what accelerate's dispatch (device_map=...) leaves on a module
    with pytest.raises(spillway.InvalidArgument, match="accelerate's hooks.*without device_map"):
        spt.offload(meta, budget="4MiB", **EMU)
    m = frozen(make_stack())
    off = spt.offload(m, budget="4MiB", **EMU)
    with pytest.raises(spillway.StateError, match="already offloaded"):
        spt.offload(m, budget="4MiB", **EMU)
    with pytest.raises(spillway.StateError, match="already offloaded"):
        spt.offload(nn.Sequential(m), budget="4MiB", **EMU)
    off.remove()


def test_handle_dropped_module_keeps_working_and_is_freed():
    import gc
    m = frozen(make_stack())
    ref = copy.deepcopy(m)
    x = torch.randn(2, 64)
    spt.offload(m, budget="4MiB", **EMU)  # handle not kept: the hooks keep it alive
    gc.collect()
    assert torch.equal(m(x), ref(x))
    with pytest.raises(spillway.StateError, match="already offloaded"):
        spt.offload(m, budget="4MiB", **EMU)
    probe = weakref.ref(m)
    del m
    gc.collect()
    assert probe() is None  # nothing global holds the module or its Offload


def test_hook_overhead_is_measured_and_views_are_reused():
    m = frozen(make_decoder(layers=4))
    off = spt.offload(m, budget="64MiB", **EMU)  # everything fits: addresses stay the same
    ids = torch.randint(0, 97, (1, 4))
    with torch.no_grad():
        for _ in range(20):
            m(ids)
    h = off.stats()["offload"]
    assert h["view_builds"] == len(off.units)  # built once per unit, then reused
    assert h["view_hits"] >= 19 * len(off.units)
    per_acquire_us = h["hook_ns"] / h["acquires"] / 1000
    assert per_acquire_us < 500, per_acquire_us  # loose: CI machines are slow and shared
    assert "host time per acquire" in off.summary() and h["hook_us_median"] > 0
    off.remove()


def test_device_property_reports_the_execution_device():
    """A model class whose `device` property reads its first parameter (transformers'
    PreTrainedModel) reports the execution device while offloaded, not the host views that the
    parameters are between forwards; remove() gives the class back."""

    class WithDevice(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(3))

        @property
        def device(self):
            return next(self.parameters()).device

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    m = frozen(WithDevice())
    x = torch.randn(2, 32)
    want = m(x)
    off = spt.offload(m, budget="4MiB", **EMU)
    assert type(m) is not WithDevice and isinstance(m, WithDevice)
    assert m.device == off.device
    assert torch.equal(m(x), want)
    off.remove()
    assert type(m) is WithDevice


def test_conversions_leave_the_offloaded_weights_alone():
    """model.to(device), .cpu(), .float() (a habit: pipe.to("cuda"), a trainer placing its
    model) keep the offloaded weights in their packs, and they still move every forward;
    resident trainable parameters convert as usual; a dtype change is a ConfigError that
    changes nothing. After remove() conversions are torch's again."""
    m = make_decoder(dim=128, layers=8)
    frozen(m)
    m.norm.weight.requires_grad_(True)  # kept resident (the rest is frozen)
    ref = copy.deepcopy(m)
    ids = torch.randint(0, 97, (2, 7))
    off = spt.offload(m, budget="4MiB", **EMU)
    packed = {n: t.data_ptr() for n, t in list(m.named_parameters()) + list(m.named_buffers())
              if n != "norm.weight"}
    assert m.to(off.device) is m and m.cpu() is m and m.float() is m and m.to(torch.float32) is m
    assert {n: t.data_ptr() for n, t in list(m.named_parameters()) + list(m.named_buffers())
            if n != "norm.weight"} == packed
    assert torch.equal(moved(off, lambda: m(ids)[0]), ref(ids)[0])
    # on emu the device is the host, where .to() moves nothing: to_empty() makes new tensors
    m.to_empty(device=off.device)
    assert {n: t.data_ptr() for n, t in list(m.named_parameters()) + list(m.named_buffers())
            if n != "norm.weight"} == packed
    with torch.no_grad():
        m.norm.weight.copy_(ref.norm.weight)  # the one resident parameter was made anew, uninitialized
    assert torch.equal(moved(off, lambda: m(ids)[0]), ref(ids)[0])
    snap = snapshot(m)
    for convert in (lambda: m.half(), lambda: m.to(torch.bfloat16), lambda: m.to("cpu", torch.float64),
                    lambda: m.double()):
        with pytest.raises(spillway.ConfigError, match="would turn the offloaded torch.float32 weights"):
            convert()
        for n, (t, ptr, val, stride, dev) in snap.items():  # the resident norm.weight too
            assert t.dtype == val.dtype and t.data_ptr() == ptr and torch.equal(t, val), n
    assert torch.equal(moved(off, lambda: m(ids)[0]), ref(ids)[0])
    off.remove()
    assert "_apply" not in m.__dict__
    m.double()
    assert m.layers[0].mlp[0].weight.dtype == torch.float64 and m.norm.weight.dtype == torch.float64


def test_units_keep_device_tensors_for_their_latest_addresses():
    # A unit cycling among a few device addresses (a streamed block of the static split, a block
    # under lru) re-points nothing after the first visit to each, up to _DEV_SETS addresses; one
    # more re-points the least recently used set. Every device tensor lies where its entry does.
    from spillway.torch import _offload

    n = _offload._DEV_SETS
    assert n >= 2
    m = frozen(make_stack())
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="4MiB", **EMU)
    u = off.units[0]
    mem = [torch.empty(u.nbytes, dtype=torch.uint8) for _ in range(n + 1)]
    ptrs = [t.data_ptr() for t in mem]
    first, extra = ptrs[:n], ptrs[n]
    visits = first + first + [extra] + first[1:] + [first[0]]
    want = list(range(1, n + 1)) + [n] * n + [n + 1] * n + [n + 2]
    builds = []
    for ptr in visits:
        dset = off._point(u, ptr)
        builds.append(off.view_builds)
        assert u.dev_at == ptr and dset is u.dev_set
        for e, d in zip(u.entries, dset[0]):
            assert d.data_ptr() == ptr + e.offset and d.shape == e.tensor.shape
    assert builds == want
    x = torch.randn(2, 64)
    with torch.no_grad():  # the real addresses afterwards: still equal
        for _ in range(3):
            assert torch.equal(m(x), ref(x))
    off.remove()


def test_prefetch_thread_option_reaches_the_library():
    # the library's worker for plan's prefetches, through offload's options: outputs unchanged
    m = frozen(make_stack(dim=1024, depth=8))  # 4 MiB weights, room for half of them
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="18MiB", prefetch="on", prefetch_thread="on", **EMU)
    x = torch.randn(2, 1024)
    for _ in range(6):
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    assert off.stats()["plan_prefetch_bytes"]["total"] > 0
    off.remove()
    with pytest.raises(spillway.ConfigError, match="prefetch_thread"):
        spt.offload(copy.deepcopy(ref), budget="18MiB", prefetch_thread="sometimes", **EMU)


class Swapping(nn.Module):
    """Reads its weight during forward, and at call `replace_at` stores a new Parameter of its own."""

    def __init__(self, replace_at: int = -1) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(64, 64))
        self.calls, self.replace_at, self.seen = 0, replace_at, []

    def forward(self, x):
        self.seen.append(self._parameters["weight"])
        if self.calls == self.replace_at:
            self.weight = nn.Parameter(torch.full((64, 64), 0.5), requires_grad=False)
        self.calls += 1
        return x @ self.weight


def test_parameters_are_swapped_in_their_modules_and_a_replacement_is_kept():
    # During a forward each holder's parameter dict has a device tensor, not the Parameter,
    # which stays the host view; after it the Parameter is back. A module that stores a new
    # parameter during its forward keeps it in later forwards.
    torch.manual_seed(0)
    a = frozen(Swapping())
    b = frozen(Swapping(replace_at=1))
    b.weight = a.weight  # tied: one unit, two holders
    m = nn.Sequential(a, b)
    w = a.weight
    want = a.weight.detach().clone()
    x = torch.randn(2, 64)
    off = spt.offload(m, budget="4MiB", **EMU)
    assert torch.equal(m(x), x @ want @ want)
    assert all(t is not w and isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) for t in a.seen + b.seen)
    assert a.weight is w and b._parameters["weight"] is w and torch.equal(w, want)
    assert torch.equal(m(x), x @ want @ torch.full((64, 64), 0.5))  # b replaced its weight in this call
    assert a.weight is w and b.weight is not w and b.weight[0, 0] == 0.5
    assert torch.equal(m(x), x @ want @ torch.full((64, 64), 0.5))  # and keeps it
    off.remove()
    assert a.weight is w and torch.equal(w, want)


def test_a_block_is_released_with_the_next_acquire():
    # Inside the top-level forward, a block's release goes with the next block's acquire in one
    # call (spw_release_acquire); the forward's end releases the last one: nothing stays acquired.
    m = frozen(make_stack())
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="4MiB", blocks=list(m), **EMU)
    calls = {"spw_acquire": 0, "spw_release": 0, "spw_release_acquire": 0}

    def counted(name):
        f = getattr(off, "_c_" + name[4:])

        def w(*a):
            calls[name] += 1
            return f(*a)
        return w

    for name in calls:
        setattr(off, "_c_" + name[4:], counted(name))
    x = torch.randn(2, 64)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    n = len(off.units)
    assert calls["spw_acquire"] == 1  # the first unit: nothing pending yet
    assert calls["spw_release_acquire"] == n - 1
    assert calls["spw_release"] == 1  # the last unit, at the forward's end
    assert off.stats()["pinned"]["current"] == 0
    with torch.no_grad():  # a block called on its own, outside the top-level forward: released at once
        y = m[2](torch.randn(2, 64))
    assert calls["spw_release"] == 2 and y.shape == (2, 64)
    assert off.stats()["pinned"]["current"] == 0
    off.remove()


@pytest.mark.parametrize("how", ["checkpoint", "checkpoint-reentrant", "save_on_cpu"])
def test_backward_composes_with_other_saved_tensor_hooks(how):
    """Activation checkpointing (both kinds) inside the offloaded model and save_on_cpu around
    it keep their role beside offload()'s saved-tensor records: gradients bitwise equal."""
    check_backward_composes(how, torch.device("cpu"), **EMU)


def _cast_around_forward(model: nn.Module, storage: torch.dtype, compute: torch.dtype) -> nn.Module:
    """diffusers' layerwise casting (enable_layerwise_casting), as it does it: each Linear stored
    in `storage`, and an instance-attribute forward that casts it to `compute` with .to(dtype=)
    before the original forward and back to `storage` after."""
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.to(dtype=storage)
            inner = m.forward

            def forward(*args, _m=m, _inner=inner, **kwargs):
                _m.to(dtype=compute)
                out = _inner(*args, **kwargs)
                _m.to(dtype=storage)
                return out
            m.forward = forward
    return model


@pytest.mark.parametrize("budget", ["2MiB", "64MiB"])
def test_weights_cast_around_each_forward_stay_stored_in_their_dtype(budget):
    """Layerwise casting over an offloaded model: the packs hold the storage dtype (half the bytes
    through the link), each forward computes in the compute dtype as the resident model does,
    and between forwards the parameters are again the storage-dtype host views. The casts
    replace what the units' device tensors hold inside the forward: the release points them
    back, so that the weights edited later are the ones computed with (a unit back at an
    address it had, where its device tensors are reused) and no cast copy stays referenced."""
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)]).requires_grad_(False)
    ref = _cast_around_forward(copy.deepcopy(base), torch.float16, torch.float32)
    m = _cast_around_forward(copy.deepcopy(base), torch.float16, torch.float32)
    x = torch.randn(4, 512)
    off = spt.offload(m, budget=budget, **EMU)
    assert sum(u.nbytes for u in off.units) == sum(p.numel() * 2 for p in base.parameters())  # stored in fp16
    for step in range(4):
        if step == 2:  # every weight edited, as load_state_dict does
            new = {k: torch.randn_like(v) for k, v in ref.state_dict().items()}
            ref.load_state_dict(new)
            m.load_state_dict(new)
        with torch.no_grad():
            out, _, moved = _per_call(off, lambda: m(x))
        assert torch.equal(out, ref(x)) and out.dtype == torch.float32
        assert moved > 0 or budget == "64MiB"  # the whole model fits 64 MiB
        views = {e.host_view.data_ptr() for u in off.units for e in u.entries}
        assert all(p.dtype == torch.float16 and p.data_ptr() in views for p in m.parameters())
        for u in off.units:  # every kept device tensor over its unit's device copy
            assert all(at <= d.data_ptr() < at + u.nbytes for at, dset in u.dev_sets.items() if at for d in dset[0])
    assert off.stats()["offload"]["view_repairs"] >= 8
    off.remove()
    assert torch.equal(m(x), ref(x))


@pytest.mark.parametrize("call", ["model", "submodule"])
def test_forwards_from_several_threads_run_one_at_a_time(call):
    """A server calling one offloaded model from several threads: the modules' parameter slots,
    the pending release and the step belong to the offload, so each forward (or each call of a
    submodule outside one, as a pipeline's vae.decode makes) waits for the one in progress.
    Before, the threads' hooks shared them: out-of-memory errors (each thread holding units of
    the budget) or lookups of another thread's units."""
    import threading
    torch.manual_seed(0)
    m = frozen(nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8)]))
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="2MiB", **EMU)
    xs = [torch.randn(4, 512) for _ in range(4)]
    wants = [ref(x) for x in xs]
    wrong, errors = [], []

    def run(i: int) -> None:
        try:
            for _ in range(20):
                with torch.no_grad():
                    if call == "model" and not torch.equal(m(xs[i]), wants[i]):
                        wrong.append(i)
                    if call == "submodule" and not torch.equal(m[3](xs[i]), ref[3](xs[i])):
                        wrong.append(i)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not wrong, (errors[:2], len(wrong))
    assert off.stats()["bytes_h2d"]["total"] > 0
    off.remove()


class _Pausing(nn.Module):
    """A block whose forward lets a test act while the model's forward is under way."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.inside = None  # (threading.Event set on entry, threading.Event waited on)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inside is not None:
            entered, go_on = self.inside
            entered.set()
            go_on.wait(0.5)  # the other thread's submodule call, if it does not wait, ends first
        return torch.tanh(self.lin(x))


def test_a_submodule_called_from_another_thread_waits_for_the_forward_under_way():
    """One thread runs the whole model while another calls one of its blocks directly: the
    block's call takes its turn after the forward, as a call outside a forward always did; it
    does not run inside the other thread's forward, sharing its parameter slots and its pending
    release. Both outputs equal resident's."""
    import threading
    import time as _time
    torch.manual_seed(0)
    m = frozen(nn.Sequential(*[_Pausing(512) for _ in range(8)]))
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="2MiB", **EMU)
    x, y = torch.randn(4, 512), torch.randn(4, 512)
    with torch.no_grad():
        want_x, want_y = ref(x), ref[5](y)
    entered, go_on = threading.Event(), threading.Event()
    m[2].inside = (entered, go_on)
    done, out = {}, {}

    def whole() -> None:
        with torch.no_grad():
            out["x"] = m(x)
        done["whole"] = _time.monotonic()

    def block() -> None:
        entered.wait(5)
        with torch.no_grad():
            out["y"] = m[5](y)
        done["block"] = _time.monotonic()
        go_on.set()

    threads = [threading.Thread(target=whole), threading.Thread(target=block)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    m[2].inside = None
    assert done["block"] >= done["whole"]  # it waited for the forward under way
    assert torch.equal(out["x"], want_x) and torch.equal(out["y"], want_y)
    with torch.no_grad():
        assert torch.equal(moved(off, lambda: m(x)), want_x)
    off.remove()


def test_weights_the_system_will_not_page_lock_still_offload_and_are_reported():
    """A system that limits pinned memory (WSL2; emu_pin_limit here) refuses to page-lock some
    packs: offload() warns with the bytes, the summary says so, and the model still runs from
    them, equal to resident, the weights moving."""
    torch.manual_seed(0)
    m = frozen(make_stack(dim=1024, depth=8))  # eight 4 MiB units
    ref = copy.deepcopy(m)
    x = torch.randn(4, 1024)
    with pytest.warns(UserWarning, match=r"20\.0\d* MiB of the 32\.0\d* MiB of offloaded weights could not be page-locked"):
        off = spt.offload(m, budget="12MiB", emu_pin_limit="13MiB", **EMU)  # three packs of 4 MiB + pages
    assert off.stats()["host_pageable"]["current"] == 5 * 4 * MiB
    with torch.no_grad():
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    assert "not page-locked" in off.summary()
    off.remove()
    assert off.final_stats["host_pageable"]["current"] == 0


def test_page_locked_memory_goes_to_the_weights_that_move():
    """Page-locked memory short (pin_limit here; WSL2's limit alike): the text encoder of a
    pipeline, registered first, got it, and runs once; the denoiser's packs, uploaded every step,
    were pageable. From the first looks on (pin_rebalance) the encoder's packs are unlocked and
    the denoiser's locked, so its steps read far fewer bytes from pageable memory; with
    pin_rebalance=off they keep reading them all. Outputs stay equal to resident."""
    torch.manual_seed(0)
    enc, den = frozen(make_stack(seed=1, dim=1024, depth=4)), frozen(make_stack(seed=2, dim=1024, depth=6))
    ref_enc, ref_den = copy.deepcopy(enc), copy.deepcopy(den)
    x = torch.randn(4, 1024)
    for rebalance in ("on", "off"):
        with pytest.warns(UserWarning, match=r"24\.00 MiB of the 24\.02 MiB of offloaded weights could not"):
            offs = spt.offload([enc, den], budget="12MiB", pin_limit="17MiB", pin_rebalance=rebalance, **EMU)
        stat = lambda k: offs.context.stats()[k]["total"]  # noqa: E731
        pageable = []
        with torch.no_grad():
            h = enc(x)  # once, as a text encoder per image
            assert torch.equal(h, ref_enc(x))
            for _ in range(16):
                before = stat("h2d_pageable")
                assert torch.equal(moved(offs.offloads[1], lambda: den(h)), ref_den(h))
                pageable.append(stat("h2d_pageable") - before)
        assert min(pageable[:2]) >= 20 * MiB  # the denoiser's uploads: pageable at first
        if rebalance == "on":
            assert max(pageable[8:]) <= 8 * MiB and stat("repins") >= 8
            assert "page-locking moved to the weights that move" in offs.summary()
        else:
            assert min(pageable) >= 16 * MiB and stat("repins") == 0
        offs.remove()
        assert offs.context.closed


def _storage_key(t: torch.Tensor) -> tuple:
    """What transformers' save_pretrained and safetensors tell tensors apart by: the device,
    the storage's address and size (transformers' id_tensor_storage)."""
    s = t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage().untyped()
    return (t.device, s.data_ptr(), s.nbytes())


def test_the_state_dict_of_an_offloaded_model_has_a_storage_a_tensor():
    """Savers tell tied weights by their storage: transformers' save_pretrained keeps one tensor
    of each storage several share (older versions drop the others silently), safetensors
    refuses overlapping ones. The host copies of an offloaded model have a storage each, as a
    resident model's do; tied weights share theirs. A state_dict saved and loaded round-trips."""
    m = frozen(make_decoder(dim=256, layers=4))  # its lm_head is tied to its embedding
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="4MiB", **EMU)
    sd = m.state_dict()
    keys = {k: _storage_key(t) for k, t in sd.items()}
    want = {k: _storage_key(t) for k, t in ref.state_dict().items()}
    groups = lambda d: sorted(sorted(k for k in d if d[k] == v) for v in set(d.values()))  # noqa: E731
    assert groups(keys) == groups(want)  # the same tensors share storages: the tied pair only
    assert any(len(g) == 2 for g in groups(keys))
    buf = io.BytesIO()
    torch.save(sd, buf)
    assert buf.tell() < 1.05 * sum(t.numel() * t.element_size() for t in ref.state_dict().values()) + (1 << 20)
    buf.seek(0)
    loaded = torch.load(buf)
    assert all(torch.equal(loaded[k], t) for k, t in ref.state_dict().items())
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        assert torch.equal(moved(off, lambda: m(ids))[0], ref(ids)[0])
    off.remove()
