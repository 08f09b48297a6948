"""What an offload changes on the caller's objects, and remove(), which puts it all back: forwards
wrapped, a model class swapped for one that reports the execution device, conversions
(.to(), .cuda(), .half()) that leave the offloaded tensors alone, tensors restored to their
devices, the trained parameters' state, the buffers and the context."""
from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from .. import errors as _errors
from ..errors import ConfigError
from . import _added, _experts, _methods, _parallel, _train, _wrapped
from ._setup import ACTIVE


def swap_device_property(off: Any, module: nn.Module) -> None:
    """A model class with a `device` property (transformers' PreTrainedModel: the first
    parameter's device) would report the host between forwards, where the parameters are
    host views, and generate() would build its inputs there. The instance gets a subclass
    whose `device` is the execution device; remove() gives the original class back."""
    cls = type(module)
    off._orig_class = None
    if not isinstance(getattr(cls, "device", None), property):
        return
    dev = off.device
    sub = type(cls.__name__, (cls,), {"device": property(lambda _self: dev),
                                      "__module__": cls.__module__})
    module.__class__ = sub
    off._orig_class = cls


def guard_conversions(off: Any, module: nn.Module) -> None:
    """module.to(), .cuda(), .cpu(), .half(), .float(), .to_empty() and the like all run
    nn.Module._apply(fn) over every tensor of the tree. On an offloaded module that would
    convert the host views the modules hold between forwards: the whole model copied to the
    device beside the offload (a habit: pipe.to("cuda"), a trainer moving its model), or its
    weights cut off from the packs. The top module's _apply becomes one that leaves the
    offloaded tensors where they are when fn keeps their dtype (whatever device it names: the
    offload brings them to its device as each forward needs them) and raises ConfigError,
    changing nothing, when it would change their dtype; the other tensors (trainable
    parameters kept on the device) convert as usual. remove() puts the method back."""
    dtypes = sorted({e.dtype for u in off.units for e in u.entries}, key=str)
    inner = module._apply  # the class's, or an instance attribute already there

    def _apply(self: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if off._closed:
            return inner(fn, *args, **kwargs)
        for dt in dtypes:
            got = fn(torch.empty(0, dtype=dt)).dtype
            if got != dt:
                raise ConfigError(f"offload: this conversion would turn the offloaded {dt} weights of "
                                  f"{type(self).__name__} into {got}; convert the model before offload() "
                                  "(remove() the offload first)")
        ids = {id(e.tensor) for u in off.units for e in u.entries}
        ids.update(id(p) for f in off._fused.values() for p in f.params)
        hidden = [(d, k, t) for m in self.modules() for d in (m._parameters, m._buffers)
                  for k, t in d.items() if t is not None and id(t) in ids]
        for d, k, _ in hidden:
            d[k] = None  # _apply passes over None
        try:
            return inner(fn, *args, **kwargs)
        finally:
            for d, k, t in hidden:
                d[k] = t

    _methods.install(off, module, "_apply", _apply)


def copied_forward(mod: nn.Module, args: Any, kwargs: Any) -> Any:
    """The forward of a deep copy of a module whose forward an offload wrapped: its class's, on
    the copy's own tensors (copies of the host views), with nothing acquired or recomputed."""
    return type(mod).forward(mod, *args, **kwargs)


def wrap_forward(off: Any, m: nn.Module, forward: Any) -> None:
    """Make forward(m, ...) m's forward: an instance attribute, functools.partial(forward, m),
    as accelerate's hooks are. The partial holds the module, so a deep copy of it holds the
    copy, and forward can tell the two apart (a copy runs its class's forward: it was made
    from the host views and is not offloaded). undo() puts back what was there."""
    inner = m.forward
    wrapped = functools.partial(forward, m)
    # inspect.signature(m.forward) follows __wrapped__: generate() and friends that read the
    # forward's parameters still see the real ones.
    wrapped.__wrapped__ = inner  # type: ignore[attr-defined]
    for attr in ("__doc__", "__name__", "__qualname__"):
        if hasattr(inner, attr):
            setattr(wrapped, attr, getattr(inner, attr))
    off._wrapped.append((m, "forward" in m.__dict__, m.__dict__.get("forward")))
    m.forward = wrapped  # type: ignore[method-assign]


def _fresh(e: Any) -> torch.Tensor:
    """A copy of entry e's host view in its own memory, where and as the tensor was at offload()."""
    fresh = torch.empty_strided(e.shape, e.orig_stride, dtype=e.dtype, device=e.orig_device)
    with torch.no_grad():
        fresh.copy_(e.host_view)
    return fresh


def undo(off: Any) -> None:
    """Restore whatever was moved so far (also the rollback of a failed offload())."""
    if getattr(off, "_open_step", False):
        try:
            off._end_open_step()
        except _errors.Error:
            pass  # the context goes anyway; nothing to keep
    upd = getattr(off, "_update", None)
    if upd is not None:  # its error is the caller's to see before; the parameters stay as it left them
        off._update = None
        upd.finish()
    if getattr(off, "_ahead", None) is not None:  # it reads the packs that go below
        off._ahead.close()
        off._ahead = None
    off._closed = True
    ACTIVE.pop(off.module, None)
    _added.unwatch(off)
    for obj, name, had, prev, ours in reversed(getattr(off, "_method_wraps", [])):
        if obj.__dict__.get(name) is ours:  # else something wrapped it since (an LR scheduler): ours only calls through
            if had:
                setattr(obj, name, prev)
            else:
                delattr(obj, name)
    off._method_wraps = []
    for hooks, key, hook, ours in reversed(getattr(off, "_prehooks", [])):  # _prehooks.wrap
        if hooks.get(key) is ours:  # else the caller removed it: it stays removed
            hooks[key] = hook
    off._prehooks = []
    if getattr(off, "_update_pool", None) is not None:
        off._update_pool.close()
        off._update_pool = None
    for m, had, old in reversed(getattr(off, "_wrapped", [])):
        if had:
            m.forward = old  # type: ignore[method-assign]
        else:
            m.__dict__.pop("forward", None)
    off._wrapped = []
    if getattr(off, "_orig_class", None) is not None:
        off.module.__class__ = off._orig_class
        off._orig_class = None
    for f in getattr(off, "_fused", {}).values():
        _experts.undo(f)
    for u in off.units:
        for e in u.entries:
            if e.parts and e.parts[0].host_view is not None:
                _wrapped.set_leaves(e.tensor, e.tree, [_fresh(p) for p in e.parts])
                for p in e.parts:
                    p.host_view = None
            if e.host_view is None:
                continue
            e.tensor.data = _fresh(e)
            e.host_view = None
        u.host_pairs = ()
        u.dev_set, u.dev_sets, u.dev_ptrs = None, {}, ()
        u.dev_at = 0
    for p, orig in off._moved_trainable:
        p.data = p.data.to(orig)
        if p.grad is not None:  # a parameter trained on the device (train_on_device): its gradient too
            p.grad = p.grad.to(orig)
    off._moved_trainable = []
    if getattr(off, "_train", False):  # gradients and optimizer state to their parameters' devices
        _train.from_host(off, off.optimizer)
    if getattr(off, "_average", None) is not None:
        off._average.close()
    if getattr(off, "_ddp_hidden", None) is not None:
        _parallel.show_offloaded(off.module, off._ddp_hidden)
        off._ddp_hidden = None
    for h in getattr(off, "_grad_hooks", ()):
        h.remove()
    off._grad_hooks = []
    ctx = off.context
    for spare in getattr(off, "_stash_pool", {}).values():
        for b in spare.values():
            b.close()
    off._stash_pool = {}
    off._stash_slots = []
    for u in off.units:
        if u.buf is not None:
            u.buf.close()
            u.buf = None
        u.pack = None
    if not ctx.closed:
        off.final_stats = ctx.stats()
        if getattr(off, "_owns_context", False):
            ctx.close()
