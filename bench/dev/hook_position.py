#!/usr/bin/env python3
"""Where in a forward spillway.torch.offload's hooks spend their host time, layer by layer, on the
Llama-shaped model of bench/peers/torch_offload.py's workload b (random weights, 6 GiB budget).

For every decoder layer, a forward pre-hook (a probe: torch runs it before the layer's forward,
which offload() wraps) records:
  hooks us   offload()'s hook time (hook_ns) from this layer's probe to the next one: the
             layer's wrapper's acquire and release (and the top level's, for the last layer)
  launch us  the host time of launching one tiny kernel (x.add_(1) on one element) just before
             the layer's hooks: a few us when the stream has room, much more when the host has
             run so far ahead of the device that the launch waits for a slot in the queue
  C us       host time inside the one C call of the layer's acquire (spw_acquire or
             spw_release_acquire), through a timing wrapper
  query us   an event query (torch's wrapper of one driver call), just after the launch
  ctypes us  an empty ctypes call into the library (spw_buf_size)
  touch us   mode touch only: reading what the layer's parameter swap will read
Modes: "ahead" (as the benchmark runs: the host runs ahead of the device as far as the queue
lets it), "drained" (the probe first waits for the current stream, so every layer's hooks run
with an empty queue; the next layer's upload may still be in flight) and "touch" ("ahead" with
the swap's data read first: the hooks' time falls by what those cold reads cost them). Medians
over the passes per layer position, then the mean over positions. Before the offload, the
launch and the query are timed alone (out of any forward) for comparison.

    SPILLWAY_LIBRARY=build/libspillway.so PYTHONPATH=python python3 bench/dev/hook_position.py
    ... --policy plan,lru --modes ahead,touch --passes 6 --tokens 16 --options ";prefetch_thread=off"
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
spec = importlib.util.spec_from_file_location("torch_offload", ROOT / "bench" / "peers" / "torch_offload.py")
to = importlib.util.module_from_spec(spec)
spec.loader.exec_module(to)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", default="plan")
    p.add_argument("--budget", default="6GiB")
    p.add_argument("--warmup", type=int, default=24)
    p.add_argument("--passes", type=int, default=6)
    p.add_argument("--tokens", type=int, default=16, help="decode steps timed (batch 8, KV cache)")
    p.add_argument("--options", default="",
                   help="more offload() options, one set per run separated by ';': 'prefetch_thread=off;'")
    p.add_argument("--modes", default="ahead,drained")
    args = p.parse_args()
    import spillway.torch as st
    import spillway._lib as spl

    cfg = types.SimpleNamespace(dev=torch.device("cuda", 0), cuda=True, smoke=False, b_shape=to.B_SHAPE)
    runs = [(pol, dict(kv.split("=", 1) for kv in o.split(",") if kv.strip()))
            for pol in args.policy.split(",") for o in args.options.split(";")]
    t = time.perf_counter()
    model, blocks = to.build_b(cfg, torch.device("cpu"))
    print(f"model built in {time.perf_counter() - t:.1f} s", flush=True)
    c = cfg.b_shape
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, c["vocab"], (c["batch"], c["prompt"]), generator=g).to(cfg.dev)
    tiny = torch.zeros(1, device=cfg.dev)

    def show_output(m, a, o):
        print(f"a block returns {type(o).__name__}", flush=True)
        shown.remove()
    shown = blocks[0].register_forward_hook(show_output)
    ev = torch.cuda.Event()
    ev.record()

    def per_call(f, n=400):
        xs = []
        for _ in range(n):
            t0 = time.perf_counter_ns()
            f()
            xs.append(time.perf_counter_ns() - t0)
        torch.cuda.synchronize()
        return statistics.median(xs) / 1e3
    print(f"alone: tiny launch {per_call(lambda: tiny.add_(1)):.1f} us, event query {per_call(ev.query):.1f} us, "
          f"perf_counter_ns {per_call(lambda: None):.2f} us", flush=True)

    for policy, opts in runs:
        print(f"\n##### policy {policy}, options {opts}", flush=True)
        off = st.offload(model, budget=args.budget, policy=policy, **opts)
        rec = {"mode": "ahead", "rows": None}
        ccalls: list = []

        def probe(i):
            def pre(mod, a):
                rows = rec["rows"]
                if rows is None:
                    return
                if rec["mode"] == "drained":
                    torch.cuda.current_stream().synchronize()
                t0 = time.perf_counter_ns()
                tiny.add_(1)
                t1 = time.perf_counter_ns()
                ev.query()
                t2 = time.perf_counter_ns()
                size(handle)
                t3 = time.perf_counter_ns()
                if rec["mode"] == "touch":  # what the swap reads, read first: its cold-miss cost
                    for u in units_of[i]:
                        for d, k, v, p in u.dev_sets.get(u.dev_at, u.dev_set)[1]:
                            type(d[k])
                            type(v)
                t4 = time.perf_counter_ns()
                rows.append((i, t1 - t0, off.hook_ns, len(ccalls), (t2 - t1, t3 - t2, t4 - t3)))
            return pre

        units_of = [off._needs[id(b)] for b in blocks]

        cur = torch.cuda.current_stream()
        size, handle = spl.lib.spw_buf_size, off.units[0].handle
        handles = [b.register_forward_pre_hook(probe(i), prepend=True) for i, b in enumerate(blocks)]
        for name in ("_c_acquire", "_c_release_acquire"):
            f = getattr(off, name)

            def timed(*a, _f=f):
                t0 = time.perf_counter_ns()
                try:
                    return _f(*a)
                finally:
                    ccalls.append(time.perf_counter_ns() - t0)
            setattr(off, name, timed)

        def run(fn, mode, passes):
            rec["mode"] = mode
            per = {}  # layer -> lists
            for _ in range(passes):
                rec["rows"] = rows = []
                h_end = None
                fn()
                h_end = off.hook_ns
                torch.cuda.synchronize()
                for k, (i, launch, h, nc, q) in enumerate(rows):
                    h_next = rows[k + 1][2] if k + 1 < len(rows) else h_end
                    cc = ccalls[nc] if nc < len(ccalls) else None
                    d = per.setdefault(i, ([], [], [], [], [], []))
                    for j in range(3):
                        d[3 + j].append(q[j] / 1e3)
                    d[0].append((h_next - h) / 1e3)
                    d[1].append(launch / 1e3)
                    if cc is not None:
                        d[2].append(cc / 1e3)
            rec["rows"] = None
            return per

        def show(title, per, acquires, hook_ns):
            print(f"\n{policy} {title}: {hook_ns / max(acquires, 1) / 1e3:.1f} us of hooks per block acquired "
                  f"({acquires} acquires)")
            print("layer  hooks us  launch us  C us  query us  ctypes us  touch us")
            meds = []
            for i in sorted(per):
                row = [statistics.median(x) if x else float("nan") for x in per[i]]
                meds.append(row)
                if i < 4 or i % 4 == 3 or i == len(per) - 1:
                    print(f"{i:5d}  " + "  ".join(f"{x:8.1f}" for x in row))
            print("mean   " + "  ".join(f"{statistics.mean(x):8.1f}" for x in zip(*meds)))

        with torch.no_grad():
            fwd = lambda: model(input_ids=ids, use_cache=False).logits  # noqa: E731
            for _ in range(args.warmup):
                fwd()
            torch.cuda.synchronize()
            for mode in args.modes.split(","):
                a0, h0 = off.acquires, off.hook_ns
                ccalls.clear()
                per = run(fwd, mode, args.passes)
                show(f"prefill, {mode}", per, off.acquires - a0, off.hook_ns - h0)

            def decode():
                out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
                past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                for _ in range(args.tokens):
                    out = model(input_ids=nxt, past_key_values=past, use_cache=True)
                    past, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
                    nxt.cpu()
            decode()
            torch.cuda.synchronize()
            for mode in args.modes.split(","):
                a0, h0 = off.acquires, off.hook_ns
                ccalls.clear()
                per = run(decode, mode, 1)
                show(f"prefill + {args.tokens} decode steps, {mode}", per, off.acquires - a0, off.hook_ns - h0)
        print()
        print(off.summary().split("\n\n")[0])
        for h in handles:
            h.remove()
        off.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
