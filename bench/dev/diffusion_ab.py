#!/usr/bin/env python3
"""spillway.torch.offload of a diffusion denoiser under several context options, A/B in one
process against the resident model, round after round.

Hosts of the lent H200 kind differ in host-bound work from process to process and drift within
one (bench/dev/hook_ab.py), and SD 1.5's UNet is bound by the host's kernel launches, so its
ratio to resident means something only against a resident pass of the same round. Each round
runs the resident model, then each variant (offload with its options, --warm steps for the plan
to learn and choose its pipeline, --steps timed steps, remove()), the order rotating by round.
Per variant: the median step over the rounds, the median of its per-round ratios to resident
and to the physical bound (max(resident, (weights - budget) / link), the link measured at the
start), the median host time per acquire, bytes uploaded and trims a step, the pipeline the plan
chose, and whether the output equals resident's bitwise; per round and variant, its first --warm
steps one by one.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python:$PWD/.peers/diffusers/src \\
        python3 bench/dev/diffusion_ab.py --model sd15 --budget 0.40 \\
        --variants 'plan;plan:prefetch_thread=off;lru'

A variant is POLICY[:key=value,...] (offload's policy and context options, as SPILLWAY_CONF
spells them; unit_max=BYTES caps the partition's largest unit instead, as
diffusion_profile.py's --unit-max does; runs=grouped partitions as before lists whose modules
are not called back to back were told apart: the A/B of that rule).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "peers"))
import torch_diffusion as td  # noqa: E402
import spillway.torch as spt  # noqa: E402
from spillway.torch._report import _median_us  # noqa: E402


def parse_variant(text):
    policy, _, opts = text.partition(":")
    kw = {}
    for item in filter(None, opts.split(",")):
        k, _, v = item.partition("=")
        kw[k.strip()] = v.strip()
    return policy.strip(), kw


def plan_line(h):
    return next((ln.split("pipeline", 1)[1].split(",")[0].strip() for ln in h.context.summary().splitlines()
                 if "policy plan" in ln and "pipeline" in ln), "-")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="sd15", choices=sorted(td.MODELS))
    ap.add_argument("--budget", default="0.40", help="a fraction of the weights (with a point) or bytes")
    ap.add_argument("--variants", default="plan;plan:prefetch_thread=off;lru")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm", type=int, default=20)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--summary", action="store_true", help="print each variant's offload summary in the first round")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    link = td.link_gbps()
    model, inputs = td.MODELS[a.model][0](False)
    total = td.nbytes(model)
    budget = td.budget_bytes(a.budget, total)
    kw = inputs()
    step = lambda: model(**kw)  # noqa: E731
    names = a.variants.split(";")
    variants = dict(zip(names, map(parse_variant, names)))
    rows = {n: {"ms": [], "ratio": [], "hook": [], "h2d": [], "trims": [], "pipe": set(), "equal": True} for n in names}
    res_ms = []
    with torch.no_grad():
        ref = td._out(step()).clone()
        for r in range(a.rounds):
            torch.cuda.synchronize()
            ts, _ = td.timed_steps(step, a.warm // 2 + a.steps)
            res = statistics.median(ts[-a.steps:])
            res_ms.append(res)
            model.to("cpu")
            torch.cuda.empty_cache()
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                policy, opts = variants[n]
                opts = dict(opts)
                grouped = opts.pop("runs", "") == "grouped"
                with td.unit_cap(int(opts.pop("unit_max", 0))), td.runs_grouped(grouped):
                    h = spt.offload(model, budget=budget, policy=policy, **opts)
                warm, _ = td.timed_steps(step, a.warm)
                s0, hist0 = h.stats(), list(h._hook_hist)
                ts, out = td.timed_steps(step, a.steps)
                s1 = h.stats()
                row = rows[n]
                ms = statistics.median(ts)
                row["ms"].append(ms)
                row["ratio"].append(ms / res)
                steady = [y - x for x, y in zip(hist0, h._hook_hist)]
                row["hook"].append(_median_us(steady))
                row["h2d"].append((s1["bytes_h2d"]["total"] - s0["bytes_h2d"]["total"]) / a.steps / 2**30)
                row["trims"].append((s1["trim_syncs"]["total"] - s0["trim_syncs"]["total"]) / a.steps)
                row["pipe"].add(plan_line(h) if policy == "plan" else policy)
                if a.summary and not r:
                    print(f"--- {n}\n{h.summary()}", flush=True)
                    sizes = sorted(u.nbytes for u in h.units)
                    print(f"unit MiB, sorted: {' '.join('%.2f' % (x / 2**20) for x in sizes)}", flush=True)
                row["equal"] = row["equal"] and torch.equal(td._out(out), ref)
                print(f"  {n}: the first {a.warm} steps {sum(warm) / (len(warm) * ms):.3f}x steady: "
                      + " ".join("%.0f" % t for t in warm), flush=True)
                h.remove()
                torch.cuda.empty_cache()
            model.to(td.DEV)
            print(f"round {r}: resident {res:.1f} ms; " + ", ".join(
                f"{n} {rows[n]['ms'][-1]:.1f} ({rows[n]['ratio'][-1]:.2f}x)" for n in names), flush=True)
    med = statistics.median
    link_ms = (total - budget) / (link * 1e9) * 1e3
    print(f"\n{a.model}, budget {budget / 2**30:.2f} GiB of {total / 2**30:.2f} GiB, {a.rounds} rounds, "
          f"resident {med(res_ms):.1f} ms (rounds {', '.join('%.1f' % x for x in res_ms)}); link {link:.1f} GB/s: "
          f"the offloaded bytes less the budget take {link_ms:.1f} ms")
    print("| variant | ms/step | x resident (median of rounds) | x bound | hook us/acquire | GiB up/step | "
          "trims/step | pipeline | bitwise |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for n in names:
        row = rows[n]
        # the bound of each round: max(its resident step, the link's time for the bytes that must move)
        bound = med([ms / max(r, link_ms) for ms, r in zip(row["ms"], res_ms)])
        print(f"| {n} | {med(row['ms']):.1f} | {med(row['ratio']):.3f} | {bound:.3f} | {med(row['hook']):.1f} | "
              f"{med(row['h2d']):.2f} | {med(row['trims']):.1f} | {'/'.join(sorted(row['pipe']))} | "
              f"{'yes' if row['equal'] else 'NO'} |")


if __name__ == "__main__":
    main()
