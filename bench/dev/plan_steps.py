#!/usr/bin/env python3
"""A denoiser's steps one by one under spillway.torch.offload, from the first: wall ms (the host
waiting for the device after each step), what the step moved and waited on, and the plan's own
line when it changes (which pipeline is being timed, which was chosen and its trial time). Shows
whether the steady steps run as fast as the trial that chose their pipeline.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python:$DIFFUSERS/src \\
        python3 bench/dev/plan_steps.py --cases sd15:0.40,sdxl:0.35 [--steps 60] [--options vmm=off]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "peers"))
import torch_diffusion as td  # noqa: E402
import spillway.torch as spt  # noqa: E402
from diffusion_profile import timed  # noqa: E402  (same directory)

KEYS = ("bytes_h2d", "window_evictions", "ring_uploads", "stalls", "trim_syncs", "plan_divergences", "plan_prefetch_bytes",
        "evictions_clean", "evictions_dirty")


def plan_line(h) -> str:
    return next((ln.strip() for ln in h.context.summary().splitlines() if "policy plan" in ln), "(no plan line)")


def run(case: str, steps: int, options: dict, quiet: bool) -> None:
    key, spec = case.split(":")
    model, inputs = td.MODELS[key][0](False)
    total = td.nbytes(model)
    budget = td.budget_bytes(spec, total)
    kw = inputs()
    step = lambda: model(**kw)  # noqa: E731
    with torch.no_grad():
        res = timed(step, 12)
        model.to("cpu")
        torch.cuda.empty_cache()
        opts = dict(options)
        div = int(opts.pop("div", 0))  # units of at most budget / div (an experiment on the grain)
        with td.unit_cap(budget // div if div else 0):
            h = spt.offload(model, budget=budget, **opts)
        resident = statistics.median(res[2:])
        bound = max(resident, (total - budget) / td.link_gbps() / 1e6)
        print(f"\n== {key} budget {budget / 2**30:.2f} GiB of {total / 2**30:.2f}, {options}, {len(h.units)} units; "
              f"resident {resident:.1f} ms, bound {bound:.1f} ms")
        last = ""
        walls = []
        for i in range(steps):
            s0 = h.context.stats()
            torch.cuda.synchronize()
            t = time.perf_counter()
            step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t) * 1e3
            s1 = h.context.stats()
            d = {k: s1[k]["total"] - s0[k]["total"] for k in KEYS}
            walls.append(wall)
            line = plan_line(h)
            if not quiet or line != last:
                print(f"step {i:3d} {wall:7.1f} ms  up {d['bytes_h2d'] / 2**20:6.0f} MiB (prefetched "
                      f"{d['plan_prefetch_bytes'] / 2**20:5.0f})  evictions {d['evictions_clean'] + d['evictions_dirty']:3d}  "
                      f"window {d['window_evictions']:3d}  ring {d['ring_uploads']:3d}  stalls {d['stalls']:3d}  trims {d['trim_syncs']:3d}  "
                      f"diverged {d['plan_divergences']}" + (f"\n         {line}" if line != last else ""))
            last = line
        tail = walls[steps // 2:]
        print(f"last step: {d['bytes_h2d'] / 2**20:.0f} MiB up, {d['stalls']} stalls, {d['window_evictions']} window "
              f"evictions, {d['ring_uploads']} ring uploads, {d['trim_syncs']} trims; hooks {h.hook_stats()['hook_us_median']:.1f} us (median)")
        print(f"steady (second half) median {statistics.median(tail):.1f} ms, min {min(tail):.1f}; "
              f"x resident {statistics.median(tail) / resident:.3f}, x bound {statistics.median(tail) / bound:.3f}")
        h.remove()
    del model, h
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="sd15:0.40")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--options", default="", help="offload options, k=v,k=v (e.g. vmm=off); div=N: units of "
                    "at most budget / N; several sets apart by ';'")
    ap.add_argument("--quiet", action="store_true", help="print a step only where the plan's line changes")
    a = ap.parse_args()
    for case in a.cases.split(","):
        for spec in a.options.split(";"):
            opts = {}
            for kv in filter(None, spec.split(",")):
                k, v = kv.split("=", 1)
                opts[k] = int(v) if v.isdigit() else v
            run(case, a.steps, opts, a.quiet)


if __name__ == "__main__":
    main()
