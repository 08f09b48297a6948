#!/usr/bin/env python3
"""Where a steady denoiser step of spillway.torch.offload goes, per model and budget of
bench/peers/torch_diffusion.py: the engine's counters per step (trims that wait on the host,
stalls, backend maps and unmaps, plan hits), the C calls of the hooks (per-call percentiles), and
a torch.profiler window of two steps: the compute stream's busy time against the wall, and the
uploads' time on the copy engine.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python:$DIFFUSERS/src \\
        python3 bench/dev/diffusion_profile.py --cases sd15:0.40,sdxl:0.35,sdxl:8589934592

--unit-max BYTES caps the partition's largest unit (an experiment on the unit size: the plan's
prefetch room is sized by the largest streamed unit, and every byte of it is a byte less kept).
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

KEYS = ("trim_syncs", "window_evictions", "stalls", "backend_allocs", "backend_frees", "plan_hits", "plan_divergences",
        "bytes_h2d", "plan_prefetch_bytes", "plan_prefetch_wasted", "cross_stream_waits", "lock_waits", "lock_wait_ns")


def counters(h):
    s = h.stats()
    out = {k: s[k]["total"] for k in KEYS}
    out.update({k: v for k, v in s["offload"].items() if k in ("acquires", "view_builds", "outputs_cloned", "hook_ns")})
    return out


def timed(fn, n):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t) * 1e3)
    return ts


def wrap_calls(h):
    """Replace the handle's C entry points by timing stand-ins; returns the per-call ns lists."""
    calls = {"acquire": [], "release_acquire": [], "release": []}
    clock = time.perf_counter_ns

    def timer(fn, sink):
        def call(*a):
            t = clock()
            r = fn(*a)
            sink.append(clock() - t)
            return r
        return call
    h._c_acquire = timer(h._c_acquire, calls["acquire"])
    h._c_release_acquire = timer(h._c_release_acquire, calls["release_acquire"])
    h._c_release = timer(h._c_release, calls["release"])
    return calls


def union(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def profile(fn, steps=2):
    from torch.profiler import ProfilerActivity, profile as prof
    torch.cuda.synchronize()
    with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) * 1e3
    kern, h2d, syncs, api = [], [], {}, {}

    def tally(per_name, e):  # [count, ms] per host-side event name
        d = per_name.setdefault(e.name, [0, 0.0])
        d[0] += 1
        d[1] += (e.time_range.end - e.time_range.start) / 1e3

    for e in p.events():
        name = e.name
        if e.device_type == torch.autograd.DeviceType.CUDA:
            iv = (e.time_range.start / 1e3, e.time_range.end / 1e3)
            (h2d if "HtoD" in name else kern if "Memcpy" not in name and "Memset" not in name else []).append(iv)
            continue
        if name.startswith("cu"):
            tally(api, e)
        if "ynchronize" in name or "Sync" in name:
            tally(syncs, e)
    return {"wall_ms": wall / steps, "kernels_busy_ms": union(kern) / steps, "h2d_busy_ms": union(h2d) / steps,
            "kernels": len(kern) // steps, "h2d_copies": len(h2d) // steps,
            "host_syncs": {k: (v[0] / steps, v[1] / steps) for k, v in syncs.items()},
            "driver_calls": sorted(((k, v[0] / steps, v[1] / steps) for k, v in api.items()), key=lambda x: -x[2])}


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1e3 if xs else 0.0


def hist_q(hist, q):
    """The bucket (us) holding quantile q of a histogram of 1-us buckets."""
    total, seen = sum(hist), 0
    for i, n in enumerate(hist):
        seen += n
        if total and seen >= q * total:
            return i
    return 0


def python_profile(step, n, top):
    """cProfile of n steps: the functions with the most time of their own (the hooks' Python
    against the C calls, which show as ctypes' foreign functions)."""
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    print("\n".join(ln for ln in out.getvalue().splitlines()[5:] if ln.strip()))


def run(case, policy, warm, options, cprofile=0):
    key, spec = case.split(":")
    model, inputs = td.MODELS[key][0](False)
    total = td.nbytes(model)
    budget = td.budget_bytes(spec, total)
    kw = inputs()
    step = lambda: model(**kw)  # noqa: E731
    with torch.no_grad():
        res_ms = statistics.median(timed(step, 10))
        res_prof = profile(step)
        model.to("cpu")
        torch.cuda.empty_cache()
        h = spt.offload(model, budget=budget, policy=policy, **options)
        timed(step, warm)
        c0 = counters(h)
        hist0 = list(h._hook_hist)
        ts = timed(step, 5)
        c1 = counters(h)
        steady = [b - a for a, b in zip(hist0, h._hook_hist)]
        calls = wrap_calls(h)
        timed(step, 3)
        pr = profile(step)
        if cprofile:
            print(f"\n-- cProfile of {cprofile} steps ({key})")
            python_profile(step, cprofile, 25)
    d = {k: (c1[k] - c0[k]) / 5 for k in c0}
    print(f"\n== {key} budget {budget / 2**30:.2f} GiB of {total / 2**30:.2f}, {policy} {options}, {len(h.units)} units")
    print(f"resident {res_ms:.1f} ms (kernels busy {res_prof['kernels_busy_ms']:.1f}, {res_prof['kernels']} kernels, "
          f"syncs {res_prof['host_syncs']}); offloaded {statistics.median(ts):.1f} ms {['%.1f' % t for t in ts]}")
    print("per step: " + ", ".join(f"{k} {v:.1f}" if k not in ("bytes_h2d", "plan_prefetch_bytes", "plan_prefetch_wasted")
                                   else f"{k} {v / 2**20:.0f} MiB" for k, v in d.items()
                                   if k not in ("hook_ns", "lock_wait_ns"))
          + f", lock wait {d['lock_wait_ns'] / 1e6:.2f} ms ({d['lock_wait_ns'] / max(d['acquires'], 1) / 1e3:.1f} us/acquire)"
          + f", hook us/acquire mean {d['hook_ns'] / max(d['acquires'], 1) / 1e3:.1f}, "
          f"median (whole run) {h.hook_stats()['hook_us_median']:.1f}")
    print("hook us/acquire in the steady steps (1-us buckets): " + ", ".join(
        f"p{int(q * 100)} {hist_q(steady, q)}" for q in (0.1, 0.25, 0.5, 0.75, 0.9)))
    for k, v in calls.items():
        if v:
            print(f"  C {k}: {len(v) / 3:.0f}/step, p50 {pct(v, .5):.1f} us, p90 {pct(v, .9):.1f}, max {pct(v, 1):.1f}, "
                  f"sum {sum(v) / 3e6:.2f} ms/step")
    print(f"profile: wall {pr['wall_ms']:.1f} ms/step, kernels busy {pr['kernels_busy_ms']:.1f}, uploads busy "
          f"{pr['h2d_busy_ms']:.1f} ({pr['h2d_copies']} copies), kernels {pr['kernels']}, host syncs {pr['host_syncs']}")
    for who, p in (("offloaded", pr), ("resident", res_prof)):
        print(f"driver and runtime calls a step, {who} (count, ms): " + ", ".join(
            f"{k} {n:.0f} {ms:.2f}" for k, n, ms in p["driver_calls"][:12]))
    print("\n".join(h.summary().splitlines()[:14]))
    print(next((ln.strip() for ln in h.context.summary().splitlines() if "policy plan" in ln), "(no plan line)"))
    h.remove()
    del model, h
    torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="sd15:0.40,sdxl:0.35,sdxl:8589934592,flux:8589934592")
    ap.add_argument("--policy", default="plan")
    ap.add_argument("--warm", type=int, default=25)
    ap.add_argument("--unit-max", type=int, default=0, help="cap on the partition's largest unit, bytes")
    ap.add_argument("--options", default="", help="offload options, k=v,k=v (e.g. vmm=off)")
    ap.add_argument("--cprofile", type=int, default=0, help="also cProfile this many steps (Python's share)")
    args = ap.parse_args()
    options = dict(kv.split("=", 1) for kv in args.options.split(",") if kv)
    torch.backends.cuda.matmul.allow_tf32 = False
    with td.unit_cap(args.unit_max):
        for case in args.cases.split(","):
            run(case, args.policy, args.warm, options, args.cprofile)


if __name__ == "__main__":
    main()
