#!/usr/bin/env python3
"""Greedy decoding through a mixture of experts offloaded by spillway.torch.offload: a pure-torch
decoder whose layers route each token to --top of --experts experts held in an nn.ModuleList
and called by index (transformers 4's layout, and most hand-written code), so each expert is a
unit of its own and a token moves only the experts its router picks. Every decoded token is one
forward, a step of the plan policy, and leaves the step before's plan where its picks differ.

Per variant (one process, resident first): ms a token (median after --warm), MiB uploaded a
token, the median host time per acquire, plan divergences a token, the plan's pipeline line,
and whether the tokens equal resident's.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \\
        python3 bench/dev/moe_decode.py [--budget 2GiB] [--variants plan,lru] [--smoke]

--smoke: a small model on the emu backend (CPU), which checks the script.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import spillway.torch as spt
from spillway.torch._report import _median_us


class Expert(nn.Module):
    def __init__(self, h: int, f: int) -> None:
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(h, f, bias=False), nn.Linear(h, f, bias=False), nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Moe(nn.Module):
    def __init__(self, h: int, f: int, experts: int, top: int) -> None:
        super().__init__()
        self.top = top
        self.gate = nn.Linear(h, experts, bias=False)
        self.experts = nn.ModuleList(Expert(h, f) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = torch.topk(F.softmax(self.gate(x).float(), dim=-1), self.top, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in idx.unique().tolist():  # the router's picks, on the host (one sync a layer)
            rows, slot = (idx == e).nonzero(as_tuple=True)
            out[rows] += w[rows, slot, None] * self.experts[e](x[rows])
        return out


class Layer(nn.Module):
    def __init__(self, h: int, f: int, experts: int, top: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.mix = nn.Linear(h, h, bias=False)  # the token mixing (attention's projections) of a decode step
        self.moe = Moe(h, f, experts, top)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.mix(self.norm1(x))
        return x + self.moe(self.norm2(x))


class Decoder(nn.Module):
    def __init__(self, vocab: int, h: int, f: int, layers: int, experts: int, top: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, h)
        self.layers = nn.ModuleList(Layer(h, f, experts, top) for _ in range(layers))
        self.head = nn.Linear(h, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def decode(model: nn.Module, first: torch.Tensor, n: int, sync) -> tuple:
    """n greedy tokens from `first` (batch, ), each one forward: (tokens, ms of each)."""
    toks, ts, cur = [], [], first
    for _ in range(n):
        t0 = time.perf_counter()
        cur = model(cur).argmax(-1)
        toks.append(cur)
        sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return torch.stack(toks), ts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", default="2GiB")
    ap.add_argument("--variants", default="plan,lru")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warm", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--summary", action="store_true", help="print each variant's offload summary")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        dev, sync, extra, dtype = torch.device("cpu"), (lambda: None), {"backend": "emu"}, torch.float32
        shape = dict(vocab=512, h=128, f=256, layers=4, experts=8, top=2)
        a.budget = "2MiB"
    else:
        dev, sync, extra, dtype = torch.device("cuda", 0), torch.cuda.synchronize, {}, torch.bfloat16
        shape = dict(vocab=32000, h=2048, f=5632, layers=8, experts=8, top=2)
    torch.manual_seed(0)
    if a.smoke:
        model = Decoder(**shape)
    else:
        with torch.device(dev):  # random init on the device: on the host it is slow
            model = Decoder(**shape)
    model = model.to(dtype).eval().requires_grad_(False)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    first = torch.randint(0, shape["vocab"], (a.batch,), device=dev)
    n = a.warm + a.tokens
    with torch.no_grad():
        ref, ts = decode(model, first, n, sync)
    rows = [("resident", statistics.median(ts[a.warm:]), None, None, None, "-", True)]
    model.to("cpu")
    for v in a.variants.split(","):
        h = spt.offload(model, budget=a.budget, policy=v, **extra)
        with torch.no_grad():
            decode(model, first, a.warm, sync)
            s0, hist0 = h.stats(), list(h._hook_hist)
            toks, ts = decode(model, first, n, sync)
            s1 = h.stats()
        steady = [y - x for x, y in zip(hist0, h._hook_hist)]
        per = lambda k: (s1[k]["total"] - s0[k]["total"]) / n  # noqa: E731
        line = next((ln.split(";", 1)[1].strip() for ln in h.context.summary().splitlines()
                     if "policy plan" in ln and ";" in ln), v)
        rows.append((v, statistics.median(ts[a.warm:]), per("bytes_h2d") / 2**20, _median_us(steady),
                     per("plan_divergences"), line, torch.equal(toks, ref)))
        if a.summary:
            print(h.summary(), flush=True)
        h.remove()
    print(f"MoE decoder {shape}, {total / 2**30:.2f} GiB {str(dtype)[6:]}, budget {a.budget}, batch {a.batch}, "
          f"{a.tokens} tokens after {a.warm} (and the warm-up's own {a.warm})")
    print("| variant | ms a token | MiB up a token | hook us/acquire | divergences a token | pipeline | tokens equal |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for v, ms, up, hook, div, line, eq in rows:
        fmt = lambda x, f: "-" if x is None else f % x  # noqa: E731
        print(f"| {v} | {ms:.2f} | {fmt(up, '%.1f')} | {fmt(hook, '%.1f')} | {fmt(div, '%.2f')} | {line} | {eq} |")
    return 0 if all(r[-1] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
