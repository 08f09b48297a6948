#!/usr/bin/env python3
"""diffusers' own model classes offloaded on emu, on this machine's CPU torch: each built from a
small config of its published architecture (random weights, fp32), offloaded at --fraction of
its bytes, called --steps times; every output (with --grad: the gradient of the input through
the offloaded model) compared bitwise with a resident twin called in lockstep, the bytes
uploaded per call checked against what must move, and remove() checked to give the resident
model back. --layerwise and --first-block-cache enable diffusers' own hooks on both twins
before offload(), as a user would.
The shapes the GPU benchmarks time are three of these; this runs the rest of the zoo
(DiTs with two block lists, video transformers, audio VAEs, ControlNet) where no GPU is needed.

diffusers is not on Debian: bring its source with the search tool's fetch and keep it
uncommitted (.peers/ is ignored); bench/dev/diffusers_on_cpu.py stands in for what Debian lacks.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python:$PWD/.peers/diffusers/src \\
        /usr/bin/python3 bench/dev/diffusers_zoo.py [--grad] [--vmm on|off] [NAME ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import Callable, Dict, Iterator, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import diffusers_on_cpu  # noqa: E402

diffusers_on_cpu.install()

import torch  # noqa: E402

import spillway.torch as spt  # noqa: E402

MiB = 1 << 20


def r(*shape, g: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def cases() -> Iterator[Tuple[str, Callable, Callable]]:
    import diffusers as D
    yield "sd15-unet", lambda: D.UNet2DConditionModel(sample_size=16, block_out_channels=(128, 256, 256, 256), cross_attention_dim=64,
                                                    attention_head_dim=8, layers_per_block=1), \
        lambda g: dict(sample=r(2, 4, 16, 16, g=g), timestep=torch.tensor(500), encoder_hidden_states=r(2, 7, 64, g=g))
    yield "sdxl-unet", lambda: D.UNet2DConditionModel(sample_size=16, block_out_channels=(64, 128, 256), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), transformer_layers_per_block=(1, 1, 2),
            attention_head_dim=(2, 4, 8), cross_attention_dim=64, addition_embed_type="text_time", addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=64 + 6 * 256, use_linear_projection=True), \
        lambda g: dict(sample=r(2, 4, 16, 16, g=g), timestep=torch.tensor(500), encoder_hidden_states=r(2, 7, 64, g=g),
                       added_cond_kwargs={"text_embeds": r(2, 64, g=g), "time_ids": torch.tensor([[64., 64, 0, 0, 64, 64]] * 2)})
    yield "flux", lambda: D.FluxTransformer2DModel(num_layers=2, num_single_layers=3, attention_head_dim=64, num_attention_heads=4,
                                                  joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(16, 24, 24),
                                                  guidance_embeds=True), \
        lambda g: dict(hidden_states=r(1, 64, 64, g=g), encoder_hidden_states=r(1, 16, 32, g=g), pooled_projections=r(1, 32, g=g),
                       timestep=torch.tensor([0.5]), img_ids=torch.zeros(64, 3), txt_ids=torch.zeros(16, 3),
                       guidance=torch.tensor([3.5]), return_dict=False)
    yield "sd3", lambda: D.SD3Transformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=64,
                                                num_attention_heads=4, joint_attention_dim=32, caption_projection_dim=256,
                                                pooled_projection_dim=32, out_channels=4, pos_embed_max_size=32,
                                                dual_attention_layers=(0,), qk_norm="rms_norm"), \
        lambda g: dict(hidden_states=r(1, 4, 16, 16, g=g), encoder_hidden_states=r(1, 9, 32, g=g), pooled_projections=r(1, 32, g=g),
                       timestep=torch.tensor([500]), return_dict=False)
    yield "pixart", lambda: D.PixArtTransformer2DModel(num_attention_heads=4, attention_head_dim=64, in_channels=4, out_channels=8,
                                                      num_layers=3, cross_attention_dim=256, sample_size=16, patch_size=2,
                                                      caption_channels=32, norm_num_groups=32), \
        lambda g: dict(hidden_states=r(1, 4, 16, 16, g=g), encoder_hidden_states=r(1, 9, 32, g=g), timestep=torch.tensor([500]),
                       added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False)
    yield "wan", lambda: D.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=4, attention_head_dim=64, in_channels=4,
                                                out_channels=4, text_dim=32, freq_dim=256, ffn_dim=1024, num_layers=3,
                                                rope_max_seq_len=64), \
        lambda g: dict(hidden_states=r(1, 4, 3, 8, 8, g=g), timestep=torch.tensor([500]), encoder_hidden_states=r(1, 9, 32, g=g),
                       return_dict=False)
    yield "ltx", lambda: D.LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=4, attention_head_dim=64,
                                                     cross_attention_dim=64, num_layers=3, caption_channels=32), \
        lambda g: dict(hidden_states=r(1, 2 * 4 * 4, 8, g=g), encoder_hidden_states=r(1, 9, 32, g=g), timestep=torch.tensor([500]),
                       encoder_attention_mask=torch.ones(1, 9), num_frames=2, height=4, width=4, return_dict=False)
    yield "sana", lambda: D.SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=64,
                                                  num_layers=3, num_cross_attention_heads=4, cross_attention_head_dim=64,
                                                  cross_attention_dim=256, caption_channels=32, sample_size=16), \
        lambda g: dict(hidden_states=r(1, 4, 16, 16, g=g), encoder_hidden_states=r(1, 9, 32, g=g), timestep=torch.tensor([500]),
                       return_dict=False)
    yield "hunyuanvideo", lambda: D.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=4,
            attention_head_dim=64, num_layers=2, num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1,
            text_embed_dim=32, pooled_projection_dim=32, rope_axes_dim=(16, 24, 24)), \
        lambda g: dict(hidden_states=r(1, 4, 2, 8, 8, g=g), timestep=torch.tensor([500]), encoder_hidden_states=r(1, 9, 32, g=g),
                       encoder_attention_mask=torch.ones(1, 9), pooled_projections=r(1, 32, g=g), guidance=torch.tensor([3500.]),
                       return_dict=False)
    yield "auraflow", lambda: D.AuraFlowTransformer2DModel(sample_size=16, patch_size=2, in_channels=4, num_mmdit_layers=2,
            num_single_dit_layers=2, attention_head_dim=64, num_attention_heads=4, joint_attention_dim=32,
            caption_projection_dim=256, out_channels=4, pos_embed_max_size=64), \
        lambda g: dict(hidden_states=r(1, 4, 16, 16, g=g), encoder_hidden_states=r(1, 9, 32, g=g), timestep=torch.tensor([500]),
                       return_dict=False)
    yield "chroma", lambda: D.ChromaTransformer2DModel(num_layers=2, num_single_layers=2, attention_head_dim=64,
            num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(16, 24, 24), approximator_hidden_dim=64,
            approximator_layers=2, in_channels=16), \
        lambda g: dict(hidden_states=r(1, 64, 16, g=g), encoder_hidden_states=r(1, 9, 32, g=g), timestep=torch.tensor([0.5]),
                       img_ids=torch.zeros(64, 3), txt_ids=torch.zeros(9, 3), return_dict=False)
    yield "qwenimage", lambda: D.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=3,
            attention_head_dim=64, num_attention_heads=4, joint_attention_dim=32, axes_dims_rope=(16, 24, 24)), \
        lambda g: dict(hidden_states=r(1, 64, 16, g=g), encoder_hidden_states=r(1, 9, 32, g=g),
                       encoder_hidden_states_mask=torch.ones(1, 9), timestep=torch.tensor([0.5]), img_shapes=[(1, 8, 8)],
                       return_dict=False)
    yield "cogvideox", lambda: D.CogVideoXTransformer3DModel(num_attention_heads=4, attention_head_dim=64, in_channels=4,
            out_channels=4, time_embed_dim=32, text_embed_dim=32, num_layers=3, sample_width=8, sample_height=8,
            sample_frames=5, patch_size=2, max_text_seq_length=9), \
        lambda g: dict(hidden_states=r(1, 2, 4, 8, 8, g=g), encoder_hidden_states=r(1, 9, 32, g=g), timestep=torch.tensor([500]),
                       return_dict=False)
    yield "vae-kl", lambda: D.AutoencoderKL(block_out_channels=(128, 256), down_block_types=("DownEncoderBlock2D",) * 2,
                                           up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, layers_per_block=1), \
        lambda g: dict(sample=r(1, 3, 32, 32, g=g), return_dict=False)
    yield "oobleck", lambda: D.AutoencoderOobleck(encoder_hidden_size=128, downsampling_ratios=[2, 4, 4], channel_multiples=[1, 2, 4],
                                                 decoder_channels=128, decoder_input_channels=64, audio_channels=2), \
        lambda g: dict(sample=r(1, 2, 256, g=g), return_dict=False)
    yield "controlnet", lambda: D.ControlNetModel(block_out_channels=(128, 256), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
            cross_attention_dim=32, attention_head_dim=4, layers_per_block=1, conditioning_embedding_out_channels=(16, 32)), \
        lambda g: dict(sample=r(2, 4, 16, 16, g=g), timestep=torch.tensor(500), encoder_hidden_states=r(2, 7, 32, g=g),
                       controlnet_cond=r(2, 3, 32, 32, g=g), return_dict=False)
    yield "stableaudio-dit", lambda: D.StableAudioDiTModel(sample_size=16, in_channels=8, num_layers=3, attention_head_dim=64,
            num_attention_heads=4, num_key_value_attention_heads=2, out_channels=8, cross_attention_dim=32, time_proj_dim=32,
            global_states_input_dim=32, cross_attention_input_dim=32), \
        lambda g: dict(hidden_states=r(1, 8, 16, g=g), timestep=torch.tensor([500]), encoder_hidden_states=r(1, 9, 32, g=g),
                       global_hidden_states=r(1, 1, 32, g=g), return_dict=False)


def flat(y) -> List[torch.Tensor]:
    if isinstance(y, torch.Tensor):
        return [y]
    if isinstance(y, (tuple, list)):
        return [t for x in y for t in flat(x)]
    if hasattr(y, "to_tuple"):
        return flat(y.to_tuple())
    return []


def forward(model, inputs: Callable, grad: bool) -> List[torch.Tensor]:
    """The outputs of one call, or with grad the gradient of the input that the model's
    output reaches (sample or hidden_states) through a scalar of every output."""
    kw = inputs(torch.Generator().manual_seed(0))
    if not grad:
        with torch.no_grad():
            return flat(model(**kw))
    key = next(k for k in ("sample", "hidden_states") if k in kw)
    x = kw[key] = kw[key].clone().requires_grad_(True)
    sum(o.float().square().mean() for o in flat(model(**kw))).backward()
    return [x.grad]


def equal(a: List[torch.Tensor], b: List[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _cast(inputs: Callable, dtype: torch.dtype) -> Callable:
    """inputs() with its floating-point tensors (nested in dicts too) in dtype."""
    def conv(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.to(dtype)
        return {k: conv(x) for k, x in v.items()} if isinstance(v, dict) else v
    return lambda g: conv(inputs(g))


def prepare(model, args) -> None:
    """diffusers' own hooks on the model, as a user enables them before offload()."""
    if args.layerwise:
        model.enable_layerwise_casting(storage_dtype=getattr(torch, args.layerwise), compute_dtype=torch.float32)
    if args.first_block_cache is not None:
        from diffusers import FirstBlockCacheConfig
        model.enable_cache(FirstBlockCacheConfig(threshold=args.first_block_cache))


def call(model, inputs: Callable, args, i: int) -> List[torch.Tensor]:
    if args.first_block_cache is None:
        return forward(model, inputs, args.grad)
    def at_step(g):  # a sampler's timesteps, so that the cache decides differently from call to call
        kw = inputs(g)
        kw["timestep"] = kw["timestep"] * (1.0 - i / (2 * args.steps))
        return kw
    with model.cache_context("cond"):
        return forward(model, at_step, args.grad)


def run(name: str, build: Callable, inputs: Callable, args) -> Dict[str, object]:
    """A resident twin and the offloaded model called in lockstep (hooks such as a block cache
    keep state from call to call)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build().eval().requires_grad_(False).to(getattr(torch, args.dtype)))
        prepare(models[-1], args)
    if args.dtype != "float32":
        inputs = _cast(inputs, getattr(torch, args.dtype))
    ref, model = models
    if not equal(call(ref, inputs, args, 0), call(model, inputs, args, 0)):
        return {"name": name, "error": "resident runs differ"}
    total = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    budget = int(total * args.fraction) // (2 * MiB) * (2 * MiB)  # whole pages of the arena
    off = spt.offload(model, budget=budget, backend="emu", vmm=args.vmm)
    moved, same = [], True
    for i in range(1, args.steps + 1):
        before = off.context.stats()["bytes_h2d"]["total"]
        same &= equal(call(model, inputs, args, i), call(ref, inputs, args, i))
        moved.append(off.context.stats()["bytes_h2d"]["total"] - before)
    largest = max(u.nbytes for u in off.units)
    skips = args.first_block_cache is not None  # a cached call skips blocks: less must move
    res = {"name": name, "MiB": total / MiB, "units": len(off.units), "largest": largest / MiB,
           "moved": moved[-1] / MiB, "must": (total - budget) / MiB,
           "bound": 1.15 * (total - budget + largest) / MiB, "bitwise": same,
           "moving": skips or min(moved) >= total - budget}
    if args.summary:
        print(off.summary())
    off.remove()
    res["removed"] = equal(call(model, inputs, args, 0), call(ref, inputs, args, 0))
    return res


class _LoRA(torch.nn.Module):
    """A low-rank adapter around a frozen linear layer, as peft's LoRA layers are (peft is not
    on Debian): base(x) + up(down(x)) * scale, down and up trainable."""

    def __init__(self, base: torch.nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = base
        self.down = torch.nn.Linear(base.in_features, rank, bias=False)
        self.up = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.normal_(self.up.weight, std=1e-3)  # not zero: both factors get gradients from the first step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x) + self.up(self.down(x)) * 0.5


def add_adapters(model: torch.nn.Module) -> None:
    """The base frozen; an adapter on every linear layer of 64 features or more each way."""
    model.requires_grad_(False)
    torch.manual_seed(1)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and min(child.in_features, child.out_features) >= 64:
                setattr(parent, child_name, _LoRA(child))


def train(name: str, build: Callable, inputs: Callable, args) -> Dict[str, object]:
    """Full fine-tuning through offload(model, optimizer=opt): a resident twin with
    torch.optim.AdamW(foreach=False) and the offloaded model with the same optimizer (its update
    runs in spillway's C AdamW on the host), --steps steps of a mean-square loss on the output;
    the losses and every parameter after the steps compared."""
    models, opts = [], []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(build().train().requires_grad_(True))
        if args.lora:
            add_adapters(models[-1])
        opts.append(torch.optim.AdamW([p for p in models[-1].parameters() if p.requires_grad], lr=1e-3, foreach=False))
    (ref, model), (ref_opt, opt) = models, opts
    frozen = [p for p in model.parameters() if not p.requires_grad]
    total = sum(p.numel() * p.element_size() for p in (frozen if args.lora else model.parameters()))
    budget = int(total * args.fraction) // (2 * MiB) * (2 * MiB)
    if args.lora:  # the README's recipe: the base streams, the adapters stay on the device, opt as it is
        off = spt.offload(model, budget=budget, backend="emu", vmm=args.vmm, recompute=args.recompute)
    else:
        off = spt.offload(model, budget=budget, backend="emu", vmm=args.vmm, optimizer=opt,
                          train_on_device=args.train_on_device, recompute=args.recompute)

    def loss(m):
        return sum(o.float().square().mean() for o in flat(m(**inputs(torch.Generator().manual_seed(0)))))

    worst_loss, moved = 0.0, []
    for _ in range(args.steps):
        before = off.context.stats()["bytes_h2d"]["total"]
        ls = []
        for m, o in ((ref, ref_opt), (model, opt)):
            val = loss(m)
            val.backward()
            o.step()
            o.zero_grad(set_to_none=True)
            ls.append(float(val))
        worst_loss = max(worst_loss, abs(ls[1] - ls[0]) / max(abs(ls[0]), 1e-30))
        moved.append(off.context.stats()["bytes_h2d"]["total"] - before)
    rel = max(float((p - q).abs().max() / q.abs().max().clamp_min(1e-30))
              for p, q in zip(model.parameters(), ref.parameters()))
    same = all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    res = {"name": name, "MiB": total / MiB, "units": len(off.units), "largest": max(u.nbytes for u in off.units) / MiB,
           "moved": moved[-1] / MiB, "must": (total - budget) / MiB, "loss": worst_loss, "param": rel, "bitwise": same,
           "moving": min(moved) >= total - budget}
    if args.summary:
        print(off.summary())
    off.remove()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="cases to run (all by default)")
    ap.add_argument("--grad", action="store_true", help="compare the input's gradient through the model")
    ap.add_argument("--vmm", default="off", choices=("on", "off"), help="the arena's pages (on) or segments (off)")
    ap.add_argument("--fraction", type=float, default=0.4, help="budget as a fraction of the model's bytes")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--summary", action="store_true", help="print each offload's summary")
    ap.add_argument("--dtype", default="float32", help="the models' and inputs' dtype for the forward runs (bfloat16)")
    ap.add_argument("--layerwise", metavar="DTYPE", help="enable_layerwise_casting with this storage dtype (float16, bfloat16)")
    ap.add_argument("--first-block-cache", type=float, metavar="T", help="enable_cache(FirstBlockCacheConfig(threshold=T))")
    ap.add_argument("--train", action="store_true", help="full fine-tuning through offload(optimizer=), against resident AdamW")
    ap.add_argument("--train-on-device", default="auto", type=lambda v: v if v == "auto" else float(v),
                    help="offload()'s train_on_device with --train")
    ap.add_argument("--lora", action="store_true", help="with --train: a frozen base with low-rank adapters on its linear layers")
    ap.add_argument("--recompute", default=False, type=lambda v: {"true": True, "false": False}.get(v.lower(), v),
                    help="offload()'s recompute with --train (true, auto)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, emu, budget {args.fraction:.0%} of each model, vmm={args.vmm}, "
          f"{'gradients of the input' if args.grad else 'outputs'} over {args.steps} calls"
          + (f", layerwise casting to {args.layerwise}" if args.layerwise else "")
          + (f", first-block cache at {args.first_block_cache}" if args.first_block_cache is not None else ""))
    print(f"{'model':16s} {'MiB':>7s} {'units':>5s} {'largest':>8s} {'moved':>7s} {'must':>7s} {'1.15x':>7s} "
          f"{'moving':>6s} {'bitwise':>7s} {'removed':>7s}")
    failed = 0
    for name, build, inputs in cases():
        if args.names and name not in args.names:
            continue
        try:
            res = (train if args.train else run)(name, build, inputs, args)
        except Exception as e:  # a case that cannot run here is reported, the rest go on
            traceback.print_exc(limit=-12)
            res = {"name": name, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        if "error" in res:
            print(f"{name:16s} {res['error']}")
            failed += "resident" not in res["error"] and "PyTorch version" not in res["error"]
            continue
        if args.train:
            ok = res["loss"] <= 1e-3 and res["param"] <= 1e-5 and res["moving"]
            failed += not ok
            print(f"{name:16s} {res['MiB']:7.2f} {res['units']:5d} {res['largest']:8.2f} {res['moved']:7.2f} {res['must']:7.2f} "
                  f"loss {res['loss']:.1e} param {res['param']:.1e} bitwise {res['bitwise']} moving {res['moving']}")
            continue
        ok = res["bitwise"] and res["moving"] and res["removed"]
        failed += not ok
        print(f"{name:16s} {res['MiB']:7.2f} {res['units']:5d} {res['largest']:8.2f} {res['moved']:7.2f} {res['must']:7.2f} "
              f"{res['bound']:7.2f} {str(res['moving']):>6s} {str(res['bitwise']):>7s} {str(res['removed']):>7s}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
