#!/usr/bin/env python3
"""The least time a denoiser step can take under a weight budget, for any schedule of uploads,
from the resident step's timeline: a sharper bound than max(resident, (weights - budget) / link).

Why the simple bound is not reachable on every model: a unit must be whole on the device while
it runs, so whatever runs in a stretch W of the step needs its distinct weights there during W.
At W's start at most M bytes of weights are on the device (M: the budget less what the top level
holds for the whole step), and during W the link brings at most link * duration(W). So

    duration(W) >= max(compute(W), (bytes(W) - M) / link)

and for any division of the (cyclic) step into stretches, the step is at least the sum of their
bounds. One stretch is the simple bound; a UNet whose weights sit in its low-resolution blocks
while its compute sits in the high-resolution ones gets more from two. This program records the
resident step with a CUDA event at the entry and exit of every module whose forward acquires
units (the units offload() forms for that budget), scales the intervals to the resident step
timed without the events, and maximizes the sum over all divisions (a dynamic program per
starting point). Units larger than the budget are not an issue here: the partition keeps each
under a quarter of it.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python:$DIFFUSERS/src \\
        python3 bench/dev/room_bound.py --cases sd15:0.40,sdxl:0.35,sdxl:8589934592,flux:8589934592
    python3 bench/dev/room_bound.py --from ROOM.json --resident-ms sdxl=60.7   # again, no GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Dict, Iterator, List, NamedTuple, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "peers"))
import torch_diffusion as td  # noqa: E402
from spillway.torch import _partition, _setup  # noqa: E402

GiB = 1 << 30


def timeline(model: torch.nn.Module, kw: Dict[str, Any], budget: int,
             div: int = 0) -> Tuple[List[Tuple[float, frozenset]], Dict[int, int], int, float]:
    """([(ms, indices of the units needed)] in order over one resident step, unit index -> bytes,
    bytes the top level holds throughout, the plain resident step in ms). div: units of at most
    budget / div instead of offload()'s partition (an experiment on the units' size)."""
    params, names = _setup.check_module(model, None)
    grads, kept = _setup.trainable(model, params, None, None)
    bounds = _partition.bounds
    if div:
        _partition.bounds = lambda b, s=0, seg=False: (min(b // div // 2, _partition._LO_MAX), max(b // div, 1))
    try:
        units, needs, hooked = _setup.units(model, None, kept, grads, names, budget, 0)[:3]
    finally:
        _partition.bounds = bounds
    sizes = {u.index: u.nbytes for u in units}
    top = {u.index for u in needs.get(id(model), [])}
    events: List[Tuple[torch.cuda.Event, int, int]] = []  # (event, +1 enter / -1 exit, module id)

    def mark(m: torch.nn.Module, sign: int) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        events.append((e, sign, id(m)))

    with torch.no_grad():
        plain, _ = td.timed_steps(lambda: model(**kw), 20)  # the first steps pick kernels (convolutions)
    handles = []
    for m in hooked:
        if m is model:
            continue
        handles.append(m.register_forward_pre_hook(lambda mod, a: mark(mod, 1)))
        handles.append(m.register_forward_hook(lambda mod, a, o: mark(mod, -1)))
    with torch.no_grad():
        for _ in range(3):
            events.clear()
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            model(**kw)
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            torch.cuda.synchronize()
    for h in handles:
        h.remove()
    items: List[Tuple[float, frozenset]] = []
    open_: List[int] = []  # module ids entered and not yet left
    prev = start
    for e, sign, mid in events + [(end, 0, 0)]:
        need = frozenset(u.index for m in open_ for u in needs.get(m, []) if u.index not in top)
        items.append((prev.elapsed_time(e), need))
        prev = e
        if sign > 0:
            open_.append(mid)
        elif sign < 0:
            open_.remove(mid)
    with_events = sum(ms for ms, _ in items)
    resident = statistics.median(plain[10:])
    scale = resident / with_events  # the events' own host time spread evenly
    return [(ms * scale, need) for ms, need in items], sizes, sum(sizes[i] for i in top), resident


def best_division(items: List[Tuple[float, frozenset]], sizes: Dict[int, int], room: int, bytes_per_ms: float,
                  starts: int) -> Tuple[float, List[Tuple[int, int, float, int]]]:
    """max over divisions of the cyclic sequence into stretches of sum max(compute, (bytes - room)
    / link), tried from `starts` starting points spread over the step; (bound ms, its stretches as
    (first item, items, ms of compute, distinct bytes))."""
    n = len(items)
    best, best_parts = -1.0, []
    for s in sorted({round(i * n / starts) % n for i in range(starts)}):
        seq = items[s:] + items[:s]
        # val[i][k]: bound of the stretch seq[i:i+k+1]
        val = []
        for i in range(n):
            seen: set = set()
            b, c, row = 0, 0.0, []
            for j in range(i, n):
                ms, need = seq[j]
                c += ms
                for u in need:
                    if u not in seen:
                        seen.add(u)
                        b += sizes[u]
                row.append((max(c, (b - room) / bytes_per_ms), c, b))
            val.append(row)
        f = [0.0] * (n + 1)
        arg = [0] * (n + 1)
        for k in range(1, n + 1):
            bv, ba = -1.0, 0
            for j in range(k):
                v = f[j] + val[j][k - 1 - j][0]
                if v > bv:
                    bv, ba = v, j
            f[k], arg[k] = bv, ba
        if f[n] > best:
            parts, k = [], n
            while k > 0:
                j = arg[k]
                v, c, b = val[j][k - 1 - j]
                parts.append(((j + s) % n, k - j, c, b))
                k = j
            best, best_parts = f[n], parts[::-1]
    return best, best_parts


class Case(NamedTuple):
    """One saved case of --json, its timeline scaled to `resident`."""
    record: Dict[str, Any]
    items: List[Tuple[float, frozenset]]
    sizes: Dict[int, int]
    room: int  # the budget less what the top level holds throughout
    bytes_per_ms: float
    resident: float
    simple: float  # max(resident, (weights - budget) / link)


def saved_cases(path: str, resident_ms: str = "") -> Iterator[Case]:
    """The cases of an earlier --json; resident_ms "MODEL=MS,...": each such model's timeline
    scaled to that resident step (a run whose host slowed the resident step evenly)."""
    scale_to = dict((k, float(v)) for k, v in (x.split("=") for x in filter(None, resident_ms.split(","))))
    for r in json.load(open(path)):
        resident = scale_to.get(r["model"], r["resident_ms"])
        f = resident / r["resident_ms"]
        bytes_per_ms = r["link_gbps"] * 1e6
        yield Case(r, [(ms * f, frozenset(need)) for ms, need in r["timeline"]],
                   {int(k): v for k, v in r["sizes"].items()}, r["budget"] - r["top_bytes"], bytes_per_ms,
                   resident, max(resident, (r["weights"] - r["budget"]) / bytes_per_ms))


def offline(args: argparse.Namespace) -> None:
    """The bound again from saved timelines, each optionally scaled to another resident step."""
    for c in saved_cases(args.source, args.resident_ms):
        r = c.record
        bound, parts = best_division(c.items, c.sizes, c.room, c.bytes_per_ms, args.starts)
        print(f"{r['model']} at {r['budget'] / GiB:.2f} GiB, resident {c.resident:.1f} ms (recorded at "
              f"{r['resident_ms']:.1f}): simple bound {c.simple:.1f} ms, room bound {bound:.1f} ms "
              f"({bound / c.simple:.3f}x the simple one)")
        for a, k, ms, b in parts:
            if b > c.room:
                print(f"  intervals {a}+{k}: compute {ms:.1f} ms, weights {b / GiB:.2f} GiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="sd15:0.40,sdxl:0.35,flux:8589934592",
                    help="model:budget[:div] (a fraction or bytes; div: units of at most budget / div)")
    ap.add_argument("--starts", type=int, default=48, help="starting points of the cyclic division tried")
    ap.add_argument("--link", type=float, default=0.0, help="GB/s (default: measured, as torch_diffusion.py)")
    ap.add_argument("--json", default="")
    ap.add_argument("--from", dest="source", default="", help="no GPU: the timelines of an earlier --json")
    ap.add_argument("--resident-ms", default="", help="with --from, MODEL=MS,...: each timeline scaled to that "
                    "resident step (a run whose host slowed the resident step evenly)")
    args = ap.parse_args()
    if args.source:
        offline(args)
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    link = args.link or td.link_gbps()
    bytes_per_ms = link * 1e6
    print(f"link {link:.1f} GB/s; torch {torch.__version__}")
    out = []
    built: Dict[str, Any] = {}
    for case in args.cases.split(","):
        key, spec, *div = case.split(":")
        div = int(div[0]) if div else 0
        if key not in built:
            built.clear()
            torch.cuda.empty_cache()
            built[key] = td.MODELS[key][0](False)
        model, inputs = built[key]
        total = td.nbytes(model)
        budget = td.budget_bytes(spec, total)
        items, sizes, top, resident = timeline(model, inputs(), budget, div)
        room = budget - top
        simple = max(resident, (total - budget) / bytes_per_ms)
        bound, parts = best_division(items, sizes, room, bytes_per_ms, args.starts)
        r = dict(model=f"{key}/{div}" if div else key, budget=budget, weights=total, link_gbps=link,
                 resident_ms=resident, simple_bound_ms=simple,
                 room_bound_ms=bound, units=len(sizes), items=len(items), top_bytes=top,
                 timeline=[(ms, sorted(need)) for ms, need in items], sizes=sizes,
                 stretches=[dict(first=a, items=k, compute_ms=c, bytes=b) for a, k, c, b in parts])
        out.append(r)
        print(f"\n{key} at {budget / GiB:.2f} GiB of {total / GiB:.2f} GiB ({len(sizes)} units, {len(items) // 2} hooked calls): "
              f"resident {resident:.1f} ms, simple bound {simple:.1f} ms, room bound {bound:.1f} ms "
              f"({bound / simple:.3f}x the simple one)")
        for a, k, c, b in parts:
            print(f"  intervals {a:4d}+{k:<4d} compute {c:7.2f} ms  weights {b / GiB:6.3f} GiB  "
                  f"-> {max(c, (b - room) / bytes_per_ms):7.2f} ms", flush=True)
        if args.json:  # after every case: a later one may not finish
            with open(args.json, "w") as f:
                json.dump(out, f)


if __name__ == "__main__":
    main()
