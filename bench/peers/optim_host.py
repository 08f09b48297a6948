#!/usr/bin/env python3
"""The host optimizer step alone: spillway's C AdamW against torch.optim.AdamW on the CPU.

  spillway        spillway.optim.adamw_step over the parameter list (one C call a step), on a
                  pool of --threads threads
  torch foreach=False   torch's single-tensor path: the formula spillway reproduces
  torch foreach=True    torch's multi-tensor path (_foreach_* kernels)
  torch fused=True      torch's fused CPU kernel, where this torch has one (2.4 and later)

Every variant steps the same arrays: the parameters, their gradients and one exp_avg /
exp_avg_sq per parameter are allocated once, and each torch optimizer's state is pointed at
them, so nothing but the update differs. torch runs with torch.set_num_threads(--threads).

First the results are validated: a copy of the first --check elements (same split into
tensors, same gradients) takes --check-steps steps under each variant from the same start, and
each is compared with torch foreach=False: bitwise, and the largest relative difference. Then
each variant is timed for --steps steps after one warm-up step; the table gives the median
ms/step and the state traffic: 28 bytes an element (param, exp_avg, exp_avg_sq read and written,
grad read) over the step time, the least any implementation must move. Exit status 1 if
spillway is not within 1e-6 relative of torch foreach=False.

    python3 bench/peers/optim_host.py                         # 1e9 fp32 parameters: 16 GB
    python3 bench/peers/optim_host.py --params 2.5e8 --threads 2 --json out.json

Memory: 16 bytes an element for the arrays, plus torch's temporaries (foreach=False: two
arrays the size of the largest tensor; foreach=True: several the size of all of them), plus
the check copy.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

import spillway.optim as so

BYTES_PER_ELEMENT = 28
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def split(total, tensors):
    base, extra = divmod(total, tensors)
    return [base + (1 if i < extra else 0) for i in range(tensors)]


class Problem:
    """Parameters, gradients and AdamW state, shared by every variant."""

    def __init__(self, sizes, seed):
        g = torch.Generator().manual_seed(seed)
        self.params = [torch.randn(n, generator=g) for n in sizes]
        self.grads = [torch.randn(n, generator=g) for n in sizes]
        self.exp_avgs = [torch.zeros(n) for n in sizes]
        self.exp_avg_sqs = [torch.zeros(n) for n in sizes]
        self.step = 0

    def clone(self):
        other = Problem.__new__(Problem)
        for name in ("params", "grads", "exp_avgs", "exp_avg_sqs"):
            setattr(other, name, [t.clone() for t in getattr(self, name)])
        other.step = self.step
        return other


HP = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)


class Spillway:
    name = "spillway"

    def __init__(self, prob, threads):
        self.prob = prob
        self.pool = so.Pool(threads)

    def step(self):
        pr = self.prob
        pr.step += 1
        so.adamw_step(pr.params, pr.grads, pr.exp_avgs, pr.exp_avg_sqs, pr.step, pool=self.pool, **HP)

    def close(self):
        self.pool.close()


class Torch:
    def __init__(self, prob, threads, **flags):
        self.name = "torch " + ",".join(f"{k}={v}" for k, v in flags.items())
        self.prob = prob
        self.params = [p.requires_grad_(True) for p in prob.params]
        for p, g in zip(self.params, prob.grads):
            p.grad = g
        self.opt = torch.optim.AdamW(self.params, **HP, **flags)
        for p, m, v in zip(self.params, prob.exp_avgs, prob.exp_avg_sqs):
            self.opt.state[p] = {"step": torch.tensor(float(prob.step)), "exp_avg": m, "exp_avg_sq": v}
        torch.set_num_threads(threads)

    def step(self):
        with torch.no_grad():
            self.opt.step()
        self.prob.step += 1

    def close(self):
        for p in self.params:
            p.grad = None
            p.requires_grad_(False)
        self.opt.state.clear()


TORCH_VARIANTS = [("torch foreach=False", dict(foreach=False)), ("torch foreach=True", dict(foreach=True)),
                  ("torch fused=True", dict(fused=True))]


def make(name, flags, prob, args):
    if name == "spillway":
        return Spillway(prob, args.threads)
    return Torch(prob, args.torch_threads, **flags)


def max_rel(a, b):
    if torch.equal(a, b):
        return 0.0
    d = (a - b).abs()
    nz = b != 0
    if bool((d[~nz] != 0).any()):
        return float("inf")
    return float((d[nz] / b[nz].abs()).max())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e9, help="fp32 parameters in all (default 1e9)")
    ap.add_argument("--tensors", type=int, default=200, help="tensors they are split into (default 200)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                    help="threads for spillway and torch (default: the CPUs this process may use)")
    ap.add_argument("--torch-threads", type=int, default=None,
                    help="threads for torch (default: --threads)")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant (default 5)")
    ap.add_argument("--check", type=float, default=4e6, help="elements validated (default 4e6)")
    ap.add_argument("--check-steps", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    n = int(args.params)
    sizes = split(n, args.tensors)
    if args.torch_threads is None:
        args.torch_threads = args.threads
    variants = [("spillway", {})] + TORCH_VARIANTS
    log(f"torch {torch.__version__} ({args.torch_threads} threads), spillway isa {so.isa()} "
        f"({args.threads} threads), {n:.3g} parameters in {args.tensors} tensors")

    # ---- validate on a copy of the first elements ----
    csizes = split(min(n, int(args.check)), min(args.tensors, max(1, int(args.check) // 1000)))
    start = Problem(csizes, seed=1)
    gsteps = [[torch.randn(t.numel()) for t in start.params] for _ in range(args.check_steps)]
    finals = {}
    for name, flags in variants:
        pr = start.clone()
        try:
            v = make(name, flags, pr, args)
            for gs in gsteps:
                for g, new in zip(pr.grads, gs):
                    g.copy_(new)
                v.step()
            v.close()
        except (RuntimeError, ValueError, TypeError) as e:
            log(f"{name}: not available here ({str(e).splitlines()[0]})")
            continue
        finals[name] = pr
    ref = finals["torch foreach=False"]
    check = {}
    for name, pr in finals.items():
        pairs = [(a, b) for attr in ("params", "exp_avgs", "exp_avg_sqs")
                 for a, b in zip(getattr(pr, attr), getattr(ref, attr))]
        check[name] = {"bitwise": all(torch.equal(a, b) for a, b in pairs),
                       "max_rel": max(max_rel(a, b) for a, b in pairs)}
        log(f"check {name}: bitwise {check[name]['bitwise']}, max relative {check[name]['max_rel']:.3g}")
    del finals, ref, start

    # ---- time on the full problem ----
    log(f"allocating {16 * n / 1e9:.1f} GB")
    prob = Problem(sizes, seed=2)
    rows = []
    for name, flags in variants:
        if name not in check:
            continue
        v = make(name, flags, prob, args)
        v.step()  # warm-up: first touch, lazy pools, torch's temporaries
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            v.step()
            times.append(time.perf_counter() - t)
        v.close()
        ms = statistics.median(times) * 1e3
        rows.append({"variant": name, "ms_per_step": ms,
                     "gb_per_s": BYTES_PER_ELEMENT * n / (ms / 1e3) / 1e9, **check[name]})
        log(f"{name}: {ms:.1f} ms/step")

    fastest_torch = min(r["ms_per_step"] for r in rows if r["variant"] != "spillway")
    print(f"\nAdamW step, {n:.3g} fp32 parameters in {args.tensors} tensors; spillway {args.threads} "
          f"threads, isa {so.isa()}; torch {torch.__version__}, {args.torch_threads} threads\n")
    print("| variant | ms/step | GB/s of state | vs fastest torch | bitwise = foreach=False | max rel |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['variant']} | {r['ms_per_step']:.1f} | {r['gb_per_s']:.1f} | "
              f"{fastest_torch / r['ms_per_step']:.2f}x | {'yes' if r['bitwise'] else 'no'} | {r['max_rel']:.2g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"params": n, "tensors": args.tensors, "threads": args.threads,
                       "torch_threads": args.torch_threads,
                       "torch": torch.__version__, "isa": so.isa(), "rows": rows}, f, indent=1)
    ok = check.get("spillway", {}).get("max_rel", 1.0) <= 1e-6
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
