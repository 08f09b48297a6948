"""Tiny models for the offload tests (CPU, deterministic)."""
from __future__ import annotations

import copy
import math
from typing import Optional, Tuple

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        q, k = q * cos + q.flip(-1) * sin, k * cos + k.flip(-1) * sin  # a rotary-like mix
        if cache is not None:
            k = torch.cat([cache[0], k], 1)
            v = torch.cat([cache[1], v], 1)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // self.heads)
        s = k.shape[1]
        mask = torch.ones(t, s, dtype=torch.bool, device=x.device).tril(s - t)
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, d)
        return self.out(y), (k, v)


class Layer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, cos, sin, cache=None):
        a, kv = self.attn(self.norm1(x), cos, sin, cache)
        x = x + a
        return x + self.mlp(self.norm2(x)), kv


class Rotary(nn.Module):
    def __init__(self, head_dim: int, max_len: int = 64) -> None:
        super().__init__()
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, dtype=torch.float32) / head_dim))
        ang = torch.arange(max_len, dtype=torch.float32)[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos())
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, start: int, length: int):
        return self.cos[start:start + length, None, :], self.sin[start:start + length, None, :]


class TinyDecoder(nn.Module):
    """Embedding, a ModuleList of layers, a rotary buffer, a final norm, a tied lm_head."""

    def __init__(self, vocab: int = 97, dim: int = 32, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.rotary = Rotary(dim // heads)
        self.layers = nn.ModuleList(Layer(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied

    def forward(self, ids: torch.Tensor, caches=None, start: int = 0):
        x = self.embed(ids)
        cos, sin = self.rotary(start, ids.shape[1])
        new = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, None if caches is None else caches[i])
            new.append(kv)
        return self.lm_head(self.norm(x)), new


def make_decoder(seed: int = 0, **kw) -> TinyDecoder:
    torch.manual_seed(seed)
    m = TinyDecoder(**kw)
    with torch.no_grad():  # LayerNorm starts at ones/zeros: make the norms matter
        for mod in m.modules():
            if isinstance(mod, nn.LayerNorm):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.1, 0.1)
    return m.eval()


def step_pair(loss, want, opt, opt_ref) -> None:
    """One training step of a model and of its reference: both backwards, both optimizer
    steps, both gradients cleared."""
    loss.backward()
    want.backward()
    opt.step()
    opt_ref.step()
    opt.zero_grad()
    opt_ref.zero_grad()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to b's largest element (an elementwise ratio is
    arbitrarily large where b is near zero)."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def sync_reference(ref: nn.Module, master: nn.Module, *opts) -> None:
    """After a step of a reference whose optimizer runs on a host master copy: the master's
    parameters copied into the device model ref, and the gradients of opts and ref cleared."""
    with torch.no_grad():
        for q, h in zip(ref.parameters(), master.parameters()):
            q.copy_(h)
    for o in opts:
        o.zero_grad(set_to_none=True)
    ref.zero_grad(set_to_none=True)


def make_stack(seed: int = 0, dim: int = 64, depth: int = 6) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(dim, dim), nn.Tanh()]
    return nn.Sequential(*layers).eval()


class WithAdapter(nn.Module):
    """Eight Linear(dim, dim) and, when one is set, an adapter added to their output (a module
    added after offload(), as peft adds adapters)."""

    def __init__(self, dim: int = 512) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(8))
        self.adapter: Optional[nn.Module] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x if self.adapter is None else x + self.adapter(x)


class GEGLU(nn.Module):
    """A gated feed-forward, as diffusion transformers have: its projection's output split in two
    views whose rows step over each other's columns, both saved for backward."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, 8 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, gate = self.proj(x).chunk(2, dim=-1)
        return x + self.out(h * F.gelu(gate))


def greedy(model, ids: torch.Tensor, steps: int):
    """A KV-cache generation loop: the prompt, then one token per forward."""
    logits, caches = model(ids)
    out = [logits]
    pos = ids.shape[1]
    tok = logits[:, -1:].argmax(-1)
    for _ in range(steps):
        logits, caches = model(tok, caches, pos)
        out.append(logits)
        pos += 1
        tok = logits[:, -1:].argmax(-1)
    return out


def frozen(m: nn.Module) -> nn.Module:
    """m with every parameter frozen (what offload moves), returned for chaining."""
    return m.requires_grad_(False)


def same(a, b) -> bool:
    """Bitwise equality of two outputs: tensors, or nested tuples/lists of them."""
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def offloaded_bytes(off) -> int:
    return sum(u.nbytes for u in off.units)


def moved(off, fn):
    """fn()'s result and the bytes the offload uploaded while it ran; asserts they are at least
    the offloaded bytes that do not fit the budget (each is used, so at least that much must
    come in): a model that silently fits its budget proves nothing about offloading."""
    total, budget = offloaded_bytes(off), off.context.budget
    assert total > budget, f"the test model fits its budget ({total} <= {budget} B): nothing would move"
    before = off.context.stats()["bytes_h2d"]["total"]
    out = fn()
    n = off.context.stats()["bytes_h2d"]["total"] - before
    assert n >= total - budget, f"moved {n} B in the step, below {total - budget} B (offloaded {total}, budget {budget})"
    return out


def fail_at_call(monkeypatch, owner, name: str, n: int) -> list:
    """Replace owner.name (through monkeypatch) by the original that raises
    RuntimeError("injected failure") at its n-th call instead; returns the list the calls are
    counted in (one entry a call)."""
    real, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    return calls


class Checkpointed(nn.Module):
    """Blocks run under torch.utils.checkpoint: their saved tensors belong to checkpoint's hooks
    in forward, and their recomputation in backward calls the offloaded blocks again."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(1024, 1024) for _ in range(6))
        self.a = nn.Parameter(torch.randn(1024, 8) * 0.02)
        self.reentrant = reentrant

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        for b in self.blocks:
            x = checkpoint(lambda h, b=b: torch.tanh(b(h)) + h @ self.a @ self.a.t(), x,
                           use_reentrant=self.reentrant)
        return x


def check_backward_composes(how: str, device: torch.device, **offload_args) -> None:
    """Checkpointed's blocks offloaded (24 MiB under 10 MiB) with `how` ("checkpoint",
    "checkpoint-reentrant", "save_on_cpu" around the forward): two steps, losses and gradients
    bitwise equal to the resident copy's, the weights moving in each forward."""
    import spillway.torch as spt
    torch.manual_seed(0)
    m = Checkpointed(reentrant=how == "checkpoint-reentrant").to(device)
    for b in m.blocks:
        b.requires_grad_(False)
    ref = copy.deepcopy(m)
    x = torch.randn(4, 1024, device=device, requires_grad=True)
    xr = x.detach().clone().requires_grad_()
    off = spt.offload(m, budget="10MiB", **offload_args)
    for _ in range(2):
        if how == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda"):
                loss = moved(off, lambda: m(x).square().mean())
        else:
            loss = moved(off, lambda: m(x).square().mean())
        want = ref(xr).square().mean()
        assert torch.equal(loss, want)
        loss.backward()
        want.backward()
        assert torch.equal(m.a.grad, ref.a.grad) and torch.equal(x.grad, xr.grad)
        m.a.grad = ref.a.grad = x.grad = xr.grad = None
    off.remove()


# ---- quantized weights in a wrapper subclass (torchao's, optimum-quanto's) ----

class WrappedInt8(torch.Tensor):
    """An int8 weight with a scale per row, as torchao's and quanto's quantized tensors are: a
    wrapper subclass with no storage of its own, whose data are two plain tensors it holds
    (__tensor_flatten__ names them, __tensor_unflatten__ rebuilds it); linear dequantizes."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=scale.dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor) -> None:
        self.qdata, self.scale = qdata, scale

    @classmethod
    def quantize(cls, w: torch.Tensor) -> "WrappedInt8":
        scale = w.abs().amax(1) / 127
        return cls(torch.round(w / scale[:, None]).to(torch.int8), scale)

    def __tensor_flatten__(self):
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, size, stride):
        return WrappedInt8(inner["qdata"], inner["scale"])

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(self.scale.dtype) * self.scale[:, None]

    def __repr__(self) -> str:
        return f"WrappedInt8({tuple(self.shape)}, {self.qdata.device})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, w, b = (list(args) + [kwargs.get("bias")])[:3]
            return F.linear(x, w.dequantize(), b)
        with torch._C.DisableTorchFunction():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func is aten.detach.default:
            return type(args[0])(args[0].qdata, args[0].scale)
        if func is aten.clone.default:
            return type(args[0])(args[0].qdata.clone(), args[0].scale.clone())
        if func is aten.copy_.default:  # load_state_dict: the data copied in place
            args[0].qdata.copy_(args[1].qdata)
            args[0].scale.copy_(args[1].scale)
            return args[0]
        raise NotImplementedError(f"WrappedInt8: {func}")


class NestedInt8(WrappedInt8):
    """A wrapper holding a wrapper, as torchao's AffineQuantizedTensor holds its tensor_impl."""

    @staticmethod
    def __new__(cls, impl: WrappedInt8):
        return torch.Tensor._make_wrapper_subclass(cls, impl.shape, dtype=impl.dtype, device=impl.device)

    def __init__(self, impl: WrappedInt8) -> None:
        self.impl = impl

    def __tensor_flatten__(self):
        return ["impl"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, size, stride):
        return NestedInt8(inner["impl"])

    def dequantize(self) -> torch.Tensor:
        return self.impl.dequantize()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return NestedInt8(args[0].impl)
        if func is torch.ops.aten.clone.default:
            return NestedInt8(WrappedInt8(args[0].impl.qdata.clone(), args[0].impl.scale.clone()))
        if func is torch.ops.aten.copy_.default:
            args[0].impl.qdata.copy_(args[1].impl.qdata)
            args[0].impl.scale.copy_(args[1].impl.scale)
            return args[0]
        raise NotImplementedError(f"NestedInt8: {func}")


class _SavesWeight(torch.autograd.Function):
    """A linear layer over a WrappedInt8 weight that saves the weight itself for backward, as an
    autograd function of a quantization library may."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(w)
        return F.linear(x, w.dequantize(), b)

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g @ w.dequantize(), None, None


class SavingLinear(nn.Module):
    """A frozen WrappedInt8 linear layer whose backward reads the weight it saved."""

    def __init__(self, n: int) -> None:
        super().__init__()
        lin = nn.Linear(n, n)
        self.weight = nn.Parameter(WrappedInt8.quantize(lin.weight.detach()), requires_grad=False)
        self.bias = nn.Parameter(lin.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SavesWeight.apply(x, self.weight, self.bias)


def wrapped_linear(n: int, nested: bool = False) -> nn.Linear:
    lin = nn.Linear(n, n)
    w = WrappedInt8.quantize(lin.weight.detach())
    lin.weight = nn.Parameter(NestedInt8(w) if nested else w, requires_grad=False)
    return lin


# ---- quantized weights in a Parameter subclass (diffusers' GGUFParameter, bitsandbytes' Params4bit) ----

class QuantParam(nn.Parameter):
    """int8 data whose scale is an attribute, re-wrapping what torch functions return as
    GGUFParameter does (so the attribute follows slices and views)."""

    def __new__(cls, data, requires_grad=False, scale=None):
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        self.scale = scale
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        result = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(result, torch.Tensor) and not isinstance(result, cls):
            scale = next((a.scale for a in args if isinstance(a, cls)), None)
            return cls(result, scale=scale)
        return result


class QuantLinear(nn.Module):
    """A Linear of QuantParam weights, dequantized in its forward from the attribute."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = QuantParam(torch.randint(-127, 128, (n, n), dtype=torch.int8), scale=1 / 64)
        self.bias = nn.Parameter(torch.randn(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.as_subclass(torch.Tensor).float() * self.weight.scale  # reads the attribute
        return F.linear(x, w, self.bias)
