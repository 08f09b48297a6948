"""Fused experts (one tensor a projection, [experts, out, in], as transformers 5 stores a
mixture's experts) move expert by expert: a decoded token brings the experts its router picks,
not the layer's tensors whole. The stand-ins below are written as transformers' experts
modules are: an eager loop over the experts hit, indexing the 3D parameters by a 0-d tensor,
and a class decorator that dispatches to another implementation on
config._experts_implementation."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import spillway.torch as spt
from spillway.errors import ConfigError, StateError

MiB = 1 << 20


class Config:
    def __init__(self, impl: str = "eager") -> None:
        self._experts_implementation = impl


def _batched(self, hidden, top_k_index, top_k_weights):
    """A batched implementation over the whole 3D tensors (numerics of its own)."""
    ids = top_k_index.reshape(-1)
    tok = torch.arange(hidden.shape[0]).unsqueeze(1).expand(-1, top_k_index.shape[1]).reshape(-1)
    x = hidden[tok]
    gate, up = torch.bmm(self.gate_up_proj[ids], x.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
    y = torch.bmm(self.down_proj[ids], (self.act_fn(gate) * up).unsqueeze(-1)).squeeze(-1)
    out = torch.zeros_like(hidden)
    out.index_add_(0, tok, y * top_k_weights.reshape(-1, 1))
    return out


def dispatching(cls):
    """As transformers' use_experts_implementation (without functools.wraps)."""
    original = cls.forward

    def forward(self, *args, **kwargs):
        impl = self.config._experts_implementation
        return (original if impl == "eager" else _batched)(self, *args, **kwargs)

    cls.forward = forward
    return cls


@dispatching
class FusedExperts(nn.Module):
    def __init__(self, config: Config, experts: int, d: int, f: int) -> None:
        super().__init__()
        self.config = config
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * f, d) * 0.05)
        self.down_proj = nn.Parameter(torch.randn(experts, d, f) * 0.05)
        self.act_fn = nn.SiLU()
        self.hit: list = []  # the experts the last call ran

    def forward(self, hidden_states, top_k_index, top_k_weights):
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = F.one_hot(top_k_index, num_classes=self.num_experts).permute(2, 1, 0)
            expert_hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        self.hit = [int(e) for e in expert_hit.flatten()]
        for expert_idx in expert_hit:
            expert_idx = expert_idx[0]
            if expert_idx == self.num_experts:
                continue
            top_k_pos, token_idx = torch.where(mask[expert_idx])
            current = hidden_states[token_idx]
            gate, up = F.linear(current, self.gate_up_proj[expert_idx]).chunk(2, dim=-1)
            h = F.linear(self.act_fn(gate) * up, self.down_proj[expert_idx])
            final.index_add_(0, token_idx, h * top_k_weights[token_idx, top_k_pos, None])
        return final


class MoEBlock(nn.Module):
    def __init__(self, config: Config, experts: int, d: int, f: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = FusedExperts(config, experts, d, f)

    def forward(self, x):
        w, idx = self.gate(x).softmax(-1).topk(2, dim=-1)
        return self.experts(x, idx, w)


class FusedMoEModel(nn.Module):
    def __init__(self, layers: int = 4, d: int = 256, f: int = 512, experts: int = 8, impl: str = "eager") -> None:
        super().__init__()
        self.config = Config(impl)
        self.attn = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])
        self.moe = nn.ModuleList([MoEBlock(self.config, experts, d, f) for _ in range(layers)])

    def forward(self, x):
        for a, m in zip(self.attn, self.moe):
            x = x + a(x)
            x = x + m(x)
        return x


def _token(step: int, n: int = 1) -> torch.Tensor:
    return torch.randn(n, 256, generator=torch.Generator().manual_seed(step))


def _expert_units(off):
    """(layer, parameter, expert) -> unit, for the units of fused experts' slices."""
    out = {}
    for u in off.units:
        name = u.entries[0].name
        if ".experts." in name and "[" in name:
            layer = int(name.split(".")[1])
            pname, e = name.rsplit(".", 1)[1].rstrip("]").split("[")
            out[(layer, pname, int(e))] = u
    return out


@pytest.mark.parametrize("policy", ["plan", "lru"])
def test_fused_experts_move_expert_by_expert(policy):
    """Four layers of 8 fused experts (12 MiB a layer, 48 MiB) under 24 MiB: each 3D parameter
    is a unit an expert, and a token moves at most the two experts per layer its router picks,
    with outputs bitwise equal to the resident model's."""
    torch.manual_seed(0)
    m = FusedMoEModel().requires_grad_(False)
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="24MiB", backend="emu", policy=policy, vmm="on")
    units = _expert_units(off)
    assert len(units) == 4 * 2 * 8
    assert all(u.nbytes == (MiB if k[1] == "gate_up_proj" else MiB // 2) for k, u in units.items())
    slices = {id(u) for u in units.values()}
    rest = sum(-(-u.nbytes // 4096) * 4096 for u in off.units if id(u) not in slices)
    assert "fused experts     4 modules of 8 experts" in off.summary()
    moved = []
    with torch.no_grad():
        for step in range(12):
            x = _token(step)
            st = off.context.stats()
            before, ahead = st["bytes_h2d"]["total"], st["plan_prefetch_bytes"]["total"]
            assert torch.equal(m(x), ref(x)), step
            st = off.context.stats()
            moved.append(st["bytes_h2d"]["total"] - before)
            ahead = st["plan_prefetch_bytes"]["total"] - ahead
            hit = [blk.experts.hit for blk in m.moe]
            assert all(len(h) <= 2 for h in hit)
            routed = sum(units[(li, p, e)].nbytes for li, h in enumerate(hit) for e in h
                         for p in ("gate_up_proj", "down_proj"))
            assert moved[-1] <= routed + rest + ahead, (step, moved[-1], routed, rest, ahead)
    assert sum(moved[2:]) > 0  # the picked experts did move: 49 MiB under 24
    assert max(moved[2:]) <= 4 * 2 * 1.5 * MiB + rest + 2 * MiB  # two of eight experts a layer at most
    # a batch that picks every expert moves them all, and still computes as resident
    with torch.no_grad():
        x = _token(100, 64)
        assert torch.equal(m(x), ref(x))
    assert all(len(blk.experts.hit) == 8 for blk in m.moe)
    off.remove()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert a.is_contiguous() and torch.equal(a, b)


def test_fused_experts_run_eagerly_whatever_the_implementation_set():
    """A module dispatching on config._experts_implementation runs its eager function while
    offloaded (the batched one would take every expert): equal to the resident model run
    eagerly, the configuration the same after each forward, no warning."""
    torch.manual_seed(1)
    m = FusedMoEModel(impl="batched").requires_grad_(False)
    ref = copy.deepcopy(m)
    ref.config._experts_implementation = "eager"
    off = spt.offload(m, budget="24MiB", backend="emu", vmm="on")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(3):
            x = _token(step, 2)
            assert torch.equal(m(x), ref(x))
            assert m.config._experts_implementation == "batched"
    off.remove()
    with torch.no_grad():  # after remove(), the model's own implementation again
        x = _token(7, 2)
        assert torch.allclose(m(x), ref(x), atol=1e-5)


class WholeUse(nn.Module):
    """Experts indexed by expert in one place and taken whole in another (an einsum over all)."""

    def __init__(self, experts: int = 8, d: int = 256, f: int = 512) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(experts, f, d) * 0.05)

    def forward(self, x, pick: int):
        first = F.linear(x, self.w[pick])
        every = torch.einsum("efd,nd->nef", self.w, x)
        return first.sum() + every.sum(1)


def test_a_fused_parameter_used_whole_is_gathered_and_warned_once():
    torch.manual_seed(2)
    m = nn.Sequential(nn.Linear(256, 256), WholeUse(), nn.Linear(512, 256)).requires_grad_(False)
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="8MiB", backend="emu", vmm="on")  # 4 MiB of experts, units of 2 MiB at most
    assert len(_fused_units(off)) == 8
    x = torch.randn(3, 256)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            assert torch.equal(m[2](m[1](m[0](x), 3)), ref[2](ref[1](ref[0](x), 3)))
    assert sum("used whole" in str(w.message) for w in caught) == 1
    off.remove()


def _fused_units(off):
    return [u for u in off.units if u.entries[0].name.endswith("]")]


def test_fused_experts_see_edits_and_state_dict():
    """Between forwards the parameter is one host tensor over the slices' packs: state_dict
    reads it, an in-place edit (load_state_dict) is seen by the next forward."""
    torch.manual_seed(3)
    m = FusedMoEModel(layers=2).requires_grad_(False)
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="16MiB", backend="emu", vmm="on")
    assert len(_expert_units(off)) == 2 * 2 * 8
    sd = m.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(sd[k], v), k
    x = _token(5, 4)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    new = {k: v * 1.5 if "proj" in k else v for k, v in ref.state_dict().items()}
    ref.load_state_dict(new)
    m.load_state_dict(new)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))
    off.remove()


def test_fused_experts_of_a_model_that_requires_grad():
    """from_pretrained's model (every parameter requires grad) is offloaded for inference, its
    experts split too: a forward under grad computes as resident, and a backward that needs
    the experts' gradients says so."""
    torch.manual_seed(4)
    m = FusedMoEModel(layers=2)
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="16MiB", backend="emu", vmm="on")
    assert len(_expert_units(off)) == 32
    x = _token(9, 2)
    out = m(x)
    assert torch.equal(out.detach(), ref(x).detach())
    with pytest.raises(StateError):
        out.sum().backward()
    off.remove()


def test_small_fused_experts_stay_one_unit():
    """Experts whose tensors fit a unit (a quarter of the budget) are not split."""
    torch.manual_seed(5)
    m = FusedMoEModel(layers=2, d=64, f=128).requires_grad_(False)
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="64MiB", backend="emu")
    assert not _expert_units(off) and "fused experts" not in off.summary()
    with torch.no_grad():
        x = torch.randn(2, 64)
        assert torch.equal(m(x), ref(x))
    off.remove()


def test_experts_whole_keeps_each_layers_experts_one_unit():
    """experts="whole": no slice units, each experts module moves as one; a bad value changes
    nothing."""
    torch.manual_seed(6)
    m = FusedMoEModel(layers=2).requires_grad_(False)
    ref = copy.deepcopy(m)
    with pytest.raises(ConfigError, match="experts"):
        spt.offload(m, budget="32MiB", backend="emu", experts="some")
    off = spt.offload(m, budget="32MiB", backend="emu", vmm="on", experts="whole")
    assert not _expert_units(off) and not off._fused
    whole = [e for u in off.units for e in u.entries if e.name.endswith("experts.gate_up_proj")]
    assert len(whole) == 2 and all(len(e.shape) == 3 for e in whole)
    with torch.no_grad():
        x = _token(3, 2)
        assert torch.equal(m(x), ref(x))
    off.remove()


def test_gradients_flow_through_fused_experts_to_resident_adapters():
    """Frozen fused experts, trainable modules beside them (adapters kept resident): the
    backward re-acquires the experts' slices it saved, and every gradient equals resident's."""
    torch.manual_seed(7)
    m = FusedMoEModel(layers=2)
    for name, p in m.named_parameters():
        p.requires_grad_(name.startswith("attn."))
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="16MiB", backend="emu", vmm="on")
    assert len(_expert_units(off)) == 32
    x = _token(11, 4)
    m(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (n, a), b in zip(m.named_parameters(), ref.parameters()):
        if b.requires_grad:
            assert torch.equal(a.grad, b.grad), n
    assert off.saved_reacquires > 0  # the backward brought saved slices back
    off.remove()


def test_a_budget_below_a_layers_experts_is_refused_before_anything_moves():
    """A forward holds the experts it picks until it returns, all of them in a prefill: a budget
    below one layer's experts is a ConfigError naming the module, and the model is unchanged."""
    torch.manual_seed(8)
    m = FusedMoEModel(layers=2).requires_grad_(False)
    before = [p.data_ptr() for p in m.parameters()]
    with pytest.raises(ConfigError, match="moe.0.experts|experts"):
        spt.offload(m, budget="8MiB", backend="emu", vmm="on")  # a layer's experts: 12 MiB
    assert [p.data_ptr() for p in m.parameters()] == before
    assert all("forward" not in mod.__dict__ for mod in m.modules())


def test_experts_stay_whole_where_their_slices_need_more_room_than_the_layer():
    """Slices of 1.125 MiB take a 2 MiB arena page each: a layer's experts need 22 MiB of
    room in slices, 14 whole. Under 20 MiB the offload keeps them whole rather than refusing."""
    torch.manual_seed(9)
    m = FusedMoEModel(layers=2, f=576).requires_grad_(False)
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="20MiB", backend="emu", vmm="on")
    assert not off._fused and not _expert_units(off)
    with torch.no_grad():
        x = _token(4, 3)
        assert torch.equal(m(x), ref(x))
    off.remove()
    off = spt.offload(m, budget="40MiB", backend="emu", vmm="on")  # room for the slices: split
    assert len(_expert_units(off)) == 32
    off.remove()


@pytest.mark.parametrize("how", ["recompute", "optimizer", "optimizer+recompute", "activations"])
def test_fused_experts_under_the_training_options(how):
    """Frozen fused experts split by expert beside trained attention: recomputed blocks,
    optimizer= (the attention trained on the host by spillway's AdamW), activations kept in the
    budget. Gradients bitwise equal to resident's; with optimizer=, three steps' losses within
    1e-6 of resident AdamW's."""
    torch.manual_seed(7)
    m = FusedMoEModel(layers=2)
    for name, p in m.named_parameters():
        p.requires_grad_(name.startswith("attn."))
    ref = copy.deepcopy(m)
    kw = {"recompute": dict(recompute=True), "activations": dict(activations=True),
          "optimizer": {}, "optimizer+recompute": dict(recompute="auto")}[how]
    opt = ref_opt = None
    if how.startswith("optimizer"):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3)
        ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
        kw["optimizer"] = opt
    off = spt.offload(m, budget="20MiB", backend="emu", vmm="on", **kw)
    assert len(off._fused) == 2
    for step in range(3):
        x = _token(20 + step, 4)
        la, lb = m(x).square().sum(), ref(x).square().sum()
        la.backward()
        lb.backward()
        if opt is not None:
            opt.step()
            ref_opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            assert abs(la.item() - lb.item()) <= 1e-6 * abs(lb.item()), step
            continue
        for (n, a), b in zip(m.named_parameters(), ref.parameters()):
            if b.requires_grad:
                assert torch.equal(a.grad, b.grad), (step, n)
                a.grad = b.grad = None
    off.remove()


def test_expert_indices_read_as_torch_reads_them():
    """An int, a 0-d integer tensor, negative, alone or first in a tuple of any length pick one
    expert; anything else is not an expert index; out of range is torch's IndexError."""
    from spillway.torch._experts import _expert_of
    assert _expert_of(3, 8) == (3, None)
    assert _expert_of(torch.tensor(5), 8) == (5, None)
    assert _expert_of(-1, 8) == (7, None)
    assert _expert_of((2,), 8) == (2, None)
    assert _expert_of((2, slice(0, 4)), 8) == (2, slice(0, 4))
    assert _expert_of((2, 0, 1), 8) == (2, (0, 1))
    assert _expert_of(torch.tensor([1, 2]), 8) == (None, None)
    assert _expert_of(slice(0, 2), 8) == (None, None)
    assert _expert_of(torch.tensor(True), 8) == (None, None)
    with pytest.raises(IndexError, match="out of bounds"):
        _expert_of(8, 8)
