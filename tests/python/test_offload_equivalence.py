"""Randomized equivalence of offloaded training against the resident model (emu backend).

Each case builds a random model from a seed: an optional embedding, a list of blocks (MLPs,
attention, convolutions, norms, mixtures with fused experts; adapters inside some; a weight tied between two blocks; a
block called twice), adapters outside the blocks, and a head; it is run either through its own
forward or by the caller's loop over its blocks (the top-level forward never runs). Its frozen
weights are offloaded at a random budget from just above the largest unit to above the whole
model, with a random policy, prefetch thread and allocator setting, and trained for a few
steps beside a resident copy: every forward output, loss and trainable gradient must be
bitwise equal, and wherever the budget is below the offloaded bytes the weights must really
move during each step. A failing case prints its seed and its description;
SPILLWAY_EQUIV_CASES=N runs N cases, SPILLWAY_EQUIV_SEED=S only case S.
"""
from __future__ import annotations

import copy
import math
import os
import random

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import spillway.torch as spt
from spillway.torch import _alloc

CASES = int(os.environ.get("SPILLWAY_EQUIV_CASES", "200"))
ONLY = os.environ.get("SPILLWAY_EQUIV_SEED")
SEEDS = [int(ONLY)] if ONLY else list(range(CASES))
MiB = 1 << 20


class LoRA(nn.Module):
    def __init__(self, base: nn.Linear, r: int) -> None:
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(r, base.in_features) * 0.02)
        self.b = nn.Parameter(torch.randn(base.out_features, r) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def linear(rng: random.Random, n_in: int, n_out: int, adapters: bool) -> nn.Module:
    lin = nn.Linear(n_in, n_out, bias=rng.random() < 0.5)
    return LoRA(lin, rng.choice([2, 4, 8])) if adapters and rng.random() < 0.4 else lin


class MLP(nn.Module):
    def __init__(self, rng: random.Random, d: int, adapters: bool) -> None:
        super().__init__()
        h = rng.choice([d, 2 * d])
        self.fc1 = linear(rng, d, h, adapters)
        self.fc2 = linear(rng, h, d, adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, rng: random.Random, d: int, adapters: bool) -> None:
        super().__init__()
        self.heads = rng.choice([2, 4])
        self.qkv = linear(rng, d, 3 * d, adapters)
        self.out = linear(rng, d, d, adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        y = torch.einsum("bhqk,bkhd->bqhd", att.softmax(-1), v).reshape(b, t, d)
        return self.out(y)


class Conv(nn.Module):
    """A convolution over each position's features seen as a (channels, 4, 4) image."""

    def __init__(self, rng: random.Random, d: int, adapters: bool) -> None:
        super().__init__()
        self.c = d // 16
        self.conv = nn.Conv2d(self.c, self.c, 3, padding=1)
        self.norm = nn.GroupNorm(4, self.c)
        self.proj = linear(rng, d, d, adapters)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        y = self.norm(self.conv(x.reshape(b * t, self.c, 4, 4))).reshape(b, t, d)
        return self.proj(F.silu(y))


class Norm(nn.Module):
    def __init__(self, rng: random.Random, d: int, adapters: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = linear(rng, d, d, adapters)
        if rng.random() < 0.3:
            self.register_buffer("scale", torch.rand(d) + 0.5)
        else:
            self.scale = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(self.norm(x))
        return y * self.scale if self.scale is not None else y


class FusedMoE(nn.Module):
    """A mixture whose experts are one tensor a projection ([experts, out, in], transformers 5's
    layout), run by an eager loop over the experts the router picks, indexing them by expert."""

    def __init__(self, rng: random.Random, d: int, adapters: bool) -> None:
        super().__init__()
        n = rng.choice([4, 8])
        self.router = linear(rng, d, n, adapters)
        self.w_in = nn.Parameter(torch.randn(n, d, d) * 0.02)
        self.w_out = nn.Parameter(torch.randn(n, d, d) * 0.02)
        self.hit: set = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        w, idx = self.router(flat).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(flat)
        picked = idx.unique().tolist()
        self.hit.update(picked)
        for e in picked:
            rows, k = torch.where(idx == e)
            h = F.gelu(F.linear(flat[rows], self.w_in[e]))
            out = out.index_add(0, rows, F.linear(h, self.w_out[e]) * w[rows, k, None])
        return out.reshape(b, t, d)


KINDS = [MLP, Attention, Conv, Norm, FusedMoE]


class Model(nn.Module):
    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        d = self.d = rng.choice([512, 768, 1024])
        self.vocab = rng.choice([1024, 2048])
        self.embed = nn.Embedding(self.vocab, d) if rng.random() < 0.6 else None
        self.inp = None if self.embed is not None else nn.Linear(64, d)
        adapters_in = rng.random() < 0.7
        n = rng.randint(2, 6)
        self.blocks = nn.ModuleList(rng.choice(KINDS)(rng, d, adapters_in) for _ in range(n))
        self.order = list(range(n))
        if rng.random() < 0.4:  # a block called twice
            i = rng.randrange(n)
            self.order.insert(rng.randrange(len(self.order) + 1), i)
        self.tied = False
        lins = [(b, name) for b in self.blocks for name, m in b.named_children() if type(m) is nn.Linear
                and m.in_features == m.out_features == d]
        if len(lins) >= 2 and rng.random() < 0.5:  # one weight used by two different blocks
            (b1, n1), (b2, n2) = rng.sample(lins, 2)
            getattr(b2, n2).weight = getattr(b1, n1).weight
            self.tied = True
        inside = any(isinstance(m, LoRA) for m in self.blocks.modules())
        # adapters in the caller's code, outside every block (always, where the blocks have none)
        self.outside = not inside or rng.random() < 0.5
        if self.outside:
            r = rng.choice([4, 8])
            self.ad_a = nn.ParameterList(nn.Parameter(torch.randn(d, r) * 0.02) for _ in self.order)
            self.ad_b = nn.ParameterList(nn.Parameter(torch.randn(r, d) * 0.02) for _ in self.order)
        self.final = nn.LayerNorm(d)
        self.head = nn.Linear(d, self.vocab, bias=False)
        if self.embed is not None and rng.random() < 0.5:
            self.head.weight = self.embed.weight  # tied head
        self.trainable_norm = rng.random() < 0.3

    def freeze(self) -> "Model":
        for name, p in self.named_parameters():
            adapter = name.endswith((".a", ".b")) or name.startswith(("ad_a", "ad_b"))
            p.requires_grad_(adapter or (self.trainable_norm and name.startswith("final.")))
        if self.inp is not None:
            self.inp.requires_grad_(False)
        return self

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for k, i in enumerate(self.order):
            y = x + self.blocks[i](x)
            if self.outside:
                y = y + (x @ self.ad_a[k]) @ self.ad_b[k]
            x = y
        return self.head(self.final(x))

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(inp) if self.embed is not None else self.inp(inp))

    def by_hand(self, inp: torch.Tensor) -> torch.Tensor:
        """The same computation driven by the caller: the top-level forward never runs."""
        return self.body(self.embed(inp) if self.embed is not None else self.inp(inp))


def describe(m: Model, case: dict) -> str:
    kinds = [type(m.blocks[i]).__name__ for i in m.order]
    return (f"d={m.d} blocks={kinds} embed={m.embed is not None} tied_head={m.head.weight is getattr(m.embed, 'weight', None)} "
            f"tied_blocks={m.tied} outside_adapters={m.outside} trainable_norm={m.trainable_norm} {case}")


def offloaded_bytes(off: spt.Offload) -> int:
    return sum(u.nbytes for u in off.units)


def run_case(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model = Model(rng).freeze()
    ref = copy.deepcopy(model)
    case = dict(policy=rng.choice(["plan", "lru"]), drive=rng.choice(["forward", "by_hand"]),
                prefetch_thread=rng.choice(["on", "off"]), allocator=rng.random() < 0.15,
                steps=rng.choice([2, 3]))
    batch, seq = rng.choice([1, 2]), rng.choice([3, 8])
    # the units and the least budget that holds what a forward holds at once, from a throwaway
    # offload at an ample budget
    probe = spt.offload(copy.deepcopy(model), budget="2GiB", backend="emu")
    total, low = offloaded_bytes(probe), probe.min_budget
    probe.remove()
    budget = rng.randint(low, max(low, int(total * 1.3)))
    case["budget"] = f"{budget / total:.2f} of {total / MiB:.1f} MiB"
    label = f"seed {seed}: {describe(model, case)}"

    opts = dict(backend="emu", policy=case["policy"])
    if case["policy"] == "plan":
        opts["prefetch_thread"] = case["prefetch_thread"]
    if case["allocator"]:
        spt.use_allocator(budget, policy=case["policy"], backend="emu", emu_capacity="4GiB")
    off = None
    try:
        off = spt.offload(model, budget=budget, **opts)
        trainable = [p for p in model.parameters() if p.requires_grad]
        ref_trainable = [p for p in ref.parameters() if p.requires_grad]
        opt = torch.optim.SGD(trainable, lr=0.05)
        ref_opt = torch.optim.SGD(ref_trainable, lr=0.05)
        gen = torch.Generator().manual_seed(seed)
        for step in range(case["steps"]):
            if model.embed is not None:
                inp = torch.randint(0, model.vocab, (batch, seq), generator=gen)
            else:
                inp = torch.randn(batch, seq, 64, generator=gen)
            target = torch.randn(batch, seq, model.vocab, generator=gen)
            before = off.context.stats()["bytes_h2d"]["total"]
            for b in model.blocks:
                b.hit = set()  # the experts this step runs (FusedMoE)
            out = model(inp) if case["drive"] == "forward" else model.by_hand(inp)
            ref_out = ref(inp)
            assert torch.equal(out, ref_out), f"{label}: step {step}: outputs differ"
            loss, ref_loss = F.mse_loss(out, target), F.mse_loss(ref_out, target)
            assert torch.equal(loss, ref_loss), f"{label}: step {step}: losses differ"
            loss.backward()
            ref_loss.backward()
            moved = off.context.stats()["bytes_h2d"]["total"] - before
            # fused experts split by expert move only the experts the step runs
            idle = sum(u.nbytes for f in off._fused.values() for us in f.units.values()
                       for e, u in enumerate(us) if e not in f.module.hit)
            if budget < total - idle:
                assert moved >= total - budget - idle, \
                    f"{label}: step {step}: moved {moved} < {total - budget - idle} ({idle} B of experts not run)"
            for (name, p), q in zip([(n, p) for n, p in model.named_parameters() if p.requires_grad], ref_trainable):
                assert p.grad is not None and torch.equal(p.grad, q.grad), \
                    f"{label}: step {step}: gradient of {name} differs " \
                    f"(relative error {((p.grad - q.grad).norm() / q.grad.norm()).item():.3g})"
            opt.step()
            ref_opt.step()
            opt.zero_grad(set_to_none=True)
            ref_opt.zero_grad(set_to_none=True)
    finally:
        if off is not None and not off._closed:
            off.remove()
        a = spt.current()
        if a is not None:
            a.close()
        _alloc._shutdown()


@pytest.mark.parametrize("seed", SEEDS)
def test_offloaded_training_equals_resident(seed: int) -> None:
    run_case(seed)
