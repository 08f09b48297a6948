#!/usr/bin/env python3
"""Where a recomputed training step through spillway.torch.offload spends its time, against the
same step recomputed by hand: bench/peers/torch_train.py's model on the device (AdamW fused, bf16
autocast), one process, several ways in turn over the same model and optimizer:

  resident      no recomputation (only without --alloc: it does not fit 18 GiB)
  by-hand       torch.utils.checkpoint (non-reentrant) around every decoder layer
  by-hand-nocheck    the same with determinism_check="none"
  by-hand-reentrant  the same, reentrant
  offload-true  offload(model, optimizer=opt, recompute=True)   (everything trained on the device)
  offload-auto  offload(model, optimizer=opt, recompute="auto")

Printed per way: ms a step (median after the warm-up), the host's own time per step (until the
step's last call returns, before the synchronization), the GPU's time (CUDA events around the
step), and under --alloc the segments PyTorch took and gave back per step, their host time, and
the reclaim calls. A host time near the step time means the GPU waits for Python.

    PYTHONPATH=$PWD/python python3 bench/dev/recompute_gap.py [--alloc 18GiB] [--ways ...]
"""
from __future__ import annotations

import argparse
import functools
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "peers"))
import torch_train as tt  # noqa: E402
from ckpt_share import by_hand, resident  # noqa: E402

GiB = 1 << 30


HAND = {"by-hand": dict(use_reentrant=False),
        "by-hand-nocheck": dict(use_reentrant=False, determinism_check="none"),
        "by-hand-reentrant": dict(use_reentrant=True)}


def segment_counts():
    import ctypes

    import spillway.torch._alloc as a
    buf = (ctypes.c_uint64 * 4)()
    a._lib_c.spw_torch_call_stats(0, buf)
    return list(buf) + [a._reclaims["calls"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.1b")
    ap.add_argument("--ways", default="resident,by-hand,offload-true,offload-auto,by-hand")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=6)
    ap.add_argument("--alloc", default=None, help="run under spillway.torch.use_allocator(budget=ALLOC)")
    ap.add_argument("--budget", default="18GiB", help="offload's budget without --alloc")
    ap.add_argument("--profile", action="store_true", help="cProfile the last step of each way")
    ap.add_argument("--kernels", action="store_true", help="the GPU's kernel time of one more step (torch.profiler)")
    args = ap.parse_args()
    import spillway.torch as spt
    model, layers, inner, opt, ids = resident(args.model, args.alloc)
    trained = [p for p in model.parameters() if p.requires_grad]
    print(f"model {args.model}, {sum(p.numel() for p in trained) / 1e9:.2f}B trained, "
          f"alloc {args.alloc or '-'}", flush=True)
    for way in args.ways.split(","):
        if way == "resident" and args.alloc:
            continue
        for i, layer in enumerate(layers):
            layer.forward = functools.partial(by_hand, layer, inner[i], _kw=HAND[way]) if way in HAND else inner[i]
        off = None
        if way.startswith("offload"):
            kw = {} if args.alloc else dict(budget=args.budget)
            off = spt.offload(model, optimizer=opt, recompute=True if way == "offload-true" else "auto", **kw)
        torch.cuda.synchronize()
        if not args.alloc:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        else:
            spt.reset_peak_memory_stats()
        rows = []
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        prof = None
        gc_ns = [0, 0, 0]  # ns in collections of generation 2 during the timed steps, their count, all collections

        def gc_cb(phase, info, t=[0]):
            if phase == "start":
                t[0] = time.perf_counter_ns()
            elif timing[0]:
                gc_ns[2] += 1
                if info["generation"] == 2:
                    gc_ns[0] += time.perf_counter_ns() - t[0]
                    gc_ns[1] += 1
        timing = [False]
        gc.callbacks.append(gc_cb)
        for step in range(args.steps):
            timing[0] = step >= args.warmup
            torch.cuda.synchronize()
            seg0 = segment_counts() if args.alloc else None
            if args.profile and step == args.steps - 1:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t0 = time.perf_counter()
            ev[0].record()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = tt.loss_of(model, ids)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            ev[1].record()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            if prof is not None:
                prof.disable()
            seg = [b - a for a, b in zip(seg0, segment_counts())] if seg0 else None
            if step >= args.warmup:
                rows.append(((t2 - t0) * 1e3, (t1 - t0) * 1e3, ev[0].elapsed_time(ev[1]), seg))
        gc.callbacks.remove(gc_cb)
        kernels = ""
        if args.kernels:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as p:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = tt.loss_of(model, ids)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                torch.cuda.synchronize()
            busy = sum(e.self_device_time_total for e in p.key_averages()) / 1e3
            kernels = f"; kernels {busy:.1f} ms"
        ms = statistics.median(r[0] for r in rows)
        host = statistics.median(r[1] for r in rows)
        gpu = statistics.median(r[2] for r in rows)
        peak = spt.max_memory_reserved() if args.alloc else torch.cuda.max_memory_reserved()
        extra = ""
        if args.alloc:
            segs = [r[3] for r in rows]
            extra = (f"; per step segments taken {statistics.median(s[0] for s in segs):.0f} "
                     f"({statistics.median(s[1] for s in segs) / 1e6:.2f} ms), given back "
                     f"{statistics.median(s[2] for s in segs):.0f} ({statistics.median(s[3] for s in segs) / 1e6:.2f} ms), "
                     f"reclaims {sum(s[4] for s in segs)} in {len(segs)} steps")
        note = ""
        if off is not None:
            st = off.stats()
            note = (f"; units {len(off.units)}, moved {st['bytes_h2d']['total'] / GiB:.2f} GiB in, "
                    f"blocks kept {st['offload'].get('blocks_kept')}, recomputed {st['offload'].get('blocks_recomputed')}")
        print(f"{way:13s}: {ms:7.1f} ms a step (each: {' '.join(f'{r[0]:.0f}' for r in rows)}); host {host:6.1f} ms, "
              f"GPU {gpu:6.1f} ms{kernels}; gc: {gc_ns[2]} collections, {gc_ns[1]} of gen 2 taking "
              f"{gc_ns[0] / 1e6:.1f} ms; peak {peak / GiB:.2f} GiB{extra}{note}", flush=True)
        if prof is not None:
            import io
            import pstats
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(18)
            print(out.getvalue(), flush=True)
        if off is not None:
            off.remove()


if __name__ == "__main__":
    main()
