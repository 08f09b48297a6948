#!/usr/bin/env python3
"""Where the device memory of one resident training step of bench/peers/torch_train.py's model
goes, and the least step time any placement of it under a budget allows without recomputing.

Printed: the parameters, gradients and optimizer state; the tensors autograd saves for backward
(distinct storages), of which autocast's low-precision copies of the weights; torch's peak
allocated in each phase (forward, backward, optimizer step); the phase times.

The bound: at the step's peak the device holds at most the budget, so X = peak - budget bytes
are elsewhere at that moment. Each of them left the device after its last use before the peak
and comes back before its next use after it, both within one step (optimizer state: used at the
step's end; activations: written in the forward, read in the backward), and the link carries
each way at most `link` bytes a second, so a step takes at least 2 X / link, whatever overlaps
with what. Only recomputing (checkpointing) lowers X.

    PYTHONPATH=$PWD/python python3 bench/dev/train_memory.py --model 1.1b --budgets 8GiB,18GiB
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "peers"))
import torch_train as tt  # noqa: E402
import torch_diffusion as td  # noqa: E402

GiB = 1 << 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.1b")
    ap.add_argument("--budgets", default="8GiB,18GiB")
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    dev = torch.device("cuda", 0)
    shape = tt.SHAPES[args.model]
    model, _, _ = tt.build(shape, dev, dev)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = tt.adamw(trained, "cuda")
    ids = tt.batches(shape, 1)[0].to(dev)
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    saved: dict = {}

    def pack(t: torch.Tensor):
        if t.device.type == "cuda" and not isinstance(t, torch.nn.Parameter):
            key = t.untyped_storage().data_ptr()
            cast = t.dtype == torch.bfloat16 and tuple(t.shape) in weight_shapes
            saved[key] = (t.untyped_storage().nbytes(), cast)
        return t

    phases = {"forward": [], "backward": [], "step": []}
    peaks = {}
    for step in range(args.steps):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = tt.loss_of(model, ids)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        after_fwd = torch.cuda.memory_allocated()
        peak_fwd = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        peak_bwd = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        opt.step()
        opt.zero_grad()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        peak_step = torch.cuda.max_memory_allocated()
        if step >= 2:
            phases["forward"].append((t1 - t0) * 1e3)
            phases["backward"].append((t2 - t1) * 1e3)
            phases["step"].append((t3 - t2) * 1e3)
        peaks = dict(base=base, after_forward=after_fwd, forward=peak_fwd, backward=peak_bwd, step=peak_step)
    p_bytes = sum(p.numel() * p.element_size() for p in trained)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))
    act = sum(n for n, _ in saved.values())
    casts = sum(n for n, c in saved.values() if c)
    times = {k: statistics.median(v) for k, v in phases.items()}
    total_ms = sum(times.values())
    link = td.link_gbps()
    peak = max(peaks["forward"], peaks["backward"], peaks["step"])
    print(f"{args.model}: trained parameters {p_bytes / GiB:.2f} GiB, gradients {p_bytes / GiB:.2f}, optimizer state "
          f"{state / GiB:.2f}; saved for backward {act / GiB:.2f} GiB in {len(saved)} storages, of which autocast's "
          f"weight copies {casts / GiB:.2f}")
    print("allocated GiB: " + ", ".join(f"{k} {v / GiB:.2f}" for k, v in peaks.items()) + f" (peak {peak / GiB:.2f}); "
          f"reserved peak {torch.cuda.max_memory_reserved() / GiB:.2f}")
    print("ms: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()) + f", total {total_ms:.1f}; link {link:.1f} GB/s")
    for b in args.budgets.split(","):
        budget = tt.parse_size(b)
        x = max(peak - budget, 0)
        floor = 2 * x / (link * 1e9) * 1e3
        print(f"budget {b}: {x / GiB:.2f} GiB off the device at the peak; a step >= 2 X / link = {floor:.1f} ms "
              f"= {floor / total_ms:.2f}x resident ({max(floor, total_ms) / total_ms:.2f}x with the compute)")


if __name__ == "__main__":
    main()
