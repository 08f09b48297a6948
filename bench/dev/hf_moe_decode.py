#!/usr/bin/env python3
"""Greedy decoding through a transformers mixture of experts whose experts are fused (one 3D
tensor a projection: transformers 5's layout), offloaded by spillway.torch.offload: expert by
expert (the default) against the experts module moved whole (what offload() did before), with
the resident model as the reference. The model is built from a config with random weights (on
the GPU, then moved to host memory): --arch qwen3_moe (128 experts of 9 MiB a layer, 8 picked
a token) or mixtral (8 experts of 352 MiB, 2 picked).

Per variant (one process): ms a decoded token (median after --warm), MiB uploaded a token,
the median host time per acquire, the tokens against the resident model's (run with the eager
experts function, which offloaded fused experts run). "resident-default" runs the resident
model with its configured experts implementation (grouped_mm), for reference.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \\
        python3 bench/dev/hf_moe_decode.py [--arch qwen3_moe] [--layers 12] [--budget 4GiB]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import spillway.torch as spt
from spillway.torch._report import _median_us

ARCHS = {
    "qwen3_moe": dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      vocab_size=32000, max_position_embeddings=4096),
    "mixtral": dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                    num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096),
}


def build(arch: str, layers: int) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(arch, num_hidden_layers=layers, **ARCHS[arch])
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False).to("cpu")


def set_eager(model: torch.nn.Module, impl: str) -> str:
    """Set the experts implementation; returns the one before."""
    before = model.config._experts_implementation
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:
        model.config._experts_implementation = impl
    return before


def decode(model, ids: torch.Tensor, n: int, stats=None) -> tuple:
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        toks, times = [tok], []
        torch.cuda.synchronize()
        up0 = stats()["bytes_h2d"]["total"] if stats else 0
        for _ in range(n):
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            toks.append(tok)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        up = (stats()["bytes_h2d"]["total"] - up0) / n if stats else 0
    return torch.cat(toks, 1).cpu(), times, up


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="qwen3_moe", choices=sorted(ARCHS))
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--budget", default="4GiB")
    ap.add_argument("--variants", default="resident,resident-default,experts,whole")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--summary", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    model = build(a.arch, a.layers)
    default_impl = set_eager(model, "eager")
    gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    ids = torch.randint(0, 32000, (a.batch, a.prompt), generator=torch.Generator().manual_seed(1)).cuda()
    print(f"{a.arch}, {a.layers} layers, {gib:.2f} GiB bf16, budget {a.budget}, batch {a.batch}, "
          f"prompt {a.prompt}, {a.tokens} tokens; experts implementation by default {default_impl!r}")
    ref = None
    rows = []
    for v in a.variants.split(","):
        stats, off = None, None
        if v.startswith("resident"):
            if v == "resident-default":
                set_eager(model, default_impl)
            model.to("cuda")
            decode(model, ids, 2)  # cuBLAS and the allocator warmed, outside the timing
        else:
            off = spt.offload(model, budget=a.budget, experts="auto" if v == "experts" else "whole")
            stats = off.context.stats
        toks, times, up = decode(model, ids, a.tokens, stats)
        ms = statistics.median(times[a.warm:])
        row = dict(variant=v, ms_per_token=round(ms, 2), mib_up_per_token=round(up / 2**20, 1),
                   tokens_equal=None if ref is None else bool(torch.equal(toks, ref)))
        if v == "resident":
            ref = toks
        if off is not None:
            row["hooks_us"] = round(_median_us(off._hook_hist), 1)
            row["units"] = len(off.units)
            if a.summary:
                print(off.summary())
            off.remove()
        else:
            model.to("cpu")
            set_eager(model, "eager")
        torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(arch=a.arch, layers=a.layers, gib=gib, budget=a.budget, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
