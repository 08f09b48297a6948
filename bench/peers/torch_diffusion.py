"""Diffusion denoisers under a device budget: spillway.torch.offload against diffusers' group
offloading and accelerate's cpu_offload, on diffusers' own models built from their configs with
random weights (bf16), one denoiser step = one forward of the classifier-free-guidance batch.

diffusers is not in CI nor on the GPU machine's image: the benchmark imports it when it is
importable (put its src/ on PYTHONPATH) and says so when it is not.

For each model and budget, per variant: ms per steady step (median of the steps after the first
20), the first 20 steps' total, bytes uploaded per steady step, spillway's host time per acquire
and unit count, peak device memory (PyTorch's reserved plus spillway's held), whether the
output is bitwise equal to the resident model's, and how long offload() itself took (packing the
weights into pinned host memory). Variants: resident, spillway-POLICY (offload()
with that policy; offload() picks its device arena's mode), spillway-POLICY-segments and
spillway-POLICY-pages (the same with the mode asked: plain segments, vmm="off", one allocation a
unit; or pages of one mapped range, vmm="on"), group-leaf, group-block, accelerate. The physical bound of a step is
max(resident ms, (offloaded bytes - budget) / link), the link measured in the same run.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python:$DIFFUSERS/src \\
        python3 bench/peers/torch_diffusion.py --models sd15,sdxl,flux [--variants ...] [--smoke]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch

import spillway.torch as spt

GiB = 1 << 30
MiB = 1 << 20
DEV = torch.device("cuda")


# ---- models and their inputs (shapes of the published checkpoints; random weights) ----

def sd15(smoke: bool):
    from diffusers import UNet2DConditionModel
    cfg = dict(sample_size=64, cross_attention_dim=768, attention_head_dim=8, layers_per_block=2,
               block_out_channels=(320, 640, 1280, 1280))
    if smoke:
        cfg.update(block_out_channels=(32, 64, 64, 64), cross_attention_dim=32, attention_head_dim=4, layers_per_block=1)
    model = _build(UNet2DConditionModel, cfg)
    hw, ctx = (64, 768) if not smoke else (16, 32)

    def inputs():
        g = torch.Generator(device=DEV).manual_seed(0)
        return dict(sample=torch.randn(2, 4, hw, hw, device=DEV, generator=g, dtype=torch.bfloat16),
                    timestep=torch.tensor(500, device=DEV),
                    encoder_hidden_states=torch.randn(2, 77, ctx, device=DEV, generator=g, dtype=torch.bfloat16))
    return model, inputs


def sdxl(smoke: bool):
    from diffusers import UNet2DConditionModel
    cfg = dict(sample_size=128, block_out_channels=(320, 640, 1280), layers_per_block=2,
               down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
               up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
               transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20), cross_attention_dim=2048,
               addition_embed_type="text_time", addition_time_embed_dim=256,
               projection_class_embeddings_input_dim=2816, use_linear_projection=True)
    if smoke:
        cfg.update(block_out_channels=(32, 64, 64), transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4),
                   cross_attention_dim=64, projection_class_embeddings_input_dim=64 + 6 * 256)
    model = _build(UNet2DConditionModel, cfg)
    hw, ctx, pooled = (128, 2048, 1280) if not smoke else (16, 64, 64)

    def inputs():
        g = torch.Generator(device=DEV).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=DEV, generator=g, dtype=torch.bfloat16)  # noqa: E731
        return dict(sample=r(2, 4, hw, hw), timestep=torch.tensor(500, device=DEV), encoder_hidden_states=r(2, 77, ctx),
                    added_cond_kwargs={"text_embeds": r(2, pooled),
                                       "time_ids": torch.tensor([[1024., 1024., 0., 0., 1024., 1024.]] * 2,
                                                                device=DEV, dtype=torch.bfloat16)})
    return model, inputs


def flux(smoke: bool):
    from diffusers import FluxTransformer2DModel
    cfg = dict(guidance_embeds=True)
    if smoke:
        cfg.update(num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
                   joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    model = _build(FluxTransformer2DModel, cfg)
    n_img, n_txt = (4096, 512) if not smoke else (64, 16)
    jd, pd = (4096, 768) if not smoke else (32, 32)

    def inputs():
        g = torch.Generator(device=DEV).manual_seed(0)
        r = lambda *s: torch.randn(*s, device=DEV, generator=g, dtype=torch.bfloat16)  # noqa: E731
        return dict(hidden_states=r(1, n_img, 64), encoder_hidden_states=r(1, n_txt, jd), pooled_projections=r(1, pd),
                    timestep=torch.tensor([0.5], device=DEV, dtype=torch.bfloat16),
                    img_ids=torch.zeros(n_img, 3, device=DEV), txt_ids=torch.zeros(n_txt, 3, device=DEV),
                    guidance=torch.tensor([3.5], device=DEV, dtype=torch.bfloat16), return_dict=False)
    return model, inputs


MODELS = {"sd15": (sd15, "SD 1.5 UNet, 512x512, CFG batch 2"),
          "sdxl": (sdxl, "SDXL UNet, 1024x1024, CFG batch 2"),
          "flux": (flux, "Flux transformer, 1024x1024")}


def _build(cls, cfg):
    torch.manual_seed(0)
    with torch.device(DEV):  # random init on the device: fast
        model = cls(**cfg)
    return model.to(torch.bfloat16).eval().requires_grad_(False)


def _out(y):
    if isinstance(y, (tuple, list)):
        return y[0]
    return getattr(y, "sample", y)


def nbytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


def budget_bytes(spec: str, total: int) -> int:
    """A budget as the tools spell it: a fraction of the weights (with a point) or bytes."""
    return int(total * float(spec)) if "." in spec else int(spec)


def link_gbps() -> float:
    """Host-to-device copy rate of one 1 GiB pinned copy, best of 5."""
    src = torch.empty(GiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(GiB, dtype=torch.uint8, device=DEV)
    best = 1e9
    for _ in range(5):
        torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    del src, dst
    return GiB / best / 1e9


@contextlib.contextmanager
def unit_cap(cap: int) -> Iterator[None]:
    """While open, offload() partitions into units of at most cap bytes (0: its own bounds). An
    experiment on the unit size for bench/dev's tools, not a setting of the package."""
    from spillway.torch import _partition
    bounds = _partition.bounds
    if cap:
        _partition.bounds = lambda budget, streamed=0, segments=False: tuple(
            min(x, cap) for x in bounds(budget, streamed, segments))
    try:
        yield
    finally:
        _partition.bounds = bounds


@contextlib.contextmanager
def runs_grouped(grouped: bool) -> Iterator[None]:
    """While open and grouped, offload() partitions as before lists whose modules are not called
    back to back were told apart (_partition._scattered): their runs grouped like any others'.
    An A/B of that rule for bench/dev's tools, not a setting of the package."""
    from spillway.torch import _partition
    scattered = _partition._scattered
    if grouped:
        _partition._scattered = lambda cls: frozenset()
    try:
        yield
    finally:
        _partition._scattered = scattered


def timed_steps(fn: Callable[[], Any], steps: int) -> Tuple[List[float], Any]:
    times, out = [], None
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return times, out


def run_variant(key: str, name: str, budget_spec: str, steps: int, smoke: bool) -> Dict[str, Any]:
    """One variant in this process: build the model, take the resident output as the reference,
    then run the variant from host-resident weights."""
    build = MODELS[key][0]
    model, inputs = build(smoke)
    total = nbytes(model)
    budget = budget_bytes(budget_spec, total)
    if smoke:
        budget = max(total // 3, 64 * MiB)
    kw = inputs()
    with torch.no_grad():
        ref = _out(model(**kw)).clone()
    handle = None
    if name != "resident":
        model.to("cpu")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    if name.startswith("spillway"):
        # spillway-POLICY (the arena's mode as offload() picks it), or -segments / -pages: plain
        # segments (vmm="off"), one allocation a unit, or pages of one mapped range (vmm="on")
        opts = {"vmm": "off"} if name.endswith("-segments") else {"vmm": "on"} if name.endswith("-pages") else {}
        t = time.perf_counter()
        handle = spt.offload(model, budget=budget, policy=name.split("-")[1], **opts)
        setup_s = time.perf_counter() - t
    elif name.startswith("group"):
        level = "leaf_level" if name == "group-leaf" else "block_level"
        extra = {} if level == "leaf_level" else {"num_blocks_per_group": 1}
        model.enable_group_offload(DEV, offload_type=level, use_stream=True, **extra)
    elif name == "accelerate":
        from accelerate import cpu_offload
        cpu_offload(model, execution_device=DEV)
    with torch.no_grad():
        times, out = timed_steps(lambda: _out(model(**kw)), steps)
    first = times[:min(20, len(times))]
    steady = times[20:] if len(times) > 20 else times[len(times) // 2:]
    res: Dict[str, Any] = {"model": key, "variant": name, "budget": budget, "weights": total, "steps": steps,
                           "steady_ms": statistics.median(steady), "first20_ms": sum(first),
                           "first20_over_steady": sum(first) / (len(first) * statistics.median(steady)),
                           "first20_step_ms": [round(t, 1) for t in first],
                           "peak_reserved": torch.cuda.max_memory_reserved(), "equal": bool(torch.equal(out, ref))}
    res["peak_device"] = res["peak_reserved"]
    if handle is not None:
        st = handle.stats()
        res.update(setup_s=setup_s, units=len(handle.units), moved_per_step=st["bytes_h2d"]["total"] / max(handle.steps, 1),
                   hook_us_per_acquire=st["offload"]["hook_us_median"],
                   hook_us_mean=handle.hook_ns / max(handle.acquires, 1) / 1e3, held_peak=st["held"]["peak"],
                   peak_device=res["peak_reserved"] + st["held"]["peak"], plan_hits=st["plan_hits"]["total"],
                   summary=handle.summary().splitlines()[:7],
                   policy=next((ln.strip() for ln in handle.context.summary().splitlines()
                                if ln.strip().startswith("policy ")), ""))
    return res


PLAN = {  # model -> [(budget: fraction of the weights or bytes, variants)]
    "sd15": [("0.40", "resident,spillway-plan,spillway-lru,group-leaf,group-block,accelerate")],
    "sdxl": [("0.35", "resident,spillway-plan,spillway-lru,group-leaf,group-block,accelerate"),
             (str(8 * GiB), "spillway-plan")],
    "flux": [(str(8 * GiB), "resident,spillway-plan,spillway-plan-pages,group-leaf"),
             (str(12 * GiB), "spillway-plan,spillway-plan-pages")],
}


def require_diffusers(prog: str) -> None:
    """Exit with status 0 when diffusers is not importable (it is not on the GPU machine's
    image), saying how to bring it; else turn TF32 off, as the bitwise comparisons need."""
    try:
        import diffusers  # noqa: F401
    except ImportError as e:
        print(f"{prog}: diffusers is not importable ({e}); put its src/ on PYTHONPATH")
        sys.exit(0)
    torch.backends.cuda.matmul.allow_tf32 = False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="sd15,sdxl,flux")
    ap.add_argument("--variants", default="", help="only these variants (default: each model's plan)")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--slow-steps", type=int, default=4, help="steps for accelerate (far slower)")
    ap.add_argument("--smoke", action="store_true", help="tiny configs: check the script, time nothing")
    ap.add_argument("--per-step", action="store_true", help="print each of the first 20 steps' time")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # model:budget:variant, in a child process
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    require_diffusers("torch_diffusion")
    if args.one:
        key, budget, name = args.one.split(":")
        steps = args.slow_steps if name == "accelerate" else args.steps
        print("RESULT " + json.dumps(run_variant(key, name, budget, steps, args.smoke), default=str))
        return
    link = link_gbps()
    print(f"link (pinned host to device, 1 GiB): {link:.1f} GB/s; torch {torch.__version__}; one process a variant")
    results = []
    only = set(args.variants.split(",")) if args.variants else None
    for key in args.models.split(","):
        title = MODELS[key][1]
        resident_ms = None
        for budget, variants in PLAN[key]:
            header = False
            for v in variants.split(","):
                if only is not None and v not in only:
                    continue
                cmd = [sys.executable, __file__, "--one", f"{key}:{budget}:{v}", "--steps", str(args.steps),
                       "--slow-steps", str(args.slow_steps)] + (["--smoke"] if args.smoke else [])
                p = subprocess.run(cmd, capture_output=True, text=True)
                line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
                if p.returncode or not line:
                    print(f"{key} {v}: failed (rc {p.returncode}): {(p.stderr or p.stdout)[-600:]}")
                    continue
                r = json.loads(line[0][7:])
                total, b = r["weights"], r["budget"]
                if not header:
                    print(f"\n{title}: {total / GiB:.2f} GiB of weights, budget {b / GiB:.2f} GiB")
                    print(f"{'variant':14} {'ms/step':>8} {'x bound':>7} {'first 20':>9} {'x20 st.':>7} "
                          f"{'moved/step':>10} {'us/acq':>6} {'units':>5} {'peak dev':>8} equal")
                    header = True
                if v == "resident":
                    resident_ms = r["steady_ms"]
                bound = max(resident_ms, (total - b) / (link * 1e9) * 1e3) if resident_ms else None
                r.update(link_gbps=link, bound_ms=bound)
                results.append(r)
                fmt = lambda x, f: (f % x) if x is not None else "-"  # noqa: E731
                mv = r.get("moved_per_step")
                print(f"{v:14} {r['steady_ms']:8.1f} {fmt(bound and r['steady_ms'] / bound, '%7.2f'):>7} "
                      f"{r['first20_ms']:9.0f} {r['first20_over_steady']:7.2f} {fmt(mv and mv / GiB, '%8.2f G'):>10} "
                      f"{fmt(r.get('hook_us_per_acquire'), '%6.1f'):>6} {fmt(r.get('units'), '%5d'):>5} "
                      f"{r['peak_device'] / GiB:6.2f} G {r['equal']}", flush=True)
                if r.get("policy"):  # the pipeline plan's timing chose; offload()'s own time (packing, pinning)
                    print(f"{'':14} {r['policy']}; offload() took {r['setup_s']:.1f} s", flush=True)
                if args.per_step:
                    print(f"{'':14} first 20 steps, ms: {' '.join(f'{t:.0f}' for t in r['first20_step_ms'])}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
