#!/usr/bin/env python3
"""spillway.torch.offload on diffusers models whose forward reaches the weights by other roads
than a module's own call, on the GPU machine (diffusers on PYTHONPATH): each output compared
bitwise with the same model resident, the bytes uploaded per call, host time per acquire.

- oobleck: Stable Audio's VAE (AutoencoderOobleck, default config, fp32): its convolutions are
  weight-normed by torch's weight_norm, whose forward pre-hook computes `weight` from
  `weight_g` and `weight_v`. decode() of a latent of --frames frames under --budget (fraction
  of its weights); also that no computed weight is left on the device after the call.
- flux-fp8: Flux's transformer with diffusers' enable_layerwise_casting (float8_e4m3fn storage,
  bf16 compute), offloaded at 8 GiB: the casting's `.to(dtype=)` around each leaf's forward
  replaces the device tensors' data, which the offload points back (view repair). Half the
  bytes of the bf16 model cross the link; ms per step against the bf16 offload of the same run.
- gguf: a stack of diffusers' GGUFLinear layers holding Q8_0 GGUFParameters (only where the
  gguf package is importable): the forward reads the weights' quant_type.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python:$PWD/.peers/diffusers/src \\
        python3 bench/dev/diffusers_shapes.py --cases oobleck,flux-fp8,gguf
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any, Callable, Dict

import torch

import spillway.torch as spt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "peers"))
import torch_diffusion as td  # noqa: E402  (its models, timing and byte count)

GiB = 1 << 30
MiB = 1 << 20
DEV = torch.device("cuda")


def offloaded_run(model: torch.nn.Module, fn: Callable[[], torch.Tensor], budget: int, calls: int,
                  **options: Any) -> Dict[str, Any]:
    """offload(model) from host-resident weights, fn() `calls` times; the last output and figures."""
    model.to("cpu")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    off = spt.offload(model, budget=budget, **options)
    with torch.no_grad():
        times, out = td.timed_steps(fn, calls)
    st = off.stats()
    res = {"out": out, "ms": statistics.median(times[calls // 2:]), "first_ms": times[0],
           "moved": st["bytes_h2d"]["total"] / calls, "hook_us": st["offload"]["hook_us_median"],
           "units": len(off.units), "summary": off.summary().splitlines()[:8], "off": off}
    return res


def report(name: str, total: int, budget: int, ref: torch.Tensor, r: Dict[str, Any], extra: str = "") -> bool:
    equal = bool(torch.equal(r["out"], ref))
    print(f"{name}: weights {total / GiB:.2f} GiB, budget {budget / GiB:.2f} GiB, {r['units']} units; "
          f"{r['ms']:.1f} ms a call (first {r['first_ms']:.0f}), moved {r['moved'] / GiB:.2f} GiB a call, "
          f"hooks {r['hook_us']:.1f} us; bitwise equal: {equal}{extra}")
    for line in r["summary"]:
        print("    " + line)
    return equal


def oobleck(args: argparse.Namespace) -> bool:
    from diffusers import AutoencoderOobleck
    torch.manual_seed(0)
    with torch.device(DEV):
        vae = AutoencoderOobleck()
    vae = vae.eval().requires_grad_(False)
    total = td.nbytes(vae)
    g = torch.Generator(device=DEV).manual_seed(0)
    z = torch.randn(1, vae.config.decoder_input_channels, args.frames, device=DEV, generator=g)
    fn = lambda: vae.decode(z).sample  # noqa: E731
    with torch.no_grad():
        ref = fn().clone()
    budget = int(total * args.budget)
    r = offloaded_run(vae, fn, budget, args.calls)
    normed = [m for m in vae.modules() if hasattr(m, "weight_g")]
    left = sum(m.weight.device.type == "cuda" for m in normed)
    ok = report("oobleck decode", total, budget, ref, r,
                f"; {len(normed)} weight-normed modules, computed weights left on the device: {left}")
    r["off"].remove()
    return ok and left == 0


def flux_fp8(args: argparse.Namespace) -> bool:
    ok = True
    ms = {}
    for storage in (None, torch.float8_e4m3fn):
        model, inputs = td.flux(False)
        if storage is not None:
            model.enable_layerwise_casting(storage_dtype=storage, compute_dtype=torch.bfloat16)
        total = td.nbytes(model)
        kw = inputs()
        fn = lambda: td._out(model(**kw))  # noqa: E731
        with torch.no_grad():
            ref = fn().clone()
        r = offloaded_run(model, fn, 8 * GiB, args.steps)
        name = "flux bf16" if storage is None else "flux fp8 storage"
        ok &= report(name, total, 8 * GiB, ref, r, f"; view repairs {r['off'].view_repairs}")
        ms[name] = r["ms"]
        r["off"].remove()
        del model, r, ref
        torch.cuda.empty_cache()
    print(f"flux: fp8 storage / bf16 step time {ms['flux fp8 storage'] / ms['flux bf16']:.3f}")
    return ok


def gguf_stack(args: argparse.Namespace) -> bool:
    try:
        import gguf
    except ImportError as e:
        print(f"gguf: not importable ({e}); skipped")
        return True
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter
    torch.manual_seed(0)
    n, depth = 4096, 16
    layers = []
    for _ in range(depth):
        lin = GGUFLinear(n, n, bias=False, compute_dtype=torch.bfloat16)
        w = (torch.randn(n, n) / 64).numpy()
        q = gguf.quantize(w, gguf.GGMLQuantizationType.Q8_0)
        lin.weight = GGUFParameter(torch.from_numpy(q).to(DEV), quant_type=gguf.GGMLQuantizationType.Q8_0)
        layers.append(lin)
    model = torch.nn.Sequential(*layers).requires_grad_(False)
    total = td.nbytes(model)
    x = torch.randn(8, n, device=DEV, dtype=torch.bfloat16)
    fn = lambda: model(x)  # noqa: E731
    with torch.no_grad():
        ref = fn().clone()
    budget = total // 3
    r = offloaded_run(model, fn, budget, args.calls)
    ok = report("gguf Q8_0 stack", total, budget, ref, r)
    r["off"].remove()
    return ok


CASES = {"oobleck": oobleck, "flux-fp8": flux_fp8, "gguf": gguf_stack}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="oobleck,flux-fp8,gguf")
    ap.add_argument("--budget", type=float, default=0.3, help="oobleck: budget as a fraction of its weights")
    ap.add_argument("--frames", type=int, default=256, help="oobleck: latent frames (2048 samples each)")
    ap.add_argument("--calls", type=int, default=6)
    ap.add_argument("--steps", type=int, default=12, help="flux: steps per variant")
    args = ap.parse_args()
    td.require_diffusers("diffusers_shapes")
    failed = [c for c in args.cases.split(",") if not CASES[c](args)]
    print("all equal" if not failed else f"NOT EQUAL: {', '.join(failed)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
