#!/usr/bin/env python3
"""PyTorch peers of `spillway bench stream`, same shapes: 32 bf16 layers of 8192 x 8192 (4 GiB)
held in host memory, a chain of products x = x @ W, the host waiting for each pass.

  resident        all weights on the device: the compute floor and the reference result
  double buffer   weights in pinned host memory, two device slots, the copy of the layer after
                  next issued on a side stream as soon as the product that read its slot is
                  done, events between: the hand-written version that issue 3 names (78 ms)
  sync .to()      pageable host weights, W.to('cuda') before each product: what accelerate's
                  cpu_offload hooks do (591 ms in issue 3)
  static split    k layers resident on the device, the other 32-k streamed through two device
                  slots exactly as the double buffer does: the hand-tuned peer. k and the
                  placement of the resident layers are searched as an expert would, by trying:
                  every k whose measured device peak fits the budget, each with three
                  placements (resident prefix; streamed layers first; resident layers spread
                  evenly so the link also works while resident layers multiply), timed with
                  --search-passes passes each; the fastest is then timed with --passes passes.

"Fits" is measured, not computed: torch.cuda.max_memory_allocated() over one pass, after
reset_peak_memory_stats(), with everything the variant holds on the device counted (resident
layers, slots, input, two preallocated output buffers that the products ping-pong through,
cuBLAS workspace); a candidate is accepted only if that peak is <= the budget. The search is done
once per batch up to the largest budget (a candidate's time does not depend on the budget), then
each budget keeps the fastest candidate that fits it.

Prints, per (budget, batch), ms per pass (median of the passes after the first), bytes moved per
pass, the ratio to the link bound of those bytes (moved / the pinned host-to-device rate measured
here, 1 GiB, best of 4), the device peak, and whether the result is bitwise equal (torch.equal)
to the resident chain. Every product is torch.matmul(x, w, out=buf), so all variants run the
same kernels on the same data. Exit status 1 if any result differs.

    python3 bench/peers/torch_stream.py                                  # 2 GiB, batch 16
    python3 bench/peers/torch_stream.py --budget 1GiB,2GiB,3GiB --batch 16,4096 --json out.json
    python3 bench/peers/torch_stream.py --smoke     # tiny shapes on the CPU: the control flow only

On the H200 the second command takes about 2 minutes (limit: 4); progress goes to stderr.
"""
import argparse
import json
import re
import statistics
import sys
import time

import torch

bf16 = torch.bfloat16
T0 = time.perf_counter()
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (examples: 2GiB, 512MiB)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


def fmt_size(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % (scale // 4) == 0:
            return f"{n / scale:g}{unit}"
    return f"{n}B"


class Bench:
    """The layers, the link rate, and the passes, on cuda or (for --smoke) on the cpu, where
    streams and events do not exist and copies are synchronous: the control flow is the same."""

    def __init__(self, args):
        self.args = args
        self.dev = torch.device("cpu" if args.smoke else "cuda")
        self.cuda = self.dev.type == "cuda"
        L, K = args.layers, args.dim
        g = torch.Generator().manual_seed(1)
        # Variance 1/K keeps the activations' scale across the chain (nothing overflows or
        # vanishes in bf16 over 32 layers); rolled, scaled copies of one matrix keep the build fast.
        base = torch.randn(K, K, generator=g) / K ** 0.5
        self.host = [(base.roll(l, dims=1) * (1 + l / 64)).to(bf16) for l in range(L)]  # pageable
        self.pinned = [w.pin_memory() for w in self.host] if self.cuda else self.host
        self.g = g
        self.layer_bytes = K * K * 2
        self.model_bytes = L * self.layer_bytes
        self.link_gbps = self.measure_link()

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def measure_link(self):
        n = (1 << 30) if self.cuda else (64 << 20)
        src = torch.empty(n, dtype=torch.uint8)
        if self.cuda:
            src = src.pin_memory()
        dst = torch.empty(n, dtype=torch.uint8, device=self.dev)
        dst.copy_(src)  # first touch outside the timing
        best = float("inf")
        for _ in range(4):
            self.sync()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            self.sync()
            best = min(best, time.perf_counter() - t)
        del dst, src
        return n / best / 1e9

    def bound_ms(self, moved):
        return moved / (self.link_gbps * 1e6)

    def timed(self, run, passes):
        """Median ms of the passes after the first, and the first pass's output on the host."""
        times, first = [], None
        for i in range(passes):
            self.sync()
            t = time.perf_counter()
            out = run()
            self.sync()
            times.append((time.perf_counter() - t) * 1e3)
            if i == 0:
                first = out.cpu().clone()  # the buffers are overwritten by the next pass
        return statistics.median(times[1:]) if len(times) > 1 else times[0], first

    def peak_of(self, run):
        """Device bytes held during one pass: measured on cuda; on the cpu (smoke) the caller's
        byte count is used instead."""
        if not self.cuda:
            run()
            return None
        self.sync()
        torch.cuda.reset_peak_memory_stats()
        run()
        self.sync()
        return torch.cuda.max_memory_allocated()

    def chain(self, x0, weight_of, before=None, after=None):
        """One pass of products through two preallocated output buffers (ping-pong), so the
        activation footprint is fixed: the input and two outputs."""
        outs = [torch.empty_like(x0) for _ in range(2)]

        def run():
            if before:
                before()
            x, o = x0, 0
            for l in range(self.args.layers):
                w = weight_of(l)
                torch.matmul(x, w, out=outs[o])
                x, o = outs[o], o ^ 1
                if after:
                    after(l)
            return x
        return run

    def split(self, x0, resident_ids):
        """k resident layers, the rest streamed through two device slots from pinned host
        memory. The copy into a slot waits (on the device) for the product that last read it,
        and is issued right after that product, so each copy starts as early as two slots
        allow; with resident layers between streamed ones the link keeps working during their
        products. Returns (run, bytes moved per pass)."""
        L = self.args.layers
        res = {l: self.pinned[l].to(self.dev, non_blocking=True) for l in sorted(resident_ids)}
        seq = [l for l in range(L) if l not in res]
        slot_of = {l: j for j, l in enumerate(seq)}
        slots = [torch.empty_like(self.host[0], device=self.dev) for _ in range(min(2, len(seq)))]
        if self.cuda:
            side = torch.cuda.Stream()
            ready = [torch.cuda.Event() for _ in slots]
            free = [torch.cuda.Event() for _ in slots]
        self.sync()

        def issue(j):
            s = j % 2
            if not self.cuda:
                slots[s].copy_(self.pinned[seq[j]])
                return
            with torch.cuda.stream(side):
                side.wait_event(free[s])  # the product that last read slot s is done
                slots[s].copy_(self.pinned[seq[j]], non_blocking=True)
                ready[s].record(side)

        def start():
            # Both slots are free at the start of a pass: fill them at once, so the link works
            # from the first resident product on.
            for j in range(len(slots)):
                issue(j)

        def weight_of(l):
            if l in res:
                return res[l]
            j = slot_of[l]
            if self.cuda:
                torch.cuda.current_stream().wait_event(ready[j % 2])
            return slots[j % 2]

        def after(l):
            j = slot_of.get(l)
            if j is None:
                return
            if self.cuda:
                free[j % 2].record(torch.cuda.current_stream())
            if j + 2 < len(seq):
                issue(j + 2)

        return self.chain(x0, weight_of, before=start, after=after), len(seq) * self.layer_bytes


def placements(L, k):
    """Which layers stay resident for a given k: the hand placements an expert would try."""
    if k == 0:
        return {"none": []}
    if k >= L:
        return {"all": list(range(L))}
    return {
        "prefix": list(range(k)),
        "streamed first": list(range(L - k, L)),
        "spread": sorted({int((i + 0.5) * L / k) for i in range(k)}),
    }


def run_batch(b, batch, budgets, rows):
    args, L, K, dev = b.args, b.args.layers, b.args.dim, b.dev
    act_bytes = 3 * batch * K * 2  # input + two output buffers, for the smoke byte count only
    x0 = torch.randn(batch, K, generator=b.g).to(bf16).to(dev)

    def row(variant, ms, moved, peak, out, **extra):
        equal = bool(torch.equal(out, ref)) if variant != "resident" else True
        finite = bool(torch.isfinite(out.float()).all()) and bool(out.abs().max() > 0)
        r = dict(variant=variant, batch=batch, ms=ms, moved_bytes=moved,
                 link_bound_ms=b.bound_ms(moved) if moved else 0.0,
                 vs_link=(b.bound_ms(moved) / ms) if moved else None,
                 peak_bytes=peak, equal=equal, finite_nonzero=finite, **extra)
        return r

    log(f"batch {batch}: resident")
    resident_w = [w.to(dev) for w in b.pinned]
    run = b.chain(x0, lambda l: resident_w[l])
    peak = b.peak_of(run)
    if peak is None:
        peak = b.model_bytes + act_bytes
    res_ms, ref = b.timed(run, args.passes)
    if not (torch.isfinite(ref.float()).all() and ref.abs().max() > 0):
        raise SystemExit(f"resident chain at batch {batch} is not finite and nonzero: bad data")
    common = [row("resident", res_ms, 0, peak, ref)]
    del resident_w, run
    if b.cuda:
        torch.cuda.empty_cache()

    log(f"batch {batch}: double buffer")
    run, moved = b.split(x0, [])
    peak = b.peak_of(run) or (2 * b.layer_bytes + act_bytes)
    ms, out = b.timed(run, args.passes)
    common.append(row("double buffer", ms, moved, peak, out))
    del run

    log(f"batch {batch}: sync .to() ({args.sync_passes} passes)")
    run = b.chain(x0, lambda l: b.host[l].to(dev))
    peak = b.peak_of(run) or (b.layer_bytes + act_bytes)
    ms, out = b.timed(run, args.sync_passes)
    common.append(row("sync .to()", ms, b.model_bytes, peak, out))
    del run

    # The search: every k up to the largest budget's fit, every placement. A candidate's time
    # does not depend on the budget, so one search serves every budget.
    top = max(budgets)
    cands = []
    for k in range(0, L + 1):
        fitted = False
        for place, ids in placements(L, k).items():
            run, moved = b.split(x0, ids)
            held = torch.cuda.memory_allocated() if b.cuda else None
            if held is not None and held > top:
                del run
                break
            peak = b.peak_of(run)
            if peak is None:
                peak = (k + min(2, L - k)) * b.layer_bytes + act_bytes
            if peak > top:
                del run
                break
            fitted = True
            ms, out = b.timed(run, 1 + args.search_passes)
            eq = bool(torch.equal(out, ref))
            cands.append(dict(k=k, placement=place, ms=ms, moved=moved, peak=peak, equal=eq))
            del run
            if b.cuda:
                torch.cuda.empty_cache()
        if not fitted:
            break
        log(f"batch {batch}: k={k}: " + ", ".join(
            f"{c['placement']} {c['ms']:.2f} ms" for c in cands if c["k"] == k))

    for budget in budgets:
        rows_here = [dict(r, budget=budget) for r in common]
        fit = [c for c in cands if c["peak"] <= budget and c["equal"]]
        if not fit:
            wrong = [c for c in cands if c["peak"] <= budget and not c["equal"]]
            rows_here.append(dict(variant="static split", batch=batch, budget=budget, equal=False,
                                  error=(f"{len(wrong)} fitting candidates differ from the reference"
                                         if wrong else "no k fits the budget (two slots and the "
                                         "activations alone exceed it)")))
        else:
            best = min(fit, key=lambda c: c["ms"])
            log(f"budget {fmt_size(budget)} batch {batch}: static split k={best['k']} "
                f"({best['placement']}), timing {args.passes} passes")
            ids = placements(L, best["k"])[best["placement"]]
            run, moved = b.split(x0, ids)
            peak = b.peak_of(run) or best["peak"]
            ms, out = b.timed(run, args.passes)
            del run
            if b.cuda:
                torch.cuda.empty_cache()
            kmax = max(c["k"] for c in cands if c["peak"] <= budget)
            rows_here.append(dict(row("static split", ms, moved, peak, out), budget=budget,
                                  k=best["k"], placement=best["placement"],
                                  search=dict(candidates=len([c for c in cands if c["peak"] <= budget]),
                                              kmax=kmax, search_ms=best["ms"],
                                              per_k={f"{c['k']}/{c['placement']}": round(c["ms"], 3)
                                                     for c in cands if c["peak"] <= budget})))
            if peak > budget:
                rows_here[-1]["error"] = f"peak {peak} B over the budget on re-measure"
        rows_here[0]["note"] = "all weights on the device: over any budget here; the reference"
        rows.extend(rows_here)


def print_table(b, rows, budget, batch):
    args = b.args
    print(f"\nbudget {fmt_size(budget)}, batch {batch}: {args.layers} layers of {args.dim}x{args.dim} "
          f"bf16 ({b.model_bytes / 2**30:.2f} GiB), link {b.link_gbps:.1f} GB/s")
    print(f"{'variant':<15}{'k':>4}  {'placement':<15}{'ms/pass':>9}{'moved MiB':>11}{'bound ms':>10}"
          f"{'vs link':>9}{'peak MiB':>10}{'fits':>6}  result")
    for r in rows:
        if r.get("budget") != budget or r.get("batch") != batch:
            continue
        if "ms" not in r:
            print(f"{r['variant']:<15}  error: {r.get('error')}")
            continue
        vs = f"{r['vs_link']:.3f}" if r.get("vs_link") else ""
        fits = "yes" if r["peak_bytes"] <= budget else "no"
        res = "reference" if r["variant"] == "resident" else (
            "bitwise equal" if r["equal"] else "DIFFERS")
        if not r["finite_nonzero"]:
            res += " (NOT finite/nonzero)"
        print(f"{r['variant']:<15}{r.get('k', ''):>4}  {r.get('placement', ''):<15}{r['ms']:>9.2f}"
              f"{r['moved_bytes'] / 2**20:>11.0f}{r['link_bound_ms']:>10.2f}{vs:>9}"
              f"{r['peak_bytes'] / 2**20:>10.0f}{fits:>6}  {res}")
        if r.get("error"):
            print(f"{'':<15}  error: {r['error']}")
    for r in rows:
        if r.get("budget") == budget and r.get("batch") == batch and r.get("search"):
            s = r["search"]
            print(f"  static split: searched {s['candidates']} fitting candidates (k = 0..{s['kmax']}, "
                  f"measured peak <= budget), best k={r['k']} {r['placement']} "
                  f"({s['search_ms']:.2f} ms in the search)")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budget", default=None, help="device budgets, comma-separated (default 2GiB)")
    p.add_argument("--batch", default=None, help="batch sizes, comma-separated (default 16)")
    p.add_argument("--passes", type=int, default=10, help="passes per timed variant (first is warm-up)")
    p.add_argument("--sync-passes", type=int, default=None,
                   help="passes for sync .to() (default: --passes, at most 6: ~0.55 s each)")
    p.add_argument("--search-passes", type=int, default=3,
                   help="timed passes per static-split candidate, after one validation pass")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dim", type=int, default=8192)
    p.add_argument("--json", help="write all rows to this file")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on the cpu (8 layers of 256, batch 4,64, 640KiB): control flow only")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.dim = 8, 256
        args.budget = args.budget or "512KiB,640KiB"
        args.batch = args.batch or "4,64"
        args.passes = min(args.passes, 3)
    budgets = [parse_size(s) for s in (args.budget or "2GiB").split(",")]
    batches = [int(s) for s in (args.batch or "16").split(",")]
    if args.sync_passes is None:
        args.sync_passes = min(args.passes, 6)
    if args.passes < 2 or args.sync_passes < 2:
        p.error("--passes and --sync-passes must be >= 2 (the first pass is a warm-up)")
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device (use --smoke for the cpu control-flow check)")

    log(f"building {args.layers} layers of {args.dim}x{args.dim}")
    b = Bench(args)
    dev_name = torch.cuda.get_device_name() if b.cuda else "cpu (smoke)"
    print(f"torch {torch.__version__}, {dev_name}; link {b.link_gbps:.1f} GB/s "
          f"{'pinned host to device' if b.cuda else 'host memcpy (smoke)'}; full-model link bound "
          f"{b.bound_ms(b.model_bytes):.2f} ms per pass")
    rows = []
    for batch in batches:
        run_batch(b, batch, budgets, rows)
    for budget in budgets:
        for batch in batches:
            print_table(b, rows, budget, batch)
    log("done")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, device=dev_name, link_gbps=b.link_gbps,
                           layers=args.layers, dim=args.dim, rows=rows), f, indent=1)
    bad = [r for r in rows if r["variant"] != "resident" and not (r.get("equal") and r.get("finite_nonzero"))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
