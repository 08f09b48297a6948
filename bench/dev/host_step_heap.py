#!/usr/bin/env python3
"""torch.optim's own CPU step (the step an offload runs for an optimizer spillway has no C step
for) with glibc's default heap thresholds against spillway.optim.keep_freed's: ms a step and
minor page faults a step, each optimizer in a process of its own per heap setting.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \\
        python3 bench/dev/host_step_heap.py [--tensors 8 --rows 2048 --cols 5632 --steps 3]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

OPTIMIZERS = ("AdamW", "Adagrad", "RMSprop", "NAdam")


def child(args: argparse.Namespace) -> None:
    import torch

    import spillway.optim as so

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(args.rows, args.cols)) for _ in range(args.tensors)]
    for p in ps:
        p.grad = torch.randn_like(p)
    kept = None
    if args.keep:
        kept = so.keep_freed(max(p.numel() * p.element_size() for p in ps))
    opt = getattr(torch.optim, args.child)(ps, lr=1e-3, foreach=False)
    opt.step()  # the state is made
    opt.step()  # the heap reaches its steady state
    f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    for _ in range(args.steps):
        opt.step()
    dt = (time.perf_counter() - t0) / args.steps
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / args.steps
    print(json.dumps(dict(ms=dt * 1e3, faults=faults, kept=kept, torch=torch.__version__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=5632)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--keep", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    mib = args.rows * args.cols * 4 / 2**20
    print(f"{args.tensors} fp32 parameters of {args.rows} x {args.cols} ({mib:.1f} MiB each), foreach=False, "
          f"{os.cpu_count()} CPUs; ms a step and minor page faults a step, one process each")
    print("| optimizer | glibc's default heap | keep_freed | speedup |")
    print("| --- | --- | --- | --- |")
    for name in OPTIMIZERS:
        row = []
        for keep in (False, True):
            cmd = [sys.executable, __file__, "--child", name, "--tensors", str(args.tensors), "--rows", str(args.rows),
                   "--cols", str(args.cols), "--steps", str(args.steps)] + (["--keep"] if keep else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            row.append(json.loads(out))
        a, b = row
        print(f"| {name} | {a['ms']:.1f} ms, {a['faults']:.0f} faults | {b['ms']:.1f} ms, {b['faults']:.0f} faults "
              f"(kept {b['kept'] / 2**20:.1f} MiB) | {a['ms'] / b['ms']:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
