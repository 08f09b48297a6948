#!/usr/bin/env python3
"""Training a Llama-shaped model that does not fit the budget: spillway.torch.offload(model,
budget, optimizer=opt) against PyTorch's own ways of training in less device memory.

The model (--model)
  1.1b     LlamaConfig(hidden 2048, intermediate 5632, 22 layers, 32 heads, 4 kv heads, vocab
           32000): fp32 parameters (4.1 GiB), every one trained
  3b       hidden 3072, intermediate 8192, 28 layers, 24 heads, 8 kv heads, vocab 32000 (11.3 GiB)
  lora13b  hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 kv heads, vocab 32000: bf16
           base weights, frozen (13.5 GiB), peft LoRA r=16 (alpha 32) on q, k, v and o, fp32,
           trained (needs peft; without it the run says so and exits 0)
  tiny     hidden 64, intermediate 128, 2 layers, 4 heads, 2 kv heads, vocab 256, batch 2 x 32
           (--smoke's model): the control flow on a GPU
  tinylora hidden 256, intermediate 512, 4 layers, 4 heads, 2 kv heads, vocab 4096, batch 2 x 32,
           bf16 base and LoRA as lora13b (9 MiB: several units at an 8MiB budget)
           (on a GPU, spillway-alloc needs a budget that PyTorch's own segments and cuBLAS's
           workspace fit in besides the model: 1GiB, where the small models are one unit)
transformers' LlamaForCausalLM (attn_implementation="sdpa") when transformers is importable,
otherwise a small Llama-like module of this file (embedding, blocks of RMSNorm, attention with
grouped kv heads through scaled_dot_product_attention where torch has it, gated MLP, a head; no
rotary embedding). It is built with its parameters on the meta device, then each parameter is
drawn on the GPU from a generator of its own (seed 1000 + its index; N(0, 0.02), norms 1, LoRA's
B 0) and put where the variant wants it: the same weights in every process (each child reports a
checksum of them, held to resident's). Batch 4 x 1024 random token ids (seed 7; --accum
micro-batches of that per optimizer step), bf16 autocast, next-token cross-entropy in fp32,
torch.optim.AdamW(lr 1e-4, weight_decay 0.01); --clip: clip_grad_norm_ before each step.

Variants, one process each (this file with --child)
  resident         everything on the device; AdamW(fused=True) there (foreach where fused is not)
  checkpointing    resident, with activation checkpointing (gradient_checkpointing_enable,
                   use_reentrant=False; torch.utils.checkpoint per block for the fallback model)
  save_on_cpu      resident, forward and backward inside torch.autograd.graph.save_on_cpu(
                   pin_memory=True): every saved activation in pinned host memory
  fsdp-offload     FSDP2 in a 1-rank process group: fully_shard per decoder layer and the whole
                   model, CPUOffloadPolicy(pin_memory=True): parameters, gradients and the AdamW
                   step (fused on the CPU where torch has it, else foreach) on the host
  fsdp-offload-ckpt  the same with activation checkpointing
  hostopt          torchao CPUOffloadOptimizer's mechanism, written here: parameters on the device,
                   a post-accumulate-grad hook per parameter copies its gradient into a pinned host
                   buffer on a side stream and frees the device one; the step waits each copy's
                   event, runs a CPU AdamW (fused where torch has it, else foreach) of that
                   parameter on its host master copy and copies it back (non_blocking). With
                   --accum the gradients accumulate on the device until the last micro-batch
  spillway         the model on the host, opt = AdamW over it (torch's single-tensor step, on the
                   host), spillway.torch.offload(model, budget=B, optimizer=opt); the loop is
                   unchanged: autocast forward, loss.backward(), opt.step(), opt.zero_grad()
  spillway-c       the same with host_update="spillway": opt's steps in spillway's C AdamW
  spillway-c-ckpt  spillway-c with activation checkpointing (as the checkpointing variant): the
                   blocks' activations recomputed in the backward instead of streamed
  spillway-c-overlap  spillway-c with overlap_update=True: the C step runs beside the next
                   forward (a step's time then holds the last step's update, wherever it ends)
  spillway-c-ckpt-overlap  both
  spillway-c-ckpt-overlap-backward  spillway-c-ckpt with overlap_update="backward": the
                   update also computed during the backward
  spillway-alloc   inside `with spillway.torch.use_allocator(budget=B):`, offload(model,
                   optimizer=opt, recompute=False) without a budget: one budget over everything
                   on the device, the activations through the offload's stash
  spillway-c-recompute  spillway-c with offload(recompute=True): spillway recomputes the
                   decoder layers in the backward (instead of transformers' checkpointing)
  spillway-c-recompute-overlap  the same with overlap_update=True
  spillway-alloc-recompute  spillway-alloc with recompute="auto" and AdamW(fused=True): the
                   training state kept whole on the device when it fits beside the recomputed
                   layers, as few layers recomputed as the budget needs
Each spillway variant runs once per --budget; the peers run uncapped and say which budgets
their peak fits. hostopt and fsdp* need CUDA (and FSDP2, torch >= 2.6): elsewhere they report
"unavailable", which is no failure.

Columns
  budget       the spillway variant's budget
  ms/step      the median optimizer step (its micro-batches, clipping, step, zero_grad) after
               --warmup untimed steps; tokens/s = batch x seq x accum / that; x res: over resident's
  peak GiB     device memory at peak after the model was built: torch.cuda.max_memory_reserved,
               plus for spillway its context's peak held bytes (stats()["held"]["peak"]); under
               use_allocator that peak alone (PyTorch's segments are inside it)
  fits         peers: the budgets their peak fits; spillway: whether its peak fits its budget
  moved GiB    spillway: bytes its context moved per step (stats() bytes_h2d + bytes_d2h: the
               weights up, the activations that did not fit down and up again), counted from
               before one optimizer step to before the next (a step's end may already bring in
               what the next one needs); the gradients' copies to the host are torch's own and
               not in it. Others: -
  hook us      spillway: the median host time of one acquire (hook_stats()["hook_us_median"])
  loss         the first and last step's loss (all of them in --json); rel: the largest relative
               difference from resident's over the steps
  params       the trained parameters after the last step against resident's: bitwise equal,
               else the largest max|a-b| / max|b| over them
An out-of-memory error ends its variant, reported with the phase it happened in (OOM is a result
for a peer, a failure for spillway). Each child has --child-timeout seconds.
Exit status 1 when a spillway variant failed or its losses differ from resident's by more than
1e-3 (relative), when resident failed, when a variant's weights checksum differs from resident's,
or when any variant failed otherwise than out of memory or unavailable.

    python3 bench/peers/torch_train.py                                    # 1.1b, every variant
    python3 bench/peers/torch_train.py --model 3b --budget 12GiB,24GiB --json /tmp/train3b.json
    python3 bench/peers/torch_train.py --variants resident,spillway-c --accum 4 --clip 1.0
    python3 bench/peers/torch_train.py --model lora13b --variants resident,spillway,spillway-c
    python3 bench/peers/torch_train.py --smoke                            # tiny, on the CPU

--smoke: the tiny model on the CPU, fp32 without autocast, spillway on its emu backend (budgets
2MiB,4MiB), save_on_cpu without pinning; hostopt and fsdp* report unavailable. spillway is
imported from python/ in this repository (make build; SPILLWAY_LIBRARY may point at the library).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

import launcher  # same directory: a child process and its result line
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if (ROOT / "python" / "spillway").is_dir():
    sys.path.insert(0, str(ROOT / "python"))

VARIANTS = ["resident", "checkpointing", "save_on_cpu", "fsdp-offload", "fsdp-offload-ckpt", "hostopt",
            "spillway", "spillway-c", "spillway-c-ckpt", "spillway-c-overlap", "spillway-c-ckpt-overlap",
            "spillway-c-ckpt-overlap-backward", "spillway-alloc", "spillway-c-recompute",
            "spillway-c-recompute-overlap", "spillway-alloc-recompute"]
CHECKPOINTED = {"checkpointing", "fsdp-offload-ckpt", "spillway-c-ckpt", "spillway-c-ckpt-overlap",
                "spillway-c-ckpt-overlap-backward"}  # gradient_checkpointing_enable
C_STEP = {"spillway-c", "spillway-c-ckpt", "spillway-c-overlap", "spillway-c-ckpt-overlap",
          "spillway-c-ckpt-overlap-backward", "spillway-c-recompute",
          "spillway-c-recompute-overlap"}  # host_update="spillway"
RECOMPUTED = {"spillway-c-recompute": True, "spillway-c-recompute-overlap": True,
              "spillway-alloc-recompute": "auto"}  # offload(recompute=...)
ALLOC = {"spillway-alloc", "spillway-alloc-recompute"}  # inside use_allocator(budget=B)
SHAPES = {
    "1.1b": dict(hidden=2048, inter=5632, layers=22, heads=32, kv=4, vocab=32000, batch=4, seq=1024, lora=False),
    "3b": dict(hidden=3072, inter=8192, layers=28, heads=24, kv=8, vocab=32000, batch=4, seq=1024, lora=False),
    "lora13b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, vocab=32000, batch=4, seq=1024, lora=True),
    "tiny": dict(hidden=64, inter=128, layers=2, heads=4, kv=2, vocab=256, batch=2, seq=32, lora=False),
    "tinylora": dict(hidden=256, inter=512, layers=4, heads=4, kv=2, vocab=4096, batch=2, seq=32, lora=True),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
LR, WD = 1e-4, 0.01
LOSS_TOL = 1e-3
RESULT = "@@RESULT "
GiB = 1 << 30
MiB = 1 << 20
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
bf16 = torch.bfloat16
T0 = float(os.environ.setdefault("TORCH_TRAIN_T0", repr(time.time())))


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"bad size {text!r} (examples: 8GiB, 512MiB)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


class Unavailable(Exception):
    """A variant that cannot run here (no CUDA, no FSDP2 in this torch): not a failure."""


def is_oom(e: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    text = str(e)
    return (oom is not None and isinstance(e, oom)) or "out of memory" in text.lower() or "ALLOC_FAILED" in text


# ----------------------------------------------------------------------------------------------
# the model


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, d: int, h: int, kvh: int) -> None:
        super().__init__()
        self.h, self.kvh, self.hd = h, kvh, d // h
        self.q_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kvh * self.hd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kvh, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kvh, 1)
        v = self.v_proj(x).view(B, T, self.kvh, self.hd).transpose(1, 2).repeat_interleave(self.h // self.kvh, 1)
        sdpa = getattr(nn.functional, "scaled_dot_product_attention", None)
        if sdpa is not None:
            att = sdpa(q, k, v, is_causal=True)
        else:  # torch < 2.0
            s = (q @ k.transpose(2, 3)) / self.hd ** 0.5
            mask = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            att = s.masked_fill(mask, float("-inf")).softmax(-1) @ v
        return self.o_proj(att.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: Dict[str, Any]) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(c["hidden"]), RMSNorm(c["hidden"])
        self.self_attn = Attention(c["hidden"], c["heads"], c["kv"])
        self.mlp = MLP(c["hidden"], c["inter"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class SmallLlama(nn.Module):
    """The model when transformers is missing: LlamaForCausalLM's module names and layout."""

    def __init__(self, c: Dict[str, Any]) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.model.layers = nn.ModuleList(Block(c) for _ in range(c["layers"]))
        self.model.norm = RMSNorm(c["hidden"])
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)
        self.checkpointing = False

    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: Optional[Dict[str, Any]] = None) -> None:
        self.checkpointing = True

    def forward(self, input_ids: torch.Tensor) -> Any:
        from torch.utils.checkpoint import checkpoint
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = checkpoint(layer, x, use_reentrant=False) if self.checkpointing and self.training else layer(x)
        return types.SimpleNamespace(logits=self.lm_head(self.model.norm(x)))


@contextlib.contextmanager
def params_on_meta() -> Any:
    """Every parameter registered meanwhile is put on the meta device: nothing is drawn on the host."""
    orig = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        orig(self, name, param)
        if param is not None and param.device.type != "meta":
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = orig  # type: ignore[method-assign]


def build(shape: Dict[str, Any], gen: torch.device, target: torch.device) -> Any:
    """The model with its parameters on target, drawn on gen; returns (model, checksum, hf)."""
    try:
        import transformers
        conf = transformers.LlamaConfig(
            hidden_size=shape["hidden"], intermediate_size=shape["inter"], num_hidden_layers=shape["layers"],
            num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"], vocab_size=shape["vocab"],
            max_position_embeddings=max(2048, shape["seq"]), use_cache=False, tie_word_embeddings=False,
            attn_implementation="sdpa")
        make: Callable[[], nn.Module] = lambda: transformers.LlamaForCausalLM(conf)  # noqa: E731
        hf = True
    except ImportError:
        make, hf = (lambda: SmallLlama(shape)), False  # noqa: E731
    with params_on_meta():
        model = make()
        if shape["lora"]:
            import peft
            lc = peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, bias="none")
            model = peft.get_peft_model(model, lc)
    checksum, i, seen = 0.0, 0, {}
    for mname, m in model.named_modules():
        for n, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) in seen:
                m._parameters[n] = seen[id(p)]
                continue
            trained = not shape["lora"] or "lora_" in mname
            dtype = torch.float32 if trained else bf16
            if "norm" in mname.rsplit(".", 1)[-1].lower():
                t = torch.ones(p.shape, dtype=dtype, device=gen)
            elif "lora_B" in mname:
                t = torch.zeros(p.shape, dtype=dtype, device=gen)
            else:
                g = torch.Generator(device=gen).manual_seed(1000 + i)
                t = torch.empty(p.shape, dtype=dtype, device=gen).normal_(0, 0.02, generator=g)
            checksum += float(t.double().sum())
            i += 1
            new = nn.Parameter(t.to(target), requires_grad=trained)
            seen[id(p)] = new
            m._parameters[n] = new
            del t
    for m in model.modules():  # buffers (rotary tables) were made on the host
        for n, b in list(m._buffers.items()):
            if b is not None and b.device != target:
                m._buffers[n] = b.to(target)
    model.train()
    return model, checksum, hf


def decoder_layers(model: nn.Module) -> List[nn.Module]:
    return [m for n, m in model.named_modules() if n.endswith("model.layers") and isinstance(m, nn.ModuleList)][0]


def batches(shape: Dict[str, Any], n: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, shape["vocab"], (shape["batch"], shape["seq"]), generator=g) for _ in range(n)]


def loss_of(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def adamw(params: List[torch.Tensor], where: str) -> torch.optim.Optimizer:
    """AdamW as each peer runs it: fused where torch has it (CUDA, and the CPU from torch 2.4),
    else foreach ('cuda' / 'cpu-fast'), or torch's default ('default')."""
    if where != "default":
        try:
            return torch.optim.AdamW(params, lr=LR, weight_decay=WD, fused=True)
        except (RuntimeError, TypeError, ValueError):
            return torch.optim.AdamW(params, lr=LR, weight_decay=WD, foreach=True)
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


# ----------------------------------------------------------------------------------------------
# the peers' machinery


class HostOpt:
    """Parameters on the device, their master copies, gradients and AdamW on the host (torchao's
    CPUOffloadOptimizer's mechanism): one CPU AdamW per parameter, so that the step of one
    overlaps the copy back of the one before."""

    def __init__(self, params: List[nn.Parameter]) -> None:
        self.params = params
        self.stream = torch.cuda.Stream()
        self.master: Dict[nn.Parameter, torch.Tensor] = {}
        self.opts: Dict[nn.Parameter, torch.optim.Optimizer] = {}
        self.events: Dict[nn.Parameter, Any] = {}
        self.offload_now = True
        self.hooks = []
        for p in params:
            m = torch.empty(p.shape, dtype=p.dtype, pin_memory=True)
            m.copy_(p.detach())
            m.grad = torch.empty_like(m, pin_memory=True)
            self.master[p] = m
            self.opts[p] = adamw([m], "cpu-fast")
            self.hooks.append(p.register_post_accumulate_grad_hook(self._grad_ready))
        self.impl = "fused" if self.opts[params[0]].defaults.get("fused") else "foreach"

    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self.offload_now:  # accumulating: the gradient stays on the device
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.master[p].grad.copy_(p.grad, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        p.grad.record_stream(self.stream)
        p.grad = None
        self.events[p] = ev

    def clip(self, max_norm: float) -> None:
        for ev in self.events.values():
            ev.synchronize()
        torch.nn.utils.clip_grad_norm_(list(self.master.values()), max_norm)

    def step(self) -> None:
        for p in self.params:
            ev = self.events.pop(p, None)
            if ev is None:
                continue
            ev.synchronize()
            self.opts[p].step()
            p.data.copy_(self.master[p], non_blocking=True)

    def zero_grad(self) -> None:
        pass  # the device gradients went with their copies; the host ones are overwritten next step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def fsdp_offload(model: nn.Module) -> str:
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    except ImportError as e:
        raise Unavailable(f"no FSDP2 in torch {torch.__version__} ({e})")
    import torch.distributed as dist
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ["MASTER_PORT"] = str(free_port())
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
    policy = CPUOffloadPolicy(pin_memory=True)
    for layer in decoder_layers(model):
        fully_shard(layer, offload_policy=policy)
    fully_shard(model, offload_policy=policy)
    return "fully_shard per layer + model, CPUOffloadPolicy(pin_memory=True), 1 rank"


# ----------------------------------------------------------------------------------------------
# the child: one variant, at one budget


def final_params(model: nn.Module, v: Any) -> Dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        t = p.detach()
        if hasattr(t, "to_local"):  # FSDP2's DTensor, one rank: the local shard is the whole tensor
            t = t.to_local()
        out[n] = t.to("cpu", copy=True)
    return out


def compare_params(mine: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    if set(mine) != set(ref):
        return dict(params_equal=False, params_rel=None, params_note=f"names differ ({len(mine)} vs {len(ref)})")
    equal, rel = True, 0.0
    for n, b in ref.items():
        a = mine[n]
        if torch.equal(a, b):
            continue
        equal = False
        d = (a.float() - b.float()).abs().max().item()
        rel = max(rel, d / max(b.float().abs().max().item(), 1e-30))
    return dict(params_equal=equal, params_rel=rel)


def moved_now(off: Any) -> tuple:
    s = off.stats()
    return s["bytes_h2d"]["total"], s["bytes_d2h"]["total"]


def load_ref(path: Path) -> Dict[str, torch.Tensor]:
    try:
        return torch.load(path, mmap=True, weights_only=True)
    except TypeError:  # torch < 2.1
        return torch.load(path)


def run_variant(args: argparse.Namespace, shape: Dict[str, Any], r: Dict[str, Any], phase: List[str]) -> None:
    name, budget = args.child, args.one_budget
    cuda = not args.smoke
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if name in ("hostopt", "fsdp-offload", "fsdp-offload-ckpt") and not cuda:
        raise Unavailable("needs CUDA")
    if name == "hostopt" and not hasattr(torch.Tensor, "register_post_accumulate_grad_hook"):
        raise Unavailable(f"torch {torch.__version__} has no register_post_accumulate_grad_hook (2.1+)")
    spw = name.startswith("spillway")
    on_device = name in ("resident", "checkpointing", "save_on_cpu", "hostopt")
    if spw:
        import spillway.torch as spt
    stack = contextlib.ExitStack()
    alloc = None
    if name in ALLOC:  # before the first CUDA allocation: the model is drawn inside it too
        alloc = stack.enter_context(spt.use_allocator(budget=budget, **({} if cuda else dict(backend="emu"))))
    with stack:
        phase[0] = "build"
        t = time.perf_counter()
        model, checksum, hf = build(shape, dev, dev if on_device else torch.device("cpu"))
        r.update(checksum=checksum, transformers=hf, build_s=time.perf_counter() - t,
                 params=sum(p.numel() for p in model.parameters()),
                 param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                 trained_bytes=sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))
        trained = [p for p in model.parameters() if p.requires_grad]
        phase[0] = "placement"
        if name in CHECKPOINTED:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        off, host, note = None, None, ""
        if name.startswith("fsdp"):
            note = fsdp_offload(model)
            trained = [p for p in model.parameters() if p.requires_grad]
            opt = adamw(trained, "cpu-fast")
            note += f"; CPU AdamW {'fused' if opt.defaults.get('fused') else 'foreach'}"
        elif name == "hostopt":
            host = HostOpt(trained)
            opt = None
            note = f"CPU AdamW {host.impl} per parameter"
        elif spw:
            opt = adamw(trained, "cuda" if name == "spillway-alloc-recompute" and cuda else "default")
            kw: Dict[str, Any] = {} if cuda else dict(backend="emu")
            kw["host_update"] = "spillway" if name in C_STEP else "torch"
            if name.endswith("-overlap"):
                kw["overlap_update"] = True
            elif name.endswith("-overlap-backward"):
                kw["overlap_update"] = "backward"
            if name not in ALLOC:
                kw["budget"] = budget
            kw["recompute"] = RECOMPUTED.get(name, False)  # spillway-alloc: the stash, not the default "auto"
            kw["train_on_device"] = "auto" if args.train_on_device == "auto" else float(args.train_on_device)
            off = spt.offload(model, optimizer=opt, **kw)
            on_dev = off.stats()["offload"]["resident_trainable_bytes"]
            r.update(units=len(off.units), spillway_budget=off.context.stats()["budget"],
                     budget_source=off.budget_source, trained_on_device=on_dev)
            names = sorted(off.units, key=lambda u: u.index)
            note = (f"{len(off.units)} units" + (f" ('{names[0].name}'{', ...' if len(names) > 1 else ''})"
                                                 if names else "") + ", budget "
                    f"{size_str(off.context.stats()['budget'])} ({off.budget_source}); trained on the device "
                    f"{size_str(on_dev)} of {size_str(r['trained_bytes'])} (train_on_device={args.train_on_device})")
        else:
            opt = adamw(trained, "cuda" if cuda else "default")
            note = f"AdamW {'fused' if opt.defaults.get('fused') else 'foreach' if opt.defaults.get('foreach') else 'default'}"
        r["note"] = note
        r["place_s"] = time.perf_counter() - t - r["build_s"]
        log(f"{name} {budget or ''}: built in {r['build_s']:.1f} s, placed in {r['place_s']:.1f} s; {note}")
        if cuda:
            if alloc is None:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            else:
                spt.reset_peak_memory_stats()

        ids_all = batches(shape, args.steps * args.accum)
        amp = (lambda: torch.autocast("cuda", dtype=bf16)) if cuda else contextlib.nullcontext
        saved = ((lambda: torch.autograd.graph.save_on_cpu(pin_memory=cuda)) if name == "save_on_cpu"
                 else contextlib.nullcontext)
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        losses: List[float] = []
        times: List[float] = []
        r["losses"] = losses
        moved0 = moved1 = (0, 0)
        split: Dict[str, List[float]] = {"forward": [], "backward": [], "optimizer": []}
        mark = [0.0]

        def lap(what: str, step: int) -> None:  # --profile: the time since the last lap, synced
            if args.profile:
                sync()
                now = time.perf_counter()
                if step >= args.warmup:
                    split[what].append(now - mark[0])
                mark[0] = now

        prof = None
        for step in range(args.steps):
            if step == 0 and args.warmup == 0 and off is not None:
                moved0 = moved_now(off)
            sync()
            if args.profile and step == args.steps - 1:
                import cProfile
                prof = cProfile.Profile()
                prof.enable()
            t = mark[0] = time.perf_counter()
            total = 0.0
            for k in range(args.accum):
                ids = ids_all[step * args.accum + k].to(dev)
                with saved():
                    phase[0] = f"step {step} forward"
                    with amp():
                        loss = loss_of(model, ids)
                    lap("forward", step)
                    phase[0] = f"step {step} backward"
                    if host is not None:
                        host.offload_now = k == args.accum - 1
                    (loss / args.accum).backward()
                    lap("backward", step)
                total += loss.detach()
            phase[0] = f"step {step} optimizer"
            # A step's bytes: from before the last optimizer step to before its own, since the end
            # of one step may already bring in the units that the next one needs (a prefetch).
            if off is not None and step == args.warmup - 1:
                moved0 = moved_now(off)
            if off is not None and step == args.steps - 1:
                moved1 = moved_now(off)
            if host is not None:
                if args.clip:
                    host.clip(args.clip)
                host.step()
                host.zero_grad()
            else:
                if args.clip:
                    torch.nn.utils.clip_grad_norm_(trained, args.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
            lap("optimizer", step)
            sync()
            dt = time.perf_counter() - t
            if prof is not None:
                prof.disable()
                import io
                import pstats
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
                print(f"--- {name} {budget or ''}: host time of step {step} by function\n{out.getvalue()}",
                      file=sys.stderr)
            losses.append(float(total) / args.accum)
            if step >= args.warmup:
                times.append(dt)
            if step < args.warmup or step == args.steps - 1:
                log(f"{name} {budget or ''}: step {step} loss {losses[-1]:.5f}, {dt * 1e3:.1f} ms")
        phase[0] = "after training"
        ms = statistics.median(times) * 1e3
        tokens = shape["batch"] * shape["seq"] * args.accum
        r.update(ms=ms, tok_s=tokens / (ms / 1e3), times_ms=[round(x * 1e3, 2) for x in times])
        if args.profile:
            r["split_ms"] = {k: round(statistics.median(v) * 1e3, 2) for k, v in split.items() if v}
            log(f"{name} {budget or ''}: median ms (synced) {r['split_ms']}")
        torch_peak = None
        if cuda and alloc is None:
            torch_peak = torch.cuda.max_memory_reserved()
        if off is not None:
            s = off.stats()
            held = s["held"]["peak"]
            r.update(torch_reserved_peak=torch_peak, spillway_held_peak=held,
                     peak=held if alloc is not None else (torch_peak or 0) + held,
                     hook_us=s["offload"]["hook_us_median"], stalls=s["stalls"]["total"],
                     activations_stashed=s["offload"]["activations_stashed"], c_steps=off.c_steps)
            n = len(times)
            h2d, d2h = moved1[0] - moved0[0], moved1[1] - moved0[1]
            r.update(moved_h2d=h2d / n, moved_d2h=d2h / n, moved=(h2d + d2h) / n)
            print(off.summary(), file=sys.stderr)
            if name in C_STEP and off.c_steps != args.steps:
                r["note"] += f"; only {off.c_steps} of {args.steps} steps ran in C"
            o = s["offload"]
            if o["updates_ahead_kept"] or o["updates_ahead_dropped"]:
                r["note"] += (f"; updates computed during the backward: {o['updates_ahead_kept']} kept, "
                              f"{o['updates_ahead_dropped']} computed again")
            off.remove()
        else:
            r["peak"] = torch_peak
        phase[0] = "comparing parameters"
        mine = final_params(model, host)
        ref_path = Path(args.ref_dir) / "resident_params.pt"
        if name == "resident":
            torch.save(mine, ref_path)
        elif ref_path.exists():
            r.update(compare_params(mine, load_ref(ref_path)))
        if name.startswith("fsdp"):
            import torch.distributed as dist
            dist.destroy_process_group()


def child(args: argparse.Namespace, shape: Dict[str, Any]) -> int:
    r: Dict[str, Any] = dict(variant=args.child, budget=args.one_budget, torch=torch.__version__)
    if not args.smoke and torch.cuda.is_available():
        r["device"] = torch.cuda.get_device_name()
    phase = ["start"]
    try:
        run_variant(args, shape, r, phase)
    except Unavailable as e:
        r.update(unavailable=str(e))
    except Exception as e:  # noqa: BLE001 - reported in the table; the other variants still run
        traceback.print_exc()
        r.update(failed=phase[0], oom=is_oom(e), error=f"{type(e).__name__}: {str(e).strip()[:500]}")
    print(RESULT + json.dumps(r), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# the parent: one child per variant and budget, the table


def launch(argv: List[str], env: Dict[str, str], timeout: float) -> Dict[str, Any]:
    """Runs one child, its stderr passed on as it comes; returns its RESULT."""
    r, _ = launcher.launch(argv, env, timeout, RESULT)
    if "error" in r and "failed" not in r:
        r["failed"] = "(process)"
    return r


def fmt(x: Optional[float], spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x / scale, spec)


def size_str(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def analyse(rows: List[Dict[str, Any]], budgets: List[str]) -> List[str]:
    """Adds x resident, loss differences and fits to each row; returns the list of problems."""
    res = next((r for r in rows if r["variant"] == "resident" and r.get("ms")), None)
    bad = []
    if res is None:
        bad.append("resident failed: no reference")
    for r in rows:
        v = r["variant"]
        if r.get("unavailable"):
            continue
        if r.get("error"):
            if v.startswith("spillway") or not r.get("oom") or v == "resident":
                bad.append(f"{v} {r.get('budget') or ''}: {'OOM' if r.get('oom') else 'error'} in {r.get('failed')}")
        if res is not None and v != "resident":
            if r.get("checksum") is not None and r["checksum"] != res.get("checksum"):
                bad.append(f"{v} {r.get('budget') or ''}: weights checksum {r['checksum']!r} != resident's")
            if r.get("ms"):
                r["x_res"] = r["ms"] / res["ms"]
            ref, mine = res.get("losses") or [], r.get("losses") or []
            if ref and mine:
                r["loss_rel"] = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(mine, ref))
                if v.startswith("spillway") and r["loss_rel"] > LOSS_TOL:
                    bad.append(f"{v} {r.get('budget')}: losses differ from resident's by {r['loss_rel']:.2e} (relative)")
        if r.get("peak") is not None:
            if v.startswith("spillway"):
                r["fits"] = "yes" if r["peak"] <= parse_size(r["budget"]) else "no"
            else:
                fit = [b for b in budgets if r["peak"] <= parse_size(b)]
                r["fits"] = ",".join(fit) if fit else "none"
    return bad


def print_table(rows: List[Dict[str, Any]], shape: Dict[str, Any], args: argparse.Namespace) -> None:
    first = next((r for r in rows if r.get("params")), {})
    unit, scale = ("MiB", MiB) if args.smoke else ("GiB", GiB)  # the columns' unit
    print(f"\n{first.get('device', 'cpu (smoke)')}; torch {first.get('torch', torch.__version__)}; model {args.model} "
          f"({'transformers LlamaForCausalLM' if first.get('transformers') else 'the fallback module'}), "
          f"{fmt(first.get('params'), '.2f', 1e6)} M parameters, {size_str(first.get('param_bytes', 0))}, "
          f"trained {size_str(first.get('trained_bytes', 0))}")
    print(f"batch {shape['batch']} x {shape['seq']} tokens x accum {args.accum}, clip {args.clip or 'off'}, "
          f"{'bf16 autocast' if not args.smoke else 'fp32'}, AdamW lr {LR} wd {WD}; {args.steps} steps, "
          f"median of the last {args.steps - args.warmup}")
    head = (f"{'variant':<18}{'budget':>8}{'ms/step':>10}{'x res':>7}{'tokens/s':>10}{'peak ' + unit:>9}{'fits':>12}"
            f"{'moved ' + unit:>10}{'hook us':>8}{'loss first':>11}{'loss last':>10}{'loss rel':>9}  params")
    print(head)
    for r in rows:
        v, b = r["variant"], r.get("budget") or "-"
        if r.get("unavailable"):
            print(f"{v:<18}{b:>8}  unavailable: {r['unavailable']}")
            continue
        if r.get("error") and not r.get("ms"):
            what = "OOM" if r.get("oom") else "ERROR"
            print(f"{v:<18}{b:>8}  {what} in {r.get('failed')} (exit {r.get('rc')}): {r['error'][:300]}")
            continue
        losses = r.get("losses") or [None]
        params = ("reference" if v == "resident" else "-" if r.get("params_equal") is None
                  else "bitwise equal" if r["params_equal"] else f"rel {r['params_rel']:.2e}")
        print(f"{v:<18}{b:>8}{r['ms']:>10.1f}{fmt(r.get('x_res'), '.2f'):>7}{r['tok_s']:>10.0f}"
              f"{fmt(r.get('peak'), '.2f', scale):>9}{r.get('fits', '-'):>12}{fmt(r.get('moved'), '.2f', scale):>10}"
              f"{fmt(r.get('hook_us'), '.1f'):>8}{fmt(losses[0], '.5f'):>11}{fmt(losses[-1], '.5f'):>10}"
              f"{fmt(r.get('loss_rel'), '.1e'):>9}  {params}")
        if r.get("note"):
            print(f"{'':<18}  {r['note']}")
        if r.get("error"):
            print(f"{'':<18}  then {'OOM' if r.get('oom') else 'ERROR'} in {r.get('failed')}: {r['error'][:300]}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=list(SHAPES), default=None, help="default 1.1b (--smoke: tiny)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ",".join(VARIANTS))
    p.add_argument("--budget", help="spillway's budgets, comma-separated (default 8GiB,18GiB; --smoke 2MiB,4MiB)")
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per variant, warm-up included")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (their losses are kept)")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--clip", type=float, default=0.0, help="clip_grad_norm_ max norm before each step (0: off)")
    p.add_argument("--train-on-device", default="auto",
                   help="the spillway variants' train_on_device: auto (default) or a fraction")
    p.add_argument("--child-timeout", type=float, default=300, help="seconds per variant process")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--keep-ref", action="store_true", help="keep the directory of resident's final parameters")
    p.add_argument("--smoke", action="store_true", help="the tiny model on the CPU: the control flow only")
    p.add_argument("--profile", action="store_true",
                   help="each child: the host time of its last step by function (cProfile, top 30 by own "
                        "time, on stderr) and the forward/backward/optimizer split of every timed step "
                        "(a device sync between them: slower steps)")
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--one-budget", help=argparse.SUPPRESS)
    p.add_argument("--ref-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.model = args.model or ("tiny" if args.smoke else "1.1b")
    shape = SHAPES[args.model]
    if args.steps <= args.warmup or args.warmup < 0 or args.accum < 1:
        p.error("--steps must exceed --warmup (>= 0), --accum must be >= 1")
    if args.child:
        return child(args, shape)

    budgets = [b.strip() for b in (args.budget or ("2MiB,4MiB" if args.smoke else "8GiB,18GiB")).split(",") if b.strip()]
    for b in budgets:
        try:
            parse_size(b)
        except ValueError as e:
            p.error(str(e))
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    variants = [v for v in VARIANTS if v in variants]  # resident first: the others compare with it
    if "resident" not in variants:
        p.error("resident is the reference: include it in --variants")
    if not args.smoke and not torch.cuda.is_available():
        p.error("no CUDA device (use --smoke for the CPU control-flow check)")
    if shape["lora"]:
        try:
            import peft  # noqa: F401 - the children build the adapters with it
        except ImportError as e:
            print(f"--model {args.model} needs peft, which is not importable ({e}): nothing to measure")
            return 0

    ref_dir = tempfile.mkdtemp(prefix="spillway_train_ref_")
    env = dict(os.environ, TORCH_TRAIN_T0=repr(T0))
    base = [sys.executable, os.path.abspath(__file__), "--model", args.model, "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--accum", str(args.accum), "--clip", str(args.clip),
            "--ref-dir", ref_dir, "--train-on-device", args.train_on_device] + (["--smoke"] if args.smoke else []) + (["--profile"] if args.profile else [])
    rows: List[Dict[str, Any]] = []
    try:
        for v in variants:
            for b in (budgets if v.startswith("spillway") else [None]):
                argv = base + ["--child", v] + (["--one-budget", b] if b else [])
                log(f"{v} {b or ''}: starting")
                r = launch(argv, env, args.child_timeout)
                r.setdefault("variant", v)
                r.setdefault("budget", b)
                rows.append(r)
                log(f"{v} {b or ''}: " + (f"unavailable: {r['unavailable']}" if r.get("unavailable") else
                                          f"{'OOM' if r.get('oom') else 'ERROR'} in {r.get('failed')}: {r['error'][:200]}"
                                          if r.get("error") else f"{r['ms']:.1f} ms/step"))
                if args.json:  # what has run survives a run cut short
                    with open(args.json, "w") as f:
                        json.dump(dict(model=args.model, shape=shape, budgets=budgets, rows=rows), f, indent=1)
    finally:
        if args.keep_ref:
            log(f"resident's final parameters kept in {ref_dir}")
        else:
            shutil.rmtree(ref_dir, ignore_errors=True)
    bad = analyse(rows, budgets)
    print_table(rows, shape, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, shape=shape, budgets=budgets, accum=args.accum, clip=args.clip,
                           steps=args.steps, warmup=args.warmup, rows=rows, problems=bad), f, indent=1)
    if bad:
        print(f"\n{len(bad)} problem(s):\n  " + "\n  ".join(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
