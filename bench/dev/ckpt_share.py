#!/usr/bin/env python3
"""What recomputing some of the blocks costs and saves: bench/peers/torch_train.py's model
resident (AdamW fused on the device, bf16 autocast), with k of its decoder layers checkpointed
(torch.utils.checkpoint, use_reentrant=False, wrapped around each layer's forward), for each k
asked. Printed per k: ms a step (median of the steps after the warm-up), the peaks of torch's
allocated and reserved memory over the step, and the forward / backward / optimizer times.

    PYTHONPATH=$PWD/python python3 bench/dev/ckpt_share.py --model 1.1b --ks 0,8,12,16,22
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "peers"))
import torch_train as tt  # noqa: E402

GiB = 1 << 30


def by_hand(layer: torch.nn.Module, inner, *args, _kw=None, **kwargs):
    """layer's forward (inner) under torch.utils.checkpoint with the keywords _kw (default:
    non-reentrant) while training; as it is otherwise."""
    kw = _kw if _kw is not None else dict(use_reentrant=False)
    if not layer.training:
        return inner(*args, **kwargs)
    if kw.get("use_reentrant"):  # reentrant checkpoint takes positional arguments only
        names = ("attention_mask", "position_ids", "past_key_values", "use_cache", "cache_position",
                 "position_embeddings")
        extra = {k: v for k, v in kwargs.items() if k not in names}

        def run(hidden, mask, pos, pe):
            return inner(hidden, attention_mask=mask, position_ids=pos, position_embeddings=pe, **extra)
        return checkpoint(run, args[0] if args else kwargs["hidden_states"], kwargs.get("attention_mask"),
                          kwargs.get("position_ids"), kwargs.get("position_embeddings"), **kw)
    return checkpoint(inner, *args, **kw, **kwargs)


def resident(model: str, alloc=None):
    """torch_train.py's model `model` built on the device (inside use_allocator(budget=alloc) when
    given), with its decoder layers, their own forwards, AdamW fused and one batch of token ids."""
    dev = torch.device("cuda", 0)
    shape = tt.SHAPES[model]
    if alloc:
        import spillway.torch as spt
        spt.use_allocator(budget=alloc).__enter__()
    net, _, _ = tt.build(shape, dev, dev)
    layers = list(tt.decoder_layers(net))
    opt = tt.adamw([p for p in net.parameters() if p.requires_grad], "cuda")
    return net, layers, [layer.forward for layer in layers], opt, tt.batches(shape, 1)[0].to(dev)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.1b")
    ap.add_argument("--ks", default="0,8,12,16,22")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--where", default="first", choices=["first", "last"])
    ap.add_argument("--alloc", default=None, help="run under spillway.torch.use_allocator(budget=ALLOC)")
    args = ap.parse_args()
    model, layers, inner, opt, ids = resident(args.model, args.alloc)
    for k in (int(x) for x in args.ks.split(",")):
        chosen = set(range(k)) if args.where == "first" else set(range(len(layers) - k, len(layers)))
        for i, layer in enumerate(layers):
            layer.forward = functools.partial(by_hand, layer, inner[i]) if i in chosen else inner[i]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        times, phases = [], {"forward": [], "backward": [], "step": []}
        for step in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = tt.loss_of(model, ids)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            loss.backward()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            if step >= args.warmup:
                times.append((t3 - t0) * 1e3)
                for name, a, b in (("forward", t0, t1), ("backward", t1, t2), ("step", t2, t3)):
                    phases[name].append((b - a) * 1e3)
        ms = statistics.median(times)
        print(f"k={k:2d} of {len(layers)} ({args.where}): {ms:7.1f} ms a step; peak allocated "
              f"{torch.cuda.max_memory_allocated() / GiB:6.2f} GiB, reserved {torch.cuda.max_memory_reserved() / GiB:6.2f}; "
              + ", ".join(f"{n} {statistics.median(v):.1f}" for n, v in phases.items()), flush=True)


if __name__ == "__main__":
    main()
