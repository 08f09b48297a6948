"""Whole diffusion pipelines under one device budget, per image: text encoders, the denoiser's
steps and the VAE decode, with spillway.torch.offload of all of them in one context against
diffusers' model CPU offload and group offloading. diffusers' and transformers' own models built
from the published checkpoints' configs, random weights, bf16:

  sd15  SD 1.5 at a 2 GiB budget: CLIP text encoder (cond + uncond, one batch of 2), 20 DDIM
        steps of the UNet on the classifier-free-guidance batch (2x4x64x64), VAE decode to 512x512.
  flux  Flux at a 12 GiB budget: CLIP-L (pooled) and T5-XXL (512 tokens) encoders, 20
        flow-matching Euler steps of the transformer (4096 image tokens, guidance embedding),
        VAE decode to 1024x1024.

Variants, one process each (the parent spawns `--one pipeline:variant` children):
  resident           every component on the device: the reference
  spillway           spillway.torch.offload of the components under the budget, in one context
                     (of the VAE, the modules decode() calls: see spillway_modules)
  model-cpu-offload  diffusers' enable_model_cpu_offload on the diffusers pipeline object; only
                     where the largest component fits the budget
  group-leaf         diffusers' group offloading of every component, leaf level, with a stream
  group-block        likewise at block level, one block a group

For each: ms per image (median of --images after one untimed warm-up image), bytes copied to the
device per image and the host time per acquire (spillway), peak device memory (PyTorch's
reserved plus spillway's held), and whether the final latents and the decoded image are bitwise
equal to the resident pipeline's, computed in the same process before anything is offloaded.

diffusers and transformers are not in CI: the benchmark says so and exits when either is not
importable (put diffusers' src/ on PYTHONPATH).

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python:$DIFFUSERS/src \\
        python3 bench/peers/torch_pipeline.py [--pipelines sd15,flux] [--variants ...] [--images 3]
        [--steps 20] [--smoke] [--json FILE]
"""
from __future__ import annotations

import abc
import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

import spillway.torch as spt
import torch_diffusion as td  # same directory: the denoisers' configs, _build, nbytes, link_gbps

DEV, GiB, MiB = td.DEV, td.GiB, td.MiB
SHAPE_KEYS = ("pipeline", "budget", "weights", "components", "images", "steps")  # a row's fields besides timings
VARIANTS = ("resident", "spillway", "model-cpu-offload", "group-leaf", "group-block")
CLIP_VOCAB, T5_VOCAB = 49408, 32128
# SD 1.5's published scheduler config. diffusers' defaults (steps_offset 0, clip_sample True) would
# be rewritten by StableDiffusionPipeline's constructor, in the model-cpu-offload variant only,
# and its latents would then differ from the reference's.
SD15_SCHEDULER = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
                      set_alpha_to_one=False, steps_offset=1)


# ---- components (shapes of the published checkpoints; random weights) ----

def clip_text(smoke: bool) -> nn.Module:
    from transformers import CLIPTextConfig, CLIPTextModel
    cfg = dict(vocab_size=CLIP_VOCAB, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
               num_attention_heads=12, max_position_embeddings=77)
    if smoke:  # hidden 32: the smoke denoisers' cross-attention and pooled widths
        cfg.update(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2)
    return td._build(CLIPTextModel, {"config": CLIPTextConfig(**cfg)})


def t5_xxl(smoke: bool) -> nn.Module:
    from transformers import T5Config, T5EncoderModel
    cfg = dict(vocab_size=T5_VOCAB, d_model=4096, d_ff=10240, num_layers=24, num_heads=64, d_kv=64,
               feed_forward_proj="gated-gelu")
    if smoke:
        cfg.update(d_model=32, d_ff=64, num_layers=2, num_heads=2, d_kv=16)
    return td._build(T5EncoderModel, {"config": T5Config(**cfg)})


def autoencoder_kl(smoke: bool, **extra: Any) -> nn.Module:
    """AutoencoderKL of SD's shape (four blocks: 8x down); extra: Flux's latent channels and factors."""
    from diffusers import AutoencoderKL
    cfg = dict(block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
               up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, latent_channels=4, sample_size=512)
    cfg.update(extra)
    if smoke:  # four blocks still, so the latents are 8x smaller than the image as in the real shape
        cfg.update(block_out_channels=(32,) * 4, layers_per_block=1)
    return td._build(AutoencoderKL, cfg)


class Pipeline(abc.ABC):
    """One pipeline's components, in the order an image runs them, and one image."""
    title = ""
    budget = 0
    denoiser = ""  # the component the steps run: its host time per acquire goes into the table
    components: Dict[str, nn.Module]  # set by each pipeline
    vae: Any

    def __init__(self, steps: int) -> None:
        self.steps = steps

    @abc.abstractmethod
    def image(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """Encode the prompt, run the steps, decode: (final latents, decoded image)."""

    @abc.abstractmethod
    def diffusers_pipeline(self) -> Any:
        """The diffusers pipeline object over these components (no tokenizers: image() passes ids)."""

    def spillway_modules(self) -> Dict[str, nn.Module]:
        """The components as offload() is given them: all of them, the VAE whole (offload splits
        a module's top level, so decode(), which is not the VAE's forward, reaches hooked
        children)."""
        return dict(self.components)


class SD15(Pipeline):
    title = "SD 1.5, 512x512, CFG batch 2"
    budget = 2 * GiB
    denoiser = "unet"
    guidance = 7.5

    def __init__(self, steps: int, smoke: bool) -> None:
        from diffusers import DDIMScheduler
        super().__init__(steps)
        self.text_encoder = clip_text(smoke)
        self.unet = td.sd15(smoke)[0]
        self.vae = autoencoder_kl(smoke)
        self.components = {"text_encoder": self.text_encoder, "unet": self.unet, "vae": self.vae}
        self.scheduler = DDIMScheduler(**SD15_SCHEDULER)
        hw = 16 if smoke else 64  # the latents torch_diffusion.sd15 steps on
        g = torch.Generator(device=DEV).manual_seed(0)
        self.ids = torch.randint(0, CLIP_VOCAB, (2, 77), device=DEV, generator=g)  # uncond, cond
        self.noise = torch.randn(1, 4, hw, hw, device=DEV, generator=g, dtype=torch.bfloat16)

    def image(self) -> Tuple[torch.Tensor, torch.Tensor]:
        emb = self.text_encoder(self.ids).last_hidden_state
        sched = self.scheduler
        sched.set_timesteps(self.steps, device=DEV)
        latents = self.noise * sched.init_noise_sigma
        for t in sched.timesteps:
            x = sched.scale_model_input(torch.cat([latents] * 2), t)
            uncond, cond = self.unet(x, t, encoder_hidden_states=emb, return_dict=False)[0].chunk(2)
            latents = sched.step(uncond + self.guidance * (cond - uncond), t, latents, return_dict=False)[0]
        return latents, self.vae.decode(latents / self.vae.config.scaling_factor, return_dict=False)[0]

    def diffusers_pipeline(self) -> Any:
        from diffusers import StableDiffusionPipeline
        return StableDiffusionPipeline(vae=self.vae, text_encoder=self.text_encoder, tokenizer=None, unet=self.unet,
                                       scheduler=self.scheduler, safety_checker=None, feature_extractor=None,
                                       requires_safety_checker=False)


class Flux(Pipeline):
    title = "Flux, 1024x1024"
    budget = 12 * GiB
    denoiser = "transformer"

    def __init__(self, steps: int, smoke: bool) -> None:
        from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline
        super().__init__(steps)
        self.text_encoder = clip_text(smoke)
        self.text_encoder_2 = t5_xxl(smoke)
        self.transformer = td.flux(smoke)[0]
        self.vae = autoencoder_kl(smoke, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False,
                       scaling_factor=0.3611, shift_factor=0.1159, sample_size=1024)
        self.components = {"text_encoder": self.text_encoder, "text_encoder_2": self.text_encoder_2,
                           "transformer": self.transformer, "vae": self.vae}
        self.scheduler = FlowMatchEulerDiscreteScheduler()
        self.unpack = FluxPipeline._unpack_latents
        # 4096 packed tokens at 1024x1024 (64 in the smoke run), as torch_diffusion.flux's inputs
        self.size = 128 if smoke else 1024
        self.scale = 2 ** (len(self.vae.config.block_out_channels) - 1)
        n_txt = 16 if smoke else 512
        lat = self.size // self.scale
        g = torch.Generator(device=DEV).manual_seed(0)
        self.clip_ids = torch.randint(0, CLIP_VOCAB, (1, 77), device=DEV, generator=g)
        self.t5_ids = torch.randint(0, T5_VOCAB, (1, n_txt), device=DEV, generator=g)
        noise = torch.randn(1, 16, lat, lat, device=DEV, generator=g, dtype=torch.bfloat16)
        self.noise = FluxPipeline._pack_latents(noise, 1, 16, lat, lat)
        self.img_ids = FluxPipeline._prepare_latent_image_ids(1, lat // 2, lat // 2, DEV, torch.bfloat16)
        self.txt_ids = torch.zeros(n_txt, 3, device=DEV, dtype=torch.bfloat16)
        self.guidance = torch.full([1], 3.5, device=DEV, dtype=torch.float32)

    def image(self) -> Tuple[torch.Tensor, torch.Tensor]:
        pooled = self.text_encoder(self.clip_ids).pooler_output
        emb = self.text_encoder_2(self.t5_ids).last_hidden_state
        sched = self.scheduler
        sched.set_timesteps(self.steps, device=DEV)
        sched.set_begin_index(0)  # as FluxPipeline: the step index without a device-to-host read
        latents = self.noise
        for t in sched.timesteps:
            v = self.transformer(hidden_states=latents, timestep=t.expand(1).to(latents.dtype) / 1000,
                                 guidance=self.guidance, pooled_projections=pooled, encoder_hidden_states=emb,
                                 txt_ids=self.txt_ids, img_ids=self.img_ids, return_dict=False)[0]
            latents = sched.step(v, t, latents, return_dict=False)[0]
        z = self.unpack(latents, self.size, self.size, self.scale)
        z = z / self.vae.config.scaling_factor + self.vae.config.shift_factor
        return latents, self.vae.decode(z, return_dict=False)[0]

    def diffusers_pipeline(self) -> Any:
        from diffusers import FluxPipeline
        return FluxPipeline(scheduler=self.scheduler, vae=self.vae, text_encoder=self.text_encoder, tokenizer=None,
                            text_encoder_2=self.text_encoder_2, tokenizer_2=None, transformer=self.transformer)


PIPELINES = {"sd15": SD15, "flux": Flux}


# ---- one variant, in a child process ----

def group_offload(pipe: Pipeline, level: str) -> None:
    """diffusers' group offloading of every component, as DiffusionPipeline.enable_group_offload
    applies it: ModelMixin's method for diffusers' models, apply_group_offloading for the others."""
    from diffusers.hooks import apply_group_offloading
    kw: Dict[str, Any] = dict(onload_device=DEV, offload_type=level, use_stream=True)
    if level == "block_level":
        kw["num_blocks_per_group"] = 1
    for m in pipe.components.values():
        if hasattr(m, "enable_group_offload"):
            m.enable_group_offload(**kw)
        else:
            apply_group_offloading(m, **kw)


def does_not_fit(sizes: Dict[str, int], budget: int) -> Optional[str]:
    """Why model CPU offload cannot run under the budget (it holds a whole component), or None."""
    largest = max(sizes, key=sizes.__getitem__)
    if sizes[largest] <= budget:
        return None
    return f"does not fit: {largest} is {sizes[largest] / GiB:.2f} GiB, the budget {budget / GiB:.2f} GiB"


def run_variant(key: str, variant: str, images: int, steps: int, smoke: bool) -> Dict[str, Any]:
    """Build the pipeline (same seeds, same order in every process), take the resident image as
    the reference, then time the variant's images from host-resident weights."""
    pipe = PIPELINES[key](steps, smoke)
    sizes = {n: td.nbytes(m) for n, m in pipe.components.items()}
    total = sum(sizes.values())
    budget = max(total // 3, 64 * MiB) if smoke else pipe.budget  # smoke: torch_diffusion's floor
    res: Dict[str, Any] = {"pipeline": key, "variant": variant, "budget": budget, "weights": total,
                           "components": sizes, "images": images, "steps": steps}
    why = does_not_fit(sizes, budget) if variant == "model-cpu-offload" else None
    if why:
        res["skipped"] = why
        return res
    with torch.no_grad():
        ref = [t.cpu() for t in pipe.image()]
    if variant != "resident":
        for m in pipe.components.values():
            m.to("cpu")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    handle: Optional[spt.Offloads] = None
    after_image: Callable[[], None] = lambda: None  # noqa: E731
    if variant == "spillway":
        handle = spt.offload(pipe.spillway_modules(), budget=budget)
    elif variant == "model-cpu-offload":
        dp = pipe.diffusers_pipeline()
        dp.enable_model_cpu_offload(device=DEV)
        after_image = dp.maybe_free_model_hooks  # what pipe(...) does at the end of each image
    elif variant.startswith("group-"):
        group_offload(pipe, "leaf_level" if variant == "group-leaf" else "block_level")

    def one() -> Tuple[float, torch.Tensor, torch.Tensor]:
        torch.cuda.synchronize()
        t = time.perf_counter()
        latents, image = pipe.image()
        after_image()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e3, latents, image

    with torch.no_grad():
        warmup_ms = one()[0]  # untimed: the plan learns, group offloading records its order
        moved0 = handle.context.stats()["bytes_h2d"]["total"] if handle is not None else 0
        times: List[float] = []
        eq_latents = eq_image = True
        for _ in range(images):
            ms, latents, image = one()
            times.append(ms)
            eq_latents &= torch.equal(latents.cpu(), ref[0])
            eq_image &= torch.equal(image.cpu(), ref[1])
    res.update(ms_per_image=statistics.median(times), times_ms=times, warmup_ms=warmup_ms,
               peak_reserved=torch.cuda.max_memory_reserved(), equal_latents=eq_latents, equal_image=eq_image)
    res["peak_device"] = res["peak_reserved"]
    if handle is not None:
        st = handle.context.stats()
        mods = {n: {"units": len(o.units), "hook_us_median": o.hook_stats()["hook_us_median"], "steps": o.steps}
                for n, o in zip(handle.names, handle.offloads)}
        res.update(moved_per_image=(st["bytes_h2d"]["total"] - moved0) / images, held_peak=st["held"]["peak"],
                   peak_device=res["peak_reserved"] + st["held"]["peak"], modules=mods,
                   hook_us_per_acquire=mods[pipe.denoiser]["hook_us_median"],
                   summary=handle.summary().splitlines()[:1 + len(handle.offloads)])
    return res


# ---- the parent: one child per variant, one table per pipeline ----

def run_child(key: str, variant: str, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    cmd = [sys.executable, __file__, "--one", f"{key}:{variant}", "--images", str(args.images),
           "--steps", str(args.steps)] + (["--smoke"] if args.smoke else [])
    p = subprocess.run(cmd, capture_output=True, text=True)
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if p.returncode or not line:
        print(f"{variant:18} failed (rc {p.returncode}): {(p.stderr or p.stdout)[-800:]}", flush=True)
        return None
    return json.loads(line[0][len("RESULT "):])


def print_header(r: Dict[str, Any]) -> None:
    parts = ", ".join(f"{n} {b / GiB:.2f}" for n, b in r["components"].items())
    print(f"\n{PIPELINES[r['pipeline']].title}, {r['steps']} steps: {r['weights'] / GiB:.2f} GiB of weights "
          f"({parts} GiB), budget {r['budget'] / GiB:.2f} GiB, median of {r['images']} images")
    print(f"{'variant':18} {'ms/image':>9} {'x res.':>6} {'moved/image':>11} {'us/acq':>6} {'peak dev':>8}  "
          "equal (latents, image)")


def print_row(r: Dict[str, Any], resident_ms: Optional[float]) -> None:
    if "skipped" in r:
        print(f"{r['variant']:18} {r['skipped']}", flush=True)
        return
    fmt = lambda x, f: (f % x) if x is not None else "-"  # noqa: E731
    mv = r.get("moved_per_image")
    x_res = resident_ms and r["ms_per_image"] / resident_ms
    print(f"{r['variant']:18} {r['ms_per_image']:9.1f} {fmt(x_res, '%6.2f'):>6} "
          f"{fmt(mv and mv / GiB, '%9.2f G'):>11} {fmt(r.get('hook_us_per_acquire'), '%6.1f'):>6} "
          f"{r['peak_device'] / GiB:6.2f} G  {r['equal_latents']} {r['equal_image']}", flush=True)
    if "modules" in r:
        print("  " + ", ".join(f"{n}: {m['units']} units, {m['hook_us_median']:.1f} us"
                               for n, m in r["modules"].items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipelines", default="sd15,flux")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--images", type=int, default=3, help="timed images, after one warm-up image")
    ap.add_argument("--steps", type=int, default=20, help="denoiser steps per image")
    ap.add_argument("--smoke", action="store_true", help="tiny configs: check the script, time nothing")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # pipeline:variant, in a child process
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    for name, given, known in (("pipeline", args.pipelines, PIPELINES), ("variant", args.variants, VARIANTS)):
        unknown = set(given.split(",")) - set(known)
        if unknown:
            ap.error(f"unknown {name}s {', '.join(sorted(unknown))} (known: {', '.join(known)})")
    try:
        import diffusers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"torch_pipeline: diffusers or transformers is not importable ({e}); "
              "put diffusers' src/ on PYTHONPATH")
        sys.exit(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.one:
        key, variant = args.one.split(":")
        print("RESULT " + json.dumps(run_variant(key, variant, args.images, args.steps, args.smoke), default=str))
        return
    variants = [v for v in VARIANTS if v in args.variants.split(",")]  # resident first: "x res." needs it
    link = td.link_gbps()
    torch.cuda.empty_cache()  # the children get the device; this process keeps only its context
    print(f"link (pinned host to device, 1 GiB): {link:.1f} GB/s; torch {torch.__version__}, "
          f"diffusers {diffusers.__version__}, transformers {transformers.__version__}; one process a variant")
    results: List[Dict[str, Any]] = []
    for key in args.pipelines.split(","):
        resident_ms = None
        header = False
        for v in variants:
            prev = next((x for x in reversed(results) if x["pipeline"] == key), None)
            why = does_not_fit(prev["components"], prev["budget"]) if prev and v == "model-cpu-offload" else None
            if prev and why:  # the sizes are known from an earlier child: no build just to find this
                r: Optional[Dict[str, Any]] = dict({k: prev[k] for k in SHAPE_KEYS}, variant=v, skipped=why)
            else:
                r = run_child(key, v, args)
            if r is None:
                continue
            if not header:
                print_header(r)
                header = True
            if v == "resident":
                resident_ms = r["ms_per_image"]
            r["link_gbps"] = link
            results.append(r)
            print_row(r, resident_ms)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()
