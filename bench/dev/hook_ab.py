#!/usr/bin/env python3
"""spillway.torch.offload's hook time, A/B on one host: two copies of the Python package (the
working one and an earlier one, importable under another name) each offload a copy of the
Llama-shaped model of bench/peers/torch_offload.py's workload b (random weights, 6 GiB budget),
and their passes alternate (AB, BA, AB, ...).

Hosts of the lent H200 kind differ by up to 1.5x in host-bound work, and one host drifts within
a run (one package's hooks measured 27.5 then 45.7 us a block in two rounds a minute apart), so
a change to the hooks is judged only pass by pass against its predecessor in the same process.
Per package, medians of the per-pass figures (means in parentheses):
  prefill us/block   hook_ns / acquires in one prefill pass (8 x 512 tokens)
  ms                 the pass, wall time (torch's dispatch of the hooks included)
  lock us            the library's lock_wait_ns per block acquired (the prefetch worker holds
                     the context lock while it enqueues), mean
  decode us/block    the same in one greedy step at batch 8 with the KV cache
  tok/s              batch / the median step's wall time
  paired             the median of the pass-by-pass differences against the last package
Every package's first prefill logits are compared bitwise with the first package's.

    SPILLWAY_LIBRARY=build/libspillway.so PYTHONPATH=python:ab python3 bench/dev/hook_ab.py \\
        --packages spillway,spillway_old
(ab/spillway_old: a copy of an earlier python/spillway; its imports are relative.)
"""
from __future__ import annotations

import argparse
import copy
import importlib
import importlib.util
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("torch_offload", ROOT / "bench" / "peers" / "torch_offload.py")
to = importlib.util.module_from_spec(spec)
spec.loader.exec_module(to)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--packages", default="spillway,spillway_old")
    p.add_argument("--policy", default="plan")
    p.add_argument("--budget", default="6GiB")
    p.add_argument("--warmup", type=int, default=24)
    p.add_argument("--passes", type=int, default=24)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--smoke", action="store_true", help="a tiny model on the emu backend (CPU): checks the script")
    args = p.parse_args()
    pkgs = [importlib.import_module(name + ".torch") for name in args.packages.split(",")]
    if args.smoke:
        dev, sync, extra, shape = torch.device("cpu"), (lambda: None), {"backend": "emu"}, to.B_SHAPE_SMOKE
        args.budget = "8MiB"
    else:
        dev, sync, extra, shape = torch.device("cuda", 0), torch.cuda.synchronize, {}, to.B_SHAPE
    cfg = types.SimpleNamespace(dev=dev, cuda=not args.smoke, smoke=args.smoke, b_shape=shape)
    t = time.perf_counter()
    model, _ = to.build_b(cfg, torch.device("cpu"))
    print(f"model built in {time.perf_counter() - t:.1f} s", flush=True)
    c = cfg.b_shape
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["prompt"]), generator=g).to(dev)
    first = None
    names = args.packages.split(",")
    models = [model] + [copy.deepcopy(model) for _ in names[1:]]
    with torch.no_grad():
        offs, runs = [], []
        for name, st, m in zip(names, pkgs, models):
            t = time.perf_counter()
            off = st.offload(m, budget=args.budget, policy=args.policy, **extra)
            run = Run(name, off, m, ids, sync)
            out = run.prefill().cpu()
            first = out if first is None else first
            run.equal = torch.equal(out, first)
            for _ in range(args.warmup):
                run.prefill()
            sync()
            print(f"{name}: offloaded and warmed up in {time.perf_counter() - t:.1f} s, "
                  f"logits {'bitwise equal' if run.equal else 'DIFFER'}", flush=True)
            offs.append(off)
            runs.append(run)
        # Interleaved, in an order that alternates (AB BA ...): drift of the host hits both alike.
        for i in range(args.passes):
            for run in (runs if i % 2 == 0 else runs[::-1]):
                run.timed(run.prefill, run.pre)
        for run in runs:
            run.start_decode()
        for i in range(args.tokens):
            for run in (runs if i % 2 == 0 else runs[::-1]):
                run.timed(run.step, run.dec)
        for off in offs:
            off.remove()

    base = runs[-1]
    print(f"\n{args.passes} prefill passes and {args.tokens} decode steps each, interleaved; medians of the "
          f"per-pass figures (mean)")
    print(f"{'package':<16}{'prefill us/block':>18}{'ms':>9}{'lock us':>9}{'decode us/block':>17}{'tok/s':>8}"
          f"{'lock us':>9}   paired: prefill, decode us/block against {base.name}")
    for run in runs:
        pre, dec = run.pre, run.dec
        paired = ""
        if run is not base:
            dp = [a - b for a, b in zip(pre["hook"], base.pre["hook"])]
            dd = [a - b for a, b in zip(dec["hook"], base.dec["hook"])]
            paired = f"   {statistics.median(dp):+.1f}, {statistics.median(dd):+.1f}"
        print(f"{run.name:<16}{statistics.median(pre['hook']):10.1f} ({statistics.mean(pre['hook']):5.1f})"
              f"{statistics.median(pre['ms']):9.2f}{statistics.mean(pre['lock']):9.2f}"
              f"{statistics.median(dec['hook']):9.1f} ({statistics.mean(dec['hook']):5.1f})"
              f"{shape['batch'] * 1e3 / statistics.median(dec['ms']):8.1f}{statistics.mean(dec['lock']):9.2f}{paired}")
    return 0 if all(r.equal for r in runs) else 1


class Run:
    """One package's offload of one copy of the model, and its timed passes."""

    def __init__(self, name, off, model, ids, sync):
        self.name, self.off, self.model, self.ids, self.sync = name, off, model, ids, sync
        self.equal = False
        self.pre = {"hook": [], "ms": [], "lock": []}
        self.dec = {"hook": [], "ms": [], "lock": []}
        self.past = self.nxt = None

    def prefill(self):
        return self.model(input_ids=self.ids, use_cache=False).logits

    def start_decode(self):
        out = self.model(input_ids=self.ids, use_cache=True, logits_to_keep=1)
        self.past, self.nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self.step()

    def step(self):
        out = self.model(input_ids=self.nxt, past_key_values=self.past, use_cache=True)
        self.past, self.nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        self.nxt.cpu()  # as generate() reads each step's tokens for its stopping criteria

    def lock_ns(self):  # the library's counter of time waited for its context lock
        return to._stat(self.off.context.stats(), "lock_wait_ns") or 0

    def timed(self, fn, into):
        off = self.off
        self.sync()
        a, h, lk = off.acquires, off.hook_ns, self.lock_ns()
        t = time.perf_counter()
        fn()
        self.sync()
        into["ms"].append((time.perf_counter() - t) * 1e3)
        n = max(off.acquires - a, 1)
        into["hook"].append((off.hook_ns - h) / n / 1e3)
        into["lock"].append((self.lock_ns() - lk) / n / 1e3)


if __name__ == "__main__":
    sys.exit(main())
