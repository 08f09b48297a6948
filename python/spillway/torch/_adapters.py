"""peft-style adapter layers (a module with a `base_layer`: peft's LoRA and its kin) over an
offloaded base, between forwards.

Merges: an adapter layer's merge() and unmerge() add the adapter into the base weight in place
through .data (merge_adapter(), merge_and_unload(), a diffusers pipeline's fuse_lora()), which
no version counter sees (_edits), and with the adapters on the device and the base's weights in
host memory between forwards that add would mix devices. So they are wrapped (watch_merges).

Unloads: merge_and_unload(), unload() and a pipeline's unload_lora_weights() put each adapter
layer's base layer in its place. Where the partition made adapter layers units (or the first or
last module of one), their base layers would then run unhooked, from the host views (on CUDA a
device mismatch), also when the caller goes on with the unwrapped model merge_and_unload()
returns, whose forward is not the offloaded module's. So each such base layer's forward is
wrapped ahead (stand_by): called by its adapter layer, which holds the units, it runs as it is;
called without them, it acquires them itself. And the model merge_and_unload() (or unload())
returns gets a top-level forward of its own (follow_unloads), so that its forwards are the
plan's steps as the offloaded module's were."""
from __future__ import annotations

import threading
import time
from typing import Any, Iterable, List

import torch
from torch import nn

from . import _methods, _patch
from ._units import _Unit


def watch_merges(off: Any, modules: Iterable[nn.Module]) -> None:
    """Wrap merge() and unmerge() of every adapter layer among modules (a module with a
    `base_layer` and those methods: peft's LoRA and its kin), which add the adapter into the base weight in
    place through .data. Between forwards the layer's offloaded tensors (the base's, and the
    adapters' too where they are frozen, as a pipeline's loaded LoRA is) are host views, and
    the rest sits on the device, where that add would mix devices: for the call, each of them
    is a copy on the offload's device, and after it the values (merged) go back into the host
    view, the parameter points at it again, and the device copies of its units are dropped
    (Offload._evict_units). remove() puts the methods back."""
    unit_of = {id(e.tensor): u for u in off.units if not u.trains for e in u.entries}
    for m in modules:
        base = getattr(m, "base_layer", None)
        if not isinstance(base, nn.Module) or base is m:
            continue
        params = [p for p in m.parameters() if id(p) in unit_of]
        units = list({id(unit_of[id(p)]): unit_of[id(p)] for p in params}.values())
        if not units:
            continue
        for name in ("merge", "unmerge"):
            fn = getattr(m, name, None)
            if callable(fn):
                _methods.install(off, m, name, _merged_on_device(fn, off, params, units))


def _merged_on_device(fn: Any, off: Any, params: List[torch.Tensor], units: List[_Unit]) -> Any:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if off._closed:
            return fn(*args, **kwargs)
        off._check_between_forwards("an adapter merged")
        views = [p.data for p in params]
        for p, v in zip(params, views):
            p.data = v.to(off.device, copy=True)  # a copy also where the device is the host's (emu)
        try:
            return fn(*args, **kwargs)
        finally:
            with torch.no_grad():
                for p, v in zip(params, views):
                    v.copy_(p.data)  # the device copy, or the new tensor fn put there
                    p.data = v
            off._evict_units(units)
    return call


def stand_by(off: Any, hooked: List[nn.Module]) -> None:
    """Wrap the forward of the base layer of every hooked adapter layer (not hooked itself) so
    that it acquires the adapter layer's units whenever they are not held (see the module's
    docstring); down a chain of base layers (an adapter layer over another), each of them, since
    peft puts the innermost in place. remove() unwraps them with the rest."""
    for m in hooked:
        base, seen = getattr(m, "base_layer", None), {id(m)}
        while isinstance(base, nn.Module) and id(base) not in seen:
            seen.add(id(base))
            if id(base) not in off._needs:
                _patch.wrap_forward(off, base, _standing_by(off, base, base.forward, off._needs[id(m)]))
            base = getattr(base, "base_layer", None)


def _standing_by(off: Any, module: nn.Module, inner: Any, units: List[_Unit]) -> Any:
    every, inner_units = off._hook_units(units)

    def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if mod is not module:
            return _patch.copied_forward(mod, args, kwargs)
        need = inner_units if off._depth else every
        if off._depth and off._owner != threading.get_ident():  # another thread runs the forward
            return off._units_call(inner, every, inner_units, args, kwargs, time.perf_counter_ns())
        for u in need:
            if not u.refs:
                return off._units_call(inner, every, inner_units, args, kwargs, time.perf_counter_ns())
        return inner(*args, **kwargs)  # its adapter layer holds the units
    return forward


def follow_unloads(off: Any, module: nn.Module, wrap_top: Any) -> None:
    """Wrap merge_and_unload() and unload() of every module in module's tree that has them
    (peft's PeftModel and the tuner model under it): the module they return, when it is a part
    of the offloaded tree and not the offloaded module itself, gets a top-level forward
    (wrap_top(off, it), _build's)."""
    for m in module.modules():
        for name in ("merge_and_unload", "unload"):
            fn = getattr(m, name, None)
            if callable(fn):
                _methods.install(off, m, name, _unloading(fn, off, module, wrap_top))


def _unloading(fn: Any, off: Any, root: nn.Module, wrap_top: Any) -> Any:
    def call(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if (not off._closed and isinstance(out, nn.Module) and out is not root and id(out) not in off._tops
                and any(out is m for m in root.modules())):
            off._tops.add(id(out))
            wrap_top(off, out)
        return out
    return call
