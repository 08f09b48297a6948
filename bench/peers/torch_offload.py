#!/usr/bin/env python3
"""spillway.torch.offload against its PyTorch peers, on two workloads, every result checked
bitwise (torch.equal) against the all-resident model.

Workloads
  a   32 x nn.Linear(8192, 8192, bias=False), bf16 (4 GiB), nn.Sequential, weights ~ N(0, 1/8192),
      input [batch, 8192] at batch 16 and 4096, budget 2 GiB; ms per pass, --passes passes.
  b   a Llama-shaped decoder, transformers.LlamaConfig(hidden 4096, intermediate 14336, 32 layers,
      32 heads, 8 kv heads, vocab 32000), random bf16 weights ~ N(0, 0.02), norms 1 (14.0 GiB
      with embeddings and head; 432 MiB a decoder layer), budget 6 GiB of weights:
        prefill  8 x 512 random tokens, use_cache=False, full logits compared;
        decode   greedy, batch 8, --tokens new tokens after that prompt with the KV cache (a
                 hand-written loop over past_key_values, logits_to_keep=1), tokens compared.

Variants
  resident           everything on the device: the floor, and the reference outputs
  spillway-lru       spillway.torch.offload(model, budget, policy="lru")
  spillway-plan      spillway.torch.offload(model, budget, policy="plan")
  accel-cpu-offload  accelerate.cpu_offload(model, execution_device=cuda): every weight copied
                     from pageable memory at every forward (its moved bytes: all parameters)
  accel-dispatch     accelerate.dispatch_model(model, infer_auto_device_map(model, max_memory=
                     {0: budget, "cpu": 100GiB}, no_split_module_classes=[the block class])): the
                     blocks that fit the budget on the device, the rest streamed from pageable
                     memory by the same hooks (moved: the parameters it left off the device)
  double-buffer      hand-written, what diffusers group offloading with streams does: each block's
                     weights packed in one pinned host buffer, two device slots, the block after
                     next copied on a side stream as soon as the block that last used its slot is
                     done (events), parameters pointed at the slot by forward pre-hooks; the rest
                     of the model (embeddings, final norm, head) stays on the device
  static-split       the hand-tuned peer: k blocks resident, the rest double-buffered as above.
                     (a): k and the placement (resident prefix / streamed first / resident spread
                     evenly) searched by trying every candidate whose device peak, measured with
                     max_memory_allocated over a pass (weights, slots, activations, workspace),
                     fits the budget; the fastest is then timed. (b): k derived from bytes so that
                     rest + k blocks + 2 slots <= the budget (--split-fit weights: the budget is a
                     weight budget, as spillway's and accelerate's are; --split-fit all also
                     subtracts the prefill's activation peak, measured once), placement chosen by
                     timing one prefill pass of each. The table says which rule was used.

Columns: ms per pass (a, prefill) or per decode step (= forward) and tokens/s; bytes moved per
pass/step (spillway: its bytes_h2d counter; peers: what they copy); "vs link": the link bound of
those bytes (moved / pinned host-to-device rate measured at the start, 1 GiB, best of 3) over
the time, 1.000 = at link speed; "x res": time over the all-resident time; torch peak (device
memory of PyTorch's allocator during the timed passes; spillway's own weights are not in it);
hook us/acq (spillway: host time of its hooks per block acquired; must be <= 30); result.

Each variant runs in its own process (this script with --child), so device memory and hooks
never leak between variants; the resident process writes the reference outputs under a fresh
/tmp directory and the others compare with them. Results come back as JSON on stdout.
Accelerate's variants move ~14 GiB at 7 GB/s per forward (~2 s), so for them decode is timed on
--accel-tokens tokens (compared with the first tokens of the reference); the table says so.
Exit status 1 if any spillway row is not bitwise equal (an error counts).

    python3 bench/peers/torch_offload.py                       # a + b, all variants: ~5-6 min on the H200
    python3 bench/peers/torch_offload.py --workload a --variants resident,spillway-plan,static-split
    python3 bench/peers/torch_offload.py --workload b --budget 6GiB --tokens 64 --json /tmp/off.json
    python3 bench/peers/torch_offload.py --smoke               # tiny, on the cpu: control flow only

spillway is imported from python/ in this repository if it is there (else from sys.path); all
access to its statistics is in spillway_figures(), its attachment in spillway_attach().
"""
import argparse
import contextlib
import inspect
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if (ROOT / "python" / "spillway").is_dir():
    sys.path.insert(0, str(ROOT / "python"))

VARIANTS = ["resident", "spillway-lru", "spillway-plan", "accel-cpu-offload", "accel-dispatch",
            "double-buffer", "static-split"]
bf16 = torch.bfloat16
# Children report times on the parent's clock, so the progress log reads as one timeline.
T0 = float(os.environ.setdefault("TORCH_OFFLOAD_T0", repr(time.time())))
UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
         "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
MiB = 1 << 20


def log(msg):
    print(f"[{time.time() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


def leave_out_cudnn_attention():
    """SDPA without cuDNN's attention for the rest of the process: torch may pick that kernel,
    which deterministic mode does not cover and which decodes differently twice in a row
    (bench/dev/decode_determinism.py); torch before 2.3 has no such kernel to leave out."""
    if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
        torch.backends.cuda.enable_cudnn_sdp(False)


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in UNITS:
        raise ValueError(f"bad size {text!r} (examples: 2GiB, 512MiB)")
    return int(float(m.group(1)) * UNITS[m.group(2).lower()])


class Skip(Exception):
    """A variant that cannot run here (its package is missing in --smoke): not a failure."""


# ----------------------------------------------------------------------------------------------
# spillway: everything that depends on the API being written in parallel is in these two functions


def spillway_attach(cfg, model, blocks, policy):
    """offload() the model; returns (handle, note). Between forwards every tensor offload()
    manages is a view of its pinned host copy, on the cpu by design; anything it does not manage
    and left in host memory is moved to the device (outside its budget) and the note says so,
    since the peers count that in the budget."""
    try:
        import spillway.torch as st
    except Exception as e:  # noqa: BLE001 - any import failure means "not available here"
        if cfg.smoke:
            raise Skip(f"import spillway.torch failed: {e}")
        raise
    off = st.offload(model, budget=cfg.budget_str, policy=policy,
                     backend="cuda" if cfg.cuda else "emu", **cfg.spw_options)
    note = ""
    if cfg.cuda:
        managed = {id(e.tensor) for u in off.units for e in u.entries}
        moved = 0
        for m in model.modules():
            for n, p in list(m._parameters.items()):
                if p is not None and p.device.type == "cpu" and id(p) not in managed:
                    m._parameters[n] = nn.Parameter(p.data.to(cfg.dev), requires_grad=p.requires_grad)
                    moved += p.numel() * p.element_size()
            for n, t in list(m._buffers.items()):
                if t is not None and t.device.type == "cpu" and id(t) not in managed:
                    m._buffers[n] = t.to(cfg.dev)
                    moved += t.numel() * t.element_size()
        if moved:
            note = f"{moved / MiB:.0f} MiB not managed by offload() left on host: moved to device, outside its budget"
    return off, note


def size_str(n):
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n:.0f} B"


def _stat(stats, *names):
    """The cumulative value of the first of `names` found in stats (or one level down): a counter
    dict {current, peak, total} gives its total, a number itself."""
    places = [stats] + [v for v in stats.values() if isinstance(v, dict)]
    for name in names:
        for place in places:
            v = place.get(name) if isinstance(place, dict) else None
            if isinstance(v, dict) and ("total" in v or "current" in v):
                return v.get("total", v.get("current"))
            if isinstance(v, (int, float)):
                return v
    return None


def _peak(stats, *names):
    for name in names:
        v = stats.get(name)
        if isinstance(v, dict) and "peak" in v:
            return v["peak"]
    return None


def spillway_figures(off):
    """All reads of spillway's statistics: cumulative bytes_h2d, hook host ns and acquisitions,
    device bytes held at peak. Missing names come back as None."""
    s = off.stats()
    pol = [ln.strip() for ln in off.summary().splitlines() if ln.strip().startswith("policy ")]
    return dict(
        policy=pol[-1] if pol else None,
        bytes_h2d=_stat(s, "bytes_h2d"),
        bytes_d2h=_stat(s, "bytes_d2h"),
        hook_ns=_stat(s, "hook_ns", "hook_time_ns", "hooks_ns"),
        acquires=_stat(s, "hook_acquires", "acquires", "acquire", "blocks_acquired"),
        stalls=_stat(s, "stalls"),
        lock_waits=_stat(s, "lock_waits"),
        lock_wait_ns=_stat(s, "lock_wait_ns"),
        trim_syncs=_stat(s, "trim_syncs"),
        held_peak=_peak(s, "held", "device_held", "bytes_held", "held_bytes"),
        stats=s,
    )


# ----------------------------------------------------------------------------------------------
# models: built with parameters on the meta device (no 14 GiB random fill on the CPU), then each
# parameter generated on the GPU from its own seed and placed where the variant wants it: the same
# values in every process.


@contextlib.contextmanager
def params_on_meta():
    orig = nn.Module.register_parameter

    def register(self, name, param):
        orig(self, name, param)
        if param is not None:
            self._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=False)
    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = orig


def materialize(cfg, model, std, target):
    seen = {}
    gen_dev = cfg.dev
    i = 0
    for m in model.modules():
        for n, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) in seen:  # tied
                m._parameters[n] = seen[id(p)]
                continue
            if "Norm" in type(m).__name__:
                t = torch.ones(p.shape, dtype=bf16, device=gen_dev)
            else:
                g = torch.Generator(device=gen_dev).manual_seed(1000 + i)
                t = torch.empty(p.shape, dtype=bf16, device=gen_dev).normal_(0, std, generator=g)
            i += 1
            new = nn.Parameter(t.to(target), requires_grad=False)
            seen[id(p)] = new
            m._parameters[n] = new
            del t
    if target.type != "cpu":
        model.to(target)  # buffers
    model.eval()
    return model


def build_a(cfg, target):
    with params_on_meta():
        model = nn.Sequential(*[nn.Linear(cfg.a_dim, cfg.a_dim, bias=False) for _ in range(cfg.a_layers)])
    materialize(cfg, model, cfg.a_dim ** -0.5, target)
    return model, list(model)


class TinyRMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(v + 1e-6)).to(x.dtype)


class TinyBlock(nn.Module):
    """Smoke stand-in for a decoder layer when transformers is missing: same parameter layout
    (attention with grouped kv heads, gated MLP, two norms), a list as KV cache."""

    def __init__(self, d, f, h, kvh, idx):
        super().__init__()
        self.h, self.kvh, self.hd, self.idx = h, kvh, d // h, idx
        self.input_layernorm, self.post_attention_layernorm = TinyRMSNorm(d), TinyRMSNorm(d)
        self.q_proj, self.o_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, kvh * self.hd, bias=False)
        self.v_proj = nn.Linear(d, kvh * self.hd, bias=False)
        self.gate_proj, self.up_proj = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x, cache):
        B, T, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(y).view(B, T, self.kvh, self.hd).transpose(1, 2)
        v = self.v_proj(y).view(B, T, self.kvh, self.hd).transpose(1, 2)
        if cache is not None:
            if cache[self.idx] is not None:
                k = torch.cat([cache[self.idx][0], k], 2)
                v = torch.cat([cache[self.idx][1], v], 2)
            cache[self.idx] = (k, v)
        k = k.repeat_interleave(self.h // self.kvh, 1)
        v = v.repeat_interleave(self.h // self.kvh, 1)
        S = k.shape[2]
        s = (q.float() @ k.float().transpose(2, 3)) / self.hd ** 0.5
        mask = torch.arange(S, device=x.device)[None, :] > (S - T + torch.arange(T, device=x.device))[:, None]
        att = s.masked_fill(mask, float("-inf")).softmax(-1).to(x.dtype) @ v
        x = x + self.o_proj(att.transpose(1, 2).reshape(B, T, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(nn.functional.silu(self.gate_proj(y)) * self.up_proj(y))


class TinyLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab"], c["hidden"])
        self.model.layers = nn.ModuleList(TinyBlock(c["hidden"], c["inter"], c["heads"], c["kv"], i)
                                          for i in range(c["layers"]))
        self.model.norm = TinyRMSNorm(c["hidden"])
        self.lm_head = nn.Linear(c["hidden"], c["vocab"], bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=False, logits_to_keep=0):
        x = self.model.embed_tokens(input_ids)
        cache = past_key_values if past_key_values is not None else (
            [None] * len(self.model.layers) if use_cache else None)
        for layer in self.model.layers:
            x = layer(x, cache)
        x = self.model.norm(x)
        logits = self.lm_head(x[:, -logits_to_keep:] if logits_to_keep else x)
        return types.SimpleNamespace(logits=logits, past_key_values=cache)


# Workload b's model (also built by bench/dev/hook_position.py and hook_ab.py), and --smoke's.
B_SHAPE = dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, vocab=32000, batch=8, prompt=512)
B_SHAPE_SMOKE = dict(hidden=64, inter=128, layers=4, heads=4, kv=2, vocab=256, batch=2, prompt=16)


def build_b(cfg, target):
    c = cfg.b_shape
    try:
        import transformers
        conf = transformers.LlamaConfig(
            hidden_size=c["hidden"], intermediate_size=c["inter"], num_hidden_layers=c["layers"],
            num_attention_heads=c["heads"], num_key_value_heads=c["kv"], vocab_size=c["vocab"],
            attn_implementation="sdpa")  # weights are made bf16 by materialize()
        with params_on_meta():
            model = transformers.LlamaForCausalLM(conf)
    except ImportError:
        if not cfg.smoke:
            raise
        with params_on_meta():
            model = TinyLM(c)
    materialize(cfg, model, 0.02, target)
    return model, list(model.model.layers)


# ----------------------------------------------------------------------------------------------
# the hand-written peers


def _tensor_bytes(t):
    return t.numel() * t.element_size()


class Streamer:
    """k blocks resident, the others streamed through two device slots from pinned host memory.
    With k = 0: the double buffer. The rest of the model (outside the blocks) lives on the device."""

    def __init__(self, cfg, model, blocks):
        self.cfg, self.model, self.blocks, self.dev = cfg, model, blocks, cfg.dev
        inside = {id(m) for b in blocks for m in b.modules()}
        self.rest_bytes = 0
        for m in model.modules():
            if id(m) not in inside:
                for n, p in list(m._parameters.items()):
                    if p is not None:
                        m._parameters[n] = nn.Parameter(p.data.to(self.dev), requires_grad=False)
                        self.rest_bytes += _tensor_bytes(p)
            for n, t in list(m._buffers.items()):  # small (rotary tables): on the device for good
                if t is not None:
                    m._buffers[n] = t.to(self.dev)
        # One pinned buffer per block, parameters 512-byte aligned inside it: one copy per block.
        self.packs = []
        for b in blocks:
            entries, off = [], 0
            for m in b.modules():
                for n, p in m._parameters.items():
                    if p is not None:
                        entries.append((m, n, off, _tensor_bytes(p), p.dtype, p.shape))
                        off += -(-_tensor_bytes(p) // 512) * 512
            flat = torch.empty(off, dtype=torch.uint8, pin_memory=cfg.cuda)
            for m, n, o, nb, dt, sh in entries:
                view = flat[o:o + nb].view(dt).view(sh)
                view.copy_(m._parameters[n].data)
                m._parameters[n] = nn.Parameter(view, requires_grad=False)
            self.packs.append((flat, entries))
        self.block_bytes = [flat.numel() for flat, _ in self.packs]
        self.moved = 0
        self.hooks, self.res, self.slots, self.views = [], {}, [], {}

    def _point(self, i, base):
        return [(m, n, nn.Parameter(base[o:o + nb].view(dt).view(sh), requires_grad=False))
                for m, n, o, nb, dt, sh in self.packs[i][1]]

    def attach(self, resident_ids):
        cuda, dev = self.cfg.cuda, self.dev
        resident_ids = set(resident_ids)
        self.res = {}
        for i in resident_ids:
            self.res[i] = self.packs[i][0].to(dev, non_blocking=True)
            for m, n, p in self._point(i, self.res[i]):
                m._parameters[n] = p
        seq = [i for i in range(len(self.blocks)) if i not in resident_ids]
        self.seq, self.pos = seq, {i: j for j, i in enumerate(seq)}
        nslots = min(2, len(seq))
        size = max((self.block_bytes[i] for i in seq), default=0)
        self.slots = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(nslots)]
        self.views = {i: self._point(i, self.slots[j % 2]) for j, i in enumerate(seq)}
        self.slot_has = [None] * nslots
        if cuda:
            self.side = torch.cuda.Stream()
            self.ready = [torch.cuda.Event() for _ in range(nslots)]
            self.free = [torch.cuda.Event() for _ in range(nslots)]
        self.hooks = [self.model.register_forward_pre_hook(lambda mod, args: self._start())]
        for i in seq:
            self.hooks.append(self.blocks[i].register_forward_pre_hook(
                lambda mod, args, i=i: self._before(i)))
            self.hooks.append(self.blocks[i].register_forward_hook(
                lambda mod, args, out, i=i: self._after(i)))
        self.sync()
        return self

    def sync(self):
        if self.cfg.cuda:
            torch.cuda.synchronize()

    def _issue(self, j):
        i, s = self.seq[j], j % 2
        src, nb = self.packs[i][0], self.block_bytes[i]
        if self.cfg.cuda:
            with torch.cuda.stream(self.side):
                self.side.wait_event(self.free[s])  # the block that last read slot s is done
                self.slots[s][:nb].copy_(src, non_blocking=True)
                self.ready[s].record(self.side)
        else:
            self.slots[s][:nb].copy_(src)
        self.slot_has[s] = i
        self.moved += nb

    def _start(self):
        # Both slots are free at the start of a forward: fill them at once, so the link works
        # while the first resident blocks (or the embeddings) compute.
        for j in range(len(self.slots)):
            self._issue(j)

    def _before(self, i):
        j = self.pos[i]
        s = j % 2
        if self.slot_has[s] != i:  # called out of the expected order: fetch it now, still correct
            self._issue(j)
        if self.cfg.cuda:
            torch.cuda.current_stream().wait_event(self.ready[s])
        for m, n, p in self.views[i]:
            m._parameters[n] = p

    def _after(self, i):
        j = self.pos[i]
        if self.cfg.cuda:
            self.free[j % 2].record(torch.cuda.current_stream())
        if j + 2 < len(self.seq):
            self._issue(j + 2)

    def detach(self):
        self.sync()
        for h in self.hooks:
            h.remove()
        self.hooks = []
        for flat, entries in self.packs:
            for m, n, o, nb, dt, sh in entries:
                m._parameters[n] = nn.Parameter(flat[o:o + nb].view(dt).view(sh), requires_grad=False)
        self.res, self.slots, self.views = {}, [], {}
        if self.cfg.cuda:
            torch.cuda.empty_cache()

    def weights_on_device(self):
        return self.rest_bytes + sum(self.block_bytes[i] for i in self.res) + \
            sum(s.numel() for s in self.slots)


def placements(n, k):
    if k == 0:
        return {"none": []}
    if k >= n:
        return {"all": list(range(n))}
    return {"prefix": list(range(k)), "streamed first": list(range(n - k, n)),
            "spread": sorted({int((i + 0.5) * n / k) for i in range(k)})}


# ----------------------------------------------------------------------------------------------
# the child: one variant, one workload


class Variant:
    """What a child needs from a variant: cumulative bytes moved, and its notes."""

    def __init__(self, name):
        self.name, self.note, self.off, self.streamer, self.meta_bytes = name, "", None, None, 0
        self.forwards = 0
        self.gpu_weight_bytes = None

    def moved(self):
        if self.off is not None:
            return spillway_figures(self.off)["bytes_h2d"]
        if self.streamer is not None:
            return self.streamer.moved
        return self.forwards * self.meta_bytes  # accelerate: every offloaded weight per forward


def attach(cfg, name, model, blocks):
    v = Variant(name)
    model.register_forward_pre_hook(lambda mod, args: setattr(v, "forwards", v.forwards + 1))
    if name.startswith("spillway-"):
        v.off, v.note = spillway_attach(cfg, model, blocks, name.split("-", 1)[1])
    elif name.startswith("accel-"):
        try:
            import accelerate
        except ImportError as e:
            if cfg.smoke:
                raise Skip(f"accelerate not installed ({e})")
            raise
        if name == "accel-cpu-offload":
            accelerate.cpu_offload(model, execution_device=cfg.dev)
        else:
            dmap = accelerate.infer_auto_device_map(
                model, max_memory={0: cfg.budget, "cpu": 100 << 30},
                no_split_module_classes=[type(blocks[0]).__name__], dtype=bf16)
            # skip_keys as transformers passes it when it dispatches a model itself
            accelerate.dispatch_model(model, device_map=dmap,
                                      skip_keys=getattr(model, "_skip_keys_device_placement", None))
            on_cpu = sorted({k for k, d in dmap.items() if d in ("cpu", "disk")})
            v.note = f"device_map: {len(on_cpu)} modules on cpu"
        v.meta_bytes = sum(_tensor_bytes(p) for p in model.parameters() if p.device.type == "meta")
        v.gpu_weight_bytes = sum(_tensor_bytes(p) for p in model.parameters() if p.device.type == "cuda")
    elif name == "resident":
        pass
    elif name in ("double-buffer", "static-split"):
        v.streamer = Streamer(cfg, model, blocks)
        if name == "double-buffer":
            v.streamer.attach([])
            v.gpu_weight_bytes = v.streamer.weights_on_device()
    else:
        raise ValueError(f"unknown variant {name}")
    return v


def sync(cfg):
    if cfg.cuda:
        torch.cuda.synchronize()


def reset_peak(cfg):
    # Guarded: under a pluggable allocator (spillway's use_allocator) these statistics raise.
    if cfg.cuda:
        with contextlib.suppress(Exception):
            torch.cuda.reset_peak_memory_stats()


def torch_peak(cfg):
    if cfg.cuda:
        with contextlib.suppress(Exception):
            return torch.cuda.max_memory_allocated()
    return None


def check(out, ref, what):
    """Validate before timing: finite, nonzero, and (when there is a reference) bitwise equal."""
    if out.is_floating_point() and not (torch.isfinite(out.float()).all() and out.abs().max() > 0):
        raise RuntimeError(f"{what}: output not finite and nonzero")
    if ref is None:
        return None
    return bool(torch.equal(out.cpu(), ref[..., :out.shape[-1]] if out.dtype == torch.long else ref))


def measure(cfg, v, fn, passes, ref, what, warmup=0):
    """One validation pass, `warmup` untimed ones (a learning policy's first steps, as a user's
    first iterations), then passes-1 timed ones; the median, moved bytes per forward, the torch
    peak and (spillway) hook figures over the timed ones."""
    out = fn()
    sync(cfg)
    eq = check(out, ref, what)
    for _ in range(warmup):
        out = fn()
    sync(cfg)
    first = out.cpu()
    f0, m0 = v.forwards, v.moved()
    s0 = spillway_figures(v.off) if v.off is not None else None
    a0 = v.off.acquires if v.off is not None else 0
    extra = 0
    if v.off is not None:
        # Reading spillway's statistics (a summary) right before the timed passes left the first
        # of them with cold caches (its hooks: 38-64 us a block against 27-43 for the others,
        # H200): one untimed pass in between, counted in moved bytes and forwards per pass.
        out = fn()
        sync(cfg)
        extra = 1
    def hooks():  # the offload's own counters: (host ns in its hooks, acquires)
        return (v.off.hook_ns, v.off.acquires) if v.off is not None else None

    h0 = hooks()
    vb0 = v.off.view_builds if v.off is not None else 0
    reset_peak(cfg)
    times, per_pass_hook = [], []
    for _ in range(passes - 1):
        sync(cfg)
        h = hooks()
        t = time.perf_counter()
        out = fn()
        sync(cfg)
        times.append((time.perf_counter() - t) * 1e3)
        if h is not None and v.off.acquires > h[1]:
            per_pass_hook.append((v.off.hook_ns - h[0]) / (v.off.acquires - h[1]) / 1e3)
    if ref is not None:
        eq = eq and check(out, ref, what)
    elif not torch.equal(out.cpu(), first):
        raise RuntimeError(f"{what}: the resident model is not deterministic across passes")
    r = dict(ms=statistics.median(times), passes=len(times), equal=eq,
             peak_bytes=torch_peak(cfg))
    h1 = hooks()
    fw = v.forwards - f0
    m1 = v.moved()
    r["forwards_per_pass"] = fw / (len(times) + extra)
    r["moved_bytes"] = (m1 - m0) / (len(times) + extra) if (m1 is not None and m0 is not None) else None
    if s0 is not None:
        s1 = spillway_figures(v.off)
        if h1[1] > h0[1]:
            r["hook_us"] = (h1[0] - h0[0]) / (h1[1] - h0[1]) / 1e3
        r["hook_us_per_pass"] = [round(x, 1) for x in per_pass_hook]
        r["view_builds_per_pass"] = (v.off.view_builds - vb0) / len(times)
        if s1["trim_syncs"] is not None and s0["trim_syncs"] is not None:
            r["trim_syncs_timed"] = s1["trim_syncs"] - s0["trim_syncs"]  # host waits: timed passes + 1
        if s1["lock_waits"] is not None and s0["lock_waits"] is not None and h1[1] > a0:
            # buffer calls that waited for the context lock (the prefetch worker holds it while it
            # enqueues): per block acquired, timed passes and the one before
            n = h1[1] - a0
            r["lock_waits_per_block"] = (s1["lock_waits"] - s0["lock_waits"]) / n
            r["lock_wait_us_per_block"] = (s1["lock_wait_ns"] - s0["lock_wait_ns"]) / n / 1e3
        r["spillway"] = s1
        r["c_calls"] = c_call_profile(cfg, v.off, fn)
    return r, first


def quantile(xs, f):
    """The f quantile of the sorted list xs (the element at that rank)."""
    return xs[min(len(xs) - 1, int(f * len(xs)))]


def c_call_profile(cfg, off, fn, passes=2):
    """Host time of each C call of the hooks (spw_acquire, spw_release, spw_release_acquire)
    over `passes` extra passes (after the timed ones, so the wrappers' own cost is in no figure
    above): percentiles in us, and the share of the hooks' time spent inside them."""
    names = ("spw_acquire", "spw_release", "spw_release_acquire")
    calls = {n: [] for n in names + ("re-point",)}
    orig = {n: getattr(off, "_c_" + n[4:]) for n in names}
    clock = time.perf_counter_ns

    def timed(f, out):
        def w(*a):
            t = clock()
            try:
                return f(*a)
            finally:
                out.append(clock() - t)
        return w

    h0 = off.hook_ns
    for n in names:
        setattr(off, "_c_" + n[4:], timed(orig[n], calls[n]))
    off._point = timed(off._point, calls["re-point"])  # a unit at a new device address
    try:
        for _ in range(passes):
            fn()
        sync(cfg)
    finally:
        for n in names:
            setattr(off, "_c_" + n[4:], orig[n])
        del off._point
    hook = off.hook_ns - h0
    res = {}
    for name, xs in calls.items():
        if not xs:
            continue
        xs = sorted(xs)
        q = lambda f: quantile(xs, f) / 1e3  # noqa: E731
        res[name] = dict(n=len(xs), p50=q(0.5), p90=q(0.9), p99=q(0.99), max=xs[-1] / 1e3,
                         total_ms=sum(xs) / 1e6)
    res["hooks_total_ms"] = hook / 1e6
    if cfg.profile:  # one more pass under cProfile: where the hooks' Python time goes
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        fn()
        sync(cfg)
        prof.disable()
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text).sort_stats("tottime")
        st.print_stats(30)
        # pstats prints milliseconds; the hooks' functions and what they call, in us a call
        text.write("spillway's hook functions and their callees, us a call (own / with callees):\n")
        # (a block's wrapper is "forward" in _offload.py; its callees include the block's own forward)
        hot = {"forward", "_units_call", "_acquire", "_acquire_raw", "_release", "_flush", "_place", "_point",
               "_write_back", "_own_output", "_storage_at"}
        for (path, line, name), (_, calls, tt, ct, callers) in sorted(st.stats.items(), key=lambda kv: -kv[1][2]):
            mine = path.endswith(("_offload.py", "_units.py")) and name in hot
            called = any(c[2] in hot for c in callers)
            if (mine or called) and calls:
                where = f"{path.rsplit('/', 1)[-1]}:{line}({name})" if mine else name
                text.write(f"  {where:<60} x{calls:<5} {1e6 * tt / calls:8.2f} {1e6 * ct / calls:8.2f}\n")
        res["profile"] = text.getvalue()
    return res


def greedy(model, ids, n, keep1):
    """n greedy tokens with the KV cache. Each step's tokens are read on the host, as
    generate() does for its stopping criteria (it stops on end of sequence; here the count is
    fixed), so the host runs at most one token ahead of the device, in every variant alike."""
    kw = {"logits_to_keep": 1} if keep1 else {}
    out = model(input_ids=ids, use_cache=True, **kw)
    toks = [out.logits[:, -1, :].argmax(-1, keepdim=True)]
    past = out.past_key_values
    for _ in range(n - 1):
        toks[-1].cpu()  # the host waits for this step's tokens
        out = model(input_ids=toks[-1], past_key_values=past, use_cache=True, **kw)
        past = out.past_key_values
        toks.append(out.logits[:, -1, :].argmax(-1, keepdim=True))
    return torch.cat(toks, 1)


def split_search_a(cfg, v, model, x, ref, batch):
    """Static split for (a): try every k (and placement) whose measured peak fits the budget."""
    st, n, cands = v.streamer, len(v.streamer.blocks), []
    act = 3 * x.numel() * x.element_size()
    for k in range(n + 1):
        fitted = False
        for place, ids in placements(n, k).items():
            st.attach(ids)
            if cfg.cuda:
                if torch.cuda.memory_allocated() > cfg.budget:
                    st.detach()
                    break
                torch.cuda.reset_peak_memory_stats()
            out = model(x)
            sync(cfg)
            peak = torch.cuda.max_memory_allocated() if cfg.cuda else (
                st.weights_on_device() + act)  # smoke: bytes
            if peak > cfg.budget:
                st.detach()
                break
            eq = check(out, ref, f"static split k={k}")
            del out
            times = []
            for _ in range(cfg.search_passes):
                sync(cfg)
                t = time.perf_counter()
                model(x)
                sync(cfg)
                times.append((time.perf_counter() - t) * 1e3)
            st.detach()
            fitted = True
            cands.append(dict(k=k, placement=place, ms=statistics.median(times), peak=peak, equal=eq))
        if not fitted:
            break
    good = [c for c in cands if c["equal"] is not False]
    if not good:
        raise RuntimeError(f"no static split fits the budget ({len(cands)} candidates differ)")
    best = min(good, key=lambda c: c["ms"])
    log(f"  static split batch {batch}: {len(cands)} candidates fit, best k={best['k']} {best['placement']} "
        f"{best['ms']:.2f} ms")
    st.attach(placements(n, best["k"])[best["placement"]])
    v.gpu_weight_bytes = st.weights_on_device()
    how = ("measured peak (max_memory_allocated over a pass: weights+slots+activations+workspace)"
           if cfg.cuda else "bytes (smoke, cpu: weights+slots+input+2 outputs)")
    return f"k={best['k']} ({best['placement']}) of {len(cands)} tried, fit by {how} <= budget"


def split_choose_b(cfg, v, model, ids, ref):
    """Static split for (b): k from bytes, placement by trying one prefill of each."""
    st, n = v.streamer, len(v.streamer.blocks)
    blk = max(st.block_bytes)
    act = 0
    if cfg.split_fit == "all":
        st.attach([])
        if cfg.cuda:
            held = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model(input_ids=ids, use_cache=False)
            sync(cfg)
            act = torch.cuda.max_memory_allocated() - held
        st.detach()
    k = int((cfg.budget - st.rest_bytes - act - 2 * blk) // blk)
    k = max(0, min(n, k))
    rule = (f"k={k} from bytes: rest {size_str(st.rest_bytes)} + (k + 2 slots) x {size_str(blk)} "
            + (f"+ prefill activation peak {size_str(act)} (measured once) " if cfg.split_fit == "all" else "")
            + f"<= budget {size_str(cfg.budget)}")
    best = None
    for place, pids in placements(n, k).items():
        st.attach(pids)
        out = model(input_ids=ids, use_cache=False).logits
        sync(cfg)
        eq = check(out, ref, f"static split {place}")
        del out
        sync(cfg)
        t = time.perf_counter()
        model(input_ids=ids, use_cache=False)
        sync(cfg)
        ms = (time.perf_counter() - t) * 1e3
        st.detach()
        log(f"  static split k={k} {place}: prefill {ms:.1f} ms, equal {eq}")
        if eq is not False and (best is None or ms < best[1]):
            best = (place, ms)
    if best is None:
        raise RuntimeError("every static split placement differs from the reference")
    st.attach(placements(n, k)[best[0]])
    v.gpu_weight_bytes = st.weights_on_device()
    return rule + f"; placement {best[0]} (fastest prefill of {len(placements(n, k))})"


def run_child(cfg, workload, name):
    refpath = Path(cfg.ref_dir) / f"{workload}.pt"
    is_ref = name == "resident"
    refs = {} if is_ref else (torch.load(refpath) if refpath.exists() else {})
    target = cfg.dev if is_ref else torch.device("cpu")
    t = time.perf_counter()
    model, blocks = (build_a if workload == "a" else build_b)(cfg, target)
    log(f"{workload}/{name}: model built in {time.perf_counter() - t:.1f} s")
    keep1 = workload == "b" and "logits_to_keep" in inspect.signature(model.forward).parameters
    t = time.perf_counter()
    v = attach(cfg, name, model, blocks)
    if is_ref:
        v.gpu_weight_bytes = sum(_tensor_bytes(p) for p in model.parameters())
    log(f"{workload}/{name}: attached in {time.perf_counter() - t:.1f} s")
    rows = []
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        if workload == "a":
            for batch in cfg.a_batches:
                key = f"batch {batch}"
                x = torch.randn(batch, cfg.a_dim, generator=g).to(bf16).to(cfg.dev)
                note = v.note
                if name == "static-split":
                    if v.streamer.res or v.streamer.slots:
                        v.streamer.detach()
                    note = split_search_a(cfg, v, model, x, refs.get(key), batch)
                t = time.perf_counter()
                r, out = measure(cfg, v, lambda: model(x), cfg.a_passes, refs.get(key), key,
                                 warmup=cfg.warmup)
                if is_ref:
                    refs[key] = out
                rows.append(dict(r, workload="a", phase=key, variant=name, note=note,
                                 gpu_weight_bytes=v.gpu_weight_bytes))
                log(f"a/{name} {key}: {r['ms']:.2f} ms/pass, equal {r['equal']} "
                    f"({time.perf_counter() - t:.1f} s)")
                del x
        else:
            c = cfg.b_shape
            ids = torch.randint(0, c["vocab"], (c["batch"], c["prompt"]), generator=g).to(cfg.dev)
            note = v.note
            if name == "static-split":
                note = split_choose_b(cfg, v, model, ids, refs.get("prefill"))
            accel = name.startswith("accel-")
            passes = min(cfg.prefill_passes, 3) if accel else cfg.prefill_passes
            t = time.perf_counter()
            r, out = measure(cfg, v, lambda: model(input_ids=ids, use_cache=False).logits, passes,
                             refs.get("prefill"), "prefill", warmup=0 if accel else cfg.warmup)
            if is_ref:
                refs["prefill"] = out
            del out
            key = f"prefill {c['batch']}x{c['prompt']}"
            rows.append(dict(r, workload="b", phase=key, variant=name, note=note,
                             gpu_weight_bytes=v.gpu_weight_bytes))
            log(f"b/{name} prefill: {r['ms']:.1f} ms/pass, equal {r['equal']} ({time.perf_counter() - t:.1f} s)")

            n = min(cfg.accel_tokens, cfg.tokens) if accel else cfg.tokens
            warm = n  # a whole generation: a learning policy settles on decoding steps too
            t = time.perf_counter()
            toks = greedy(model, ids, warm, keep1)  # warm-up (and plan's first step), validated
            sync(cfg)
            if is_ref:
                refs["tokens"] = toks.cpu()
            # held to the reference on its first two tokens: the resident model's own 64 differ
            # from one generation to the next (bf16 attention over a growing cache)
            head = min(2, n)
            eq = check(toks[:, :head], refs["tokens"][:, :head] if "tokens" in refs else None, "decode warm-up")
            f0, m0 = v.forwards, v.moved()
            s0 = spillway_figures(v.off) if v.off is not None else None
            reset_peak(cfg)
            times, per_step, handle = [], [], None
            if v.off is not None:  # hook us per block of each forward (a step), after spillway's wrapper
                last = [v.off.hook_ns, v.off.acquires]

                def step_hooks(mod, args, out):
                    h, a = v.off.hook_ns, v.off.acquires
                    if a > last[1]:
                        per_step.append((h - last[0]) / (a - last[1]) / 1e3)
                    last[:] = [h, a]
                handle = model.register_forward_hook(step_hooks)
            for _ in range(cfg.decode_passes):
                sync(cfg)
                t1 = time.perf_counter()
                toks = greedy(model, ids, n, keep1)
                sync(cfg)
                times.append(time.perf_counter() - t1)
            if handle is not None:
                handle.remove()
            ok = check(toks, refs.get("tokens"), "decode")
            if is_ref:  # the resident model decoding twice: is the reference itself repeatable?
                refs["decode_repeatable"] = bool(ok)
                if not ok:
                    note = (note + "; " if note else "") + ("decoding twice gave other tokens: "
                                                            "the decode comparison is void")
            elif refs.get("decode_repeatable") is False and ok is False:
                ok = None  # no reference to hold it to
                note = (note + "; " if note else "") + "tokens differ, as the resident model's own repeat did"
            eq = None if eq is None and ok is None else bool(eq is not False and ok is not False)
            sec = statistics.median(times)
            fw = (v.forwards - f0) / len(times)
            m1 = v.moved()
            r = dict(ms=sec * 1e3 / n, tok_s=c["batch"] * n / sec, tokens=n, passes=len(times),
                     forwards_per_pass=fw, equal=eq,
                     moved_bytes=((m1 - m0) / len(times) / n) if (m0 is not None and m1 is not None) else None,
                     peak_bytes=torch_peak(cfg))
            if s0 is not None:
                s1 = spillway_figures(v.off)
                if s1["hook_ns"] is not None and s1["acquires"] is not None and s1["acquires"] > s0["acquires"]:
                    r["hook_us"] = (s1["hook_ns"] - s0["hook_ns"]) / (s1["acquires"] - s0["acquires"]) / 1e3
                if per_step:
                    xs = sorted(per_step)
                    r["hook_us_per_step"] = dict(
                        steps=len(xs), p50=round(quantile(xs, 0.5), 1), p90=round(quantile(xs, 0.9), 1),
                        max=round(xs[-1], 1), above_30=sum(x > 30 for x in xs),
                        first=round(per_step[0], 1))  # the prompt's step (8 x 512 with the cache)
                r["spillway"] = s1
            dnote = note
            if accel:
                dnote = (dnote + "; " if dnote else "") + f"decode timed on {n} tokens (not {cfg.tokens})"
            if ok is None and eq:  # only the warm-up's first tokens could be held to the reference
                r["equal_scope"] = f"the first {head} tokens"
            rows.append(dict(r, workload="b", phase=f"decode {c['batch']}x{cfg.tokens}", variant=name,
                             note=dnote, gpu_weight_bytes=v.gpu_weight_bytes))
            log(f"b/{name} decode: {r['tok_s']:.1f} tok/s over {n} tokens, equal {eq} "
                f"({time.perf_counter() - t:.1f} s)")
    if is_ref:
        torch.save(refs, refpath)
    if v.off is not None:
        v.off.remove()
    return rows


# ----------------------------------------------------------------------------------------------
# the parent: link rate, one child per variant, tables


def measure_link(cfg):
    n = (1 << 30) if cfg.cuda else (64 << 20)
    src = torch.empty(n, dtype=torch.uint8, pin_memory=cfg.cuda)
    dst = torch.empty(n, dtype=torch.uint8, device=cfg.dev)
    dst.copy_(src)
    best = float("inf")
    for _ in range(3):
        sync(cfg)
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(cfg)
        best = min(best, time.perf_counter() - t)
    del src, dst
    if cfg.cuda:
        torch.cuda.empty_cache()
    return n / best / 1e9


def child_argv(args, workload, variant, ref_dir):
    argv = [sys.executable, os.path.abspath(__file__), "--child", "--workload", workload,
            "--variants", variant, "--ref-dir", ref_dir, "--budget", args.budget,
            "--tokens", str(args.tokens), "--accel-tokens", str(args.accel_tokens),
            "--passes", str(args.passes), "--prefill-passes", str(args.prefill_passes),
            "--decode-passes", str(args.decode_passes), "--search-passes", str(args.search_passes),
            "--warmup", str(args.warmup), "--split-fit", args.split_fit,
            "--spillway-options", args.spillway_options]
    if args.nondeterministic:
        argv.append("--nondeterministic")
    if args.profile:
        argv.append("--profile")
    return argv + (["--smoke"] if args.smoke else [])


def fmt(x, spec, none=""):
    return none if x is None else format(x, spec)


def print_tables(rows, link_gbps, cfg_of):
    keys = []
    for r in rows:
        if (r["workload"], r["phase"]) not in keys:
            keys.append((r["workload"], r["phase"]))
    for wl, phase in keys:
        group = [r for r in rows if (r["workload"], r["phase"]) == (wl, phase)]
        res = next((r for r in group if r["variant"] == "resident" and r.get("ms")), None)
        decode = phase.startswith("decode")
        unit = "ms/step" if decode else "ms/pass"
        print(f"\n({wl}) {phase}, budget {cfg_of(wl)}; link {link_gbps:.1f} GB/s"
              + ("; moved per step (forward)" if decode else "; moved per pass"))
        print(f"{'variant':<18}{unit:>9}{'tok/s':>8}{'moved MiB':>10}{'bound ms':>9}{'vs link':>8}"
              f"{'x res':>7}{'GPU wts MiB':>12}{'torch pk':>9}{'hook us':>8}  result")
        for r in group:
            if r.get("ms") is None:
                print(f"{r['variant']:<18}  {'skipped' if r.get('skipped') else 'ERROR'}: {r.get('error')}")
                continue
            mv = r.get("moved_bytes")
            bound = mv / (link_gbps * 1e6) if mv else None
            vs = bound / r["ms"] if bound else None
            xr = r["ms"] / res["ms"] if res else None
            hook = r.get("hook_us")
            if r.get("gpu_weight_bytes") is None and r.get("spillway"):
                r["gpu_weight_bytes"] = r["spillway"].get("held_peak")  # its peak held bytes
            result = ("reference" if r["variant"] == "resident" else
                      "no reference" if r.get("equal") is None else
                      "DIFFERS" if not r["equal"] else
                      f"bitwise equal on {r['equal_scope']}" if r.get("equal_scope") else "bitwise equal")
            hook_s = fmt(hook, ".1f") + ("!" if hook is not None and hook > 30 else "")
            if r["variant"].startswith("spillway") and hook is None:
                hook_s = "n/a"
            print(f"{r['variant']:<18}{r['ms']:>9.2f}{fmt(r.get('tok_s'), '.1f'):>8}"
                  f"{fmt(mv and mv / MiB, '.0f', '?'):>10}{fmt(bound, '.2f'):>9}{fmt(vs, '.3f'):>8}"
                  f"{fmt(xr, '.2f'):>7}{fmt(r.get('gpu_weight_bytes') and r['gpu_weight_bytes'] / MiB, '.0f'):>12}"
                  f"{fmt(r.get('peak_bytes') and r['peak_bytes'] / MiB, '.0f'):>9}{hook_s:>8}  {result}")
            if r.get("note"):
                print(f"{'':<18}  {r['note']}")
            if r.get("spillway"):
                fig = {k: x for k, x in r["spillway"].items() if k != "stats"}
                print(f"{'':<18}  spillway_figures: {fig}")
            if r.get("hook_us_per_pass"):
                print(f"{'':<18}  hook us per block, pass by pass: {r['hook_us_per_pass']}; host waits of trims "
                      f"in the timed passes and the one before: {r.get('trim_syncs_timed')}; units re-pointed "
                      f"per pass: {r.get('view_builds_per_pass')}")
            if r.get("hook_us_per_step"):
                q = r["hook_us_per_step"]
                print(f"{'':<18}  hook us per block, step by step: p50 {q['p50']}, p90 {q['p90']}, max {q['max']} "
                      f"over {q['steps']} steps ({q['above_30']} above 30 us; the prompt's step {q['first']})")
            if r.get("lock_waits_per_block") is not None:
                print(f"{'':<18}  waits for the context lock per block acquired: {r['lock_waits_per_block']:.2f}, "
                      f"{r['lock_wait_us_per_block']:.1f} us")
            if r.get("c_calls"):
                cc = r["c_calls"]
                parts = [f"{n} x{c['n']} p50 {c['p50']:.1f} p90 {c['p90']:.1f} p99 {c['p99']:.1f} max {c['max']:.0f} us"
                         f" ({c['total_ms']:.2f} ms)" for n, c in cc.items() if isinstance(c, dict)]
                print(f"{'':<18}  C calls over 2 more passes: {'; '.join(parts)}; hooks {cc['hooks_total_ms']:.2f} ms")
                if cc.get("profile"):
                    print(cc["profile"])
        if any(r.get("hook_us", 0) > 30 for r in group):
            print("  ! hook host time per acquire above 30 us")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=["a", "b", "all"], default="all")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ",".join(VARIANTS))
    p.add_argument("--budget", default=None,
                   help="device budget: 'A,B' for workloads a and b, or one size for both "
                        "(default 2GiB,6GiB; --smoke 4MiB,4MiB)")
    p.add_argument("--tokens", type=int, default=None, help="decode: new tokens (default 64; smoke 8)")
    p.add_argument("--accel-tokens", type=int, default=4, help="decode tokens timed for accelerate")
    p.add_argument("--passes", type=int, default=6, help="(a): passes per batch, first is validation")
    p.add_argument("--warmup", type=int, default=48,
                   help="untimed passes after the validation one, for every variant but accelerate's "
                        "(plan learns in its first step, times its four pipelines over the next twelve, "
                        "and may move to the one it keeps in the step after; after (a)'s change of batch "
                        "its recheck, within 32 steps, times them again)")
    p.add_argument("--prefill-passes", type=int, default=8, help="(b) prefill: passes, first is validation "
                   "(accelerate's: at most 3)")
    p.add_argument("--decode-passes", type=int, default=1, help="(b) decode: timed generations after a warm-up")
    p.add_argument("--search-passes", type=int, default=2, help="(a) static split: timed passes per candidate")
    p.add_argument("--split-fit", choices=["auto", "all", "weights"], default="auto",
                   help="static split of (b): weights only (auto) or weights + prefill activation peak")
    p.add_argument("--nondeterministic", action="store_true",
                   help="leave torch's default kernels (by default every process runs with "
                        "torch.use_deterministic_algorithms and CUBLAS_WORKSPACE_CONFIG=:4096:8, so "
                        "that the resident model decodes the same tokens twice and the decode can be "
                        "compared bitwise)")
    p.add_argument("--spillway-options", default="",
                   help="more options for the spillway rows' offload(): 'vmm=off,vmm_large_page=32MiB'")
    p.add_argument("--child-timeout", type=int, default=300, help="seconds per variant process")
    p.add_argument("--profile", action="store_true",
                   help="spillway rows: one more pass under cProfile, its top functions printed")
    p.add_argument("--json", help="write all rows to this file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the cpu: the control flow only")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ref-dir", help=argparse.SUPPRESS)
    args = p.parse_args()

    budgets = (args.budget or ("4MiB,4MiB" if args.smoke else "2GiB,6GiB")).split(",")
    if len(budgets) == 1:
        budgets *= 2
    args.budget = ",".join(budgets)
    if args.tokens is None:
        args.tokens = 8 if args.smoke else 64
    if args.passes < 2 or args.prefill_passes < 2 or args.decode_passes < 1 or args.search_passes < 1:
        p.error("--passes and --prefill-passes must be >= 2 (the first validates), the others >= 1")
    variants = [s.strip() for s in args.variants.split(",") if s.strip()]
    for s in variants:
        if s not in VARIANTS:
            p.error(f"unknown variant {s!r}; known: {', '.join(VARIANTS)}")
    workloads = ["a", "b"] if args.workload == "all" else [args.workload]

    cfg = types.SimpleNamespace(smoke=args.smoke, profile=args.profile, tokens=args.tokens, accel_tokens=args.accel_tokens,
                                a_passes=args.passes, prefill_passes=args.prefill_passes,
                                decode_passes=args.decode_passes, search_passes=args.search_passes,
                                warmup=args.warmup, ref_dir=args.ref_dir)
    try:
        cfg.spw_options = dict(kv.split("=", 1) for kv in args.spillway_options.split(",") if kv.strip())
    except ValueError:
        p.error(f"--spillway-options: {args.spillway_options!r} is not a list of key=value")
    cfg.dev = torch.device("cpu") if args.smoke else torch.device("cuda", 0)
    cfg.cuda = cfg.dev.type == "cuda"
    if cfg.cuda and not torch.cuda.is_available():
        p.error("no CUDA device (use --smoke for the cpu control-flow check)")
    if args.smoke:
        cfg.a_layers, cfg.a_dim, cfg.a_batches = 8, 256, [4, 64]
        cfg.b_shape = B_SHAPE_SMOKE
    else:
        cfg.a_layers, cfg.a_dim, cfg.a_batches = 32, 8192, [16, 4096]
        cfg.b_shape = B_SHAPE
    cfg.split_fit = "weights" if args.split_fit == "auto" else args.split_fit

    if args.child:
        if not args.nondeterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            leave_out_cudnn_attention()
        wl = workloads[0]
        cfg.budget_str = budgets[0 if wl == "a" else 1]
        cfg.budget = parse_size(cfg.budget_str)
        try:
            rows = run_child(cfg, wl, variants[0])
        except Skip as e:
            rows = [dict(workload=wl, phase="*", variant=variants[0], skipped=True, error=str(e))]
        except Exception as e:  # noqa: BLE001 - reported in the table, the other variants still run
            traceback.print_exc()
            rows = [dict(workload=wl, phase="*", variant=variants[0], error=f"{type(e).__name__}: {e}")]
        print("@@RESULT " + json.dumps(rows), flush=True)
        return 0

    link = measure_link(cfg)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cfg.cuda else 'cpu (smoke)'}; "
          f"link {link:.1f} GB/s {'pinned host to device (1 GiB, best of 3)' if cfg.cuda else 'host memcpy (smoke)'}")
    ref_dir = tempfile.mkdtemp(prefix="spillway_offload_ref_", dir="/tmp")
    rows = []
    env = dict(os.environ, TORCH_OFFLOAD_T0=repr(T0))
    if not args.nondeterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    print(f"kernels: {'torch defaults' if args.nondeterministic else 'deterministic (use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG=:4096:8)'}")
    if cfg.spw_options:
        print(f"spillway rows: offload(..., {', '.join(f'{k}={v!r}' for k, v in cfg.spw_options.items())})")
    for wl in workloads:
        order = ["resident"] + [s for s in variants if s != "resident"]  # the reference comes first
        for name in order:
            t = time.perf_counter()
            log(f"({wl}) {name}: starting")
            try:
                proc = subprocess.run(child_argv(args, wl, name, ref_dir), stdout=subprocess.PIPE,
                                      text=True, timeout=args.child_timeout, env=env)
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("@@RESULT ")]
                if not lines:
                    raise RuntimeError(f"process exited {proc.returncode} without a result")
                got = json.loads(lines[-1][len("@@RESULT "):])
            except Exception as e:  # noqa: BLE001
                got = [dict(workload=wl, phase="*", variant=name, error=f"{type(e).__name__}: {e}")]
            rows.extend(got)
            log(f"({wl}) {name}: done in {time.perf_counter() - t:.1f} s")
            if args.json:  # what has run so far survives a timeout of the whole benchmark
                with open(args.json + ".partial", "w") as f:
                    json.dump(dict(torch=torch.__version__, link_gbps=link, budgets=budgets, rows=rows), f)
    # A variant that failed as a whole gets an error row in every phase of its workload.
    phases = {}
    for r in rows:
        if r["phase"] != "*":
            phases.setdefault(r["workload"], [])
            if r["phase"] not in phases[r["workload"]]:
                phases[r["workload"]].append(r["phase"])
    out = []
    for r in rows:
        out.extend([dict(r, phase=ph) for ph in phases.get(r["workload"], ["(all)"])] if r["phase"] == "*" else [r])
    rows = out
    for r in rows:
        mv = r.get("moved_bytes")
        if r.get("ms") and mv:
            r["link_bound_ms"] = mv / (link * 1e6)
            r["vs_link"] = r["link_bound_ms"] / r["ms"]
    print_tables(rows, link, lambda wl: budgets[0 if wl == "a" else 1])
    log("done")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, link_gbps=link, budgets=budgets, rows=rows), f, indent=1)
    bad = [r for r in rows if r["variant"].startswith("spillway") and not r.get("skipped")
           and r.get("equal") is not True]
    if bad:
        print(f"\n{len(bad)} spillway row(s) not bitwise equal to all-resident (or failed)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
