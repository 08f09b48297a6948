"""Forward pre-hooks of the caller's own on hooked modules, run with the module's units acquired.

nn.Module runs its forward pre-hooks before the forward, so before the wrapper that brings the
weights. A pre-hook that reads them would see the host views: torch's weight_norm computes
`weight` from `weight_g` and `weight_v` in one (diffusers' audio autoencoders, HiFi-GAN
vocoders), spectral_norm and prune likewise; on CUDA the forward then gets a host tensor and
torch raises a device mismatch. So offload() replaces each pre-hook present on a hooked module
below the top level (there, only those three) by an _Acquiring that acquires the module's
units around it (inside the top-level forward its release is left pending, and the forward's
own acquire then finds the unit still held: no second C call). Hooks registered after
offload() are wrapped the same way before the next top-level forward (wrap_late): every hook
registration anywhere takes an id from torch's RemovableHandle counter, so one comparison per
forward tells whether any was made since the last look, and only then are the hooked modules'
pre-hook dicts walked. The dicts stay torch's own objects: handles registered before offload()
still remove their hooks. A hooked module called outside the top-level forward (a pipeline's
vae.decode) before any top-level forward has run is the one case that does not look first.

The weights these three hooks compute are fresh device tensors stored as plain attributes of
the module; left there they would keep a device copy of every such weight outside the budget.
The forward of such a module is wrapped once more so that, after it, the attribute holds again
what it held at offload(), on the CPU (a copy made then if it was on the device: computed by a
forward before offload()). So is the forward of such a module that is not hooked itself but
lies inside a hooked one's unit (a block of weight-normed convolutions that is one unit): its
pre-hook runs with the block's units acquired already, and only the restore is needed. Between forwards the attribute is stale, as it is after
load_state_dict on a resident model until its next forward.

remove() puts the caller's hooks back where ours still stand."""
from __future__ import annotations

import copy
import time
from typing import Any, Dict, List, Tuple

import torch
from torch import nn
from torch.nn.utils.prune import BasePruningMethod
from torch.utils.hooks import RemovableHandle
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm  # (torch.nn.utils.weight_norm is the function)

from . import _patch


class _Acquiring:
    """A pre-hook of the caller's, called with its module's units acquired."""

    __slots__ = ("off", "module", "hook", "units")

    def __init__(self, off: Any, module: nn.Module, hook: Any, units: Tuple[Tuple[Any, ...], Tuple[Any, ...]]) -> None:
        self.off, self.module, self.hook, self.units = off, module, hook, units

    def __call__(self, mod: nn.Module, *args: Any) -> Any:
        off = self.off
        if mod is not self.module or off._closed:
            return self.hook(mod, *args)
        every, inner = self.units
        return off._units_call(self.hook, every, inner, (mod,) + args, {}, time.perf_counter_ns())

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        """A deep copy of the module is a plain module (_patch.copied_forward): its hook is the
        caller's own, copied."""
        return copy.deepcopy(self.hook, memo)

    def __reduce__(self) -> Any:  # torch.save(model) saves the caller's hook
        return (_identity, (self.hook,))


def _identity(x: Any) -> Any:
    return x


def _computed(hook: Any) -> List[str]:
    """The attributes a pre-hook of torch's own sets from the module's weights before each
    forward: weight_norm's, spectral_norm's and prune's (a container of prunings: its one
    tensor)."""
    if isinstance(hook, (WeightNorm, SpectralNorm)):
        return [hook.name]
    if isinstance(hook, BasePruningMethod):
        return [hook._tensor_name]
    return []


def wrap(off: Any, top: nn.Module, hooked: List[nn.Module]) -> None:
    """Wrap the pre-hooks present on each hooked module, recording in off._prehooks (hooks
    dict, key, the caller's hook, ours) what remove() puts back (_patch.undo). On the top level
    only torch's three: its pre-hooks run before the step begins (_top_forward), where an
    acquire would be outside every step, and a hook there that counts or logs calls is common."""
    off._prehook_targets = [(m, off._hook_units(off._needs[id(m)])) for m in hooked
                            if m is not top and off._needs.get(id(m))]
    off._handles_seen = RemovableHandle.next_id
    top_needs = off._needs.get(id(top))
    for m, units in off._prehook_targets + ([(top, off._hook_units(top_needs))] if top_needs else []):
        names: List[str] = []
        for key, hook in list(m._forward_pre_hooks.items()):
            computed = _computed(hook)
            if m is not top or computed:
                _wrap_one(off, m, key, hook, units)
                names += computed
        _keep_at_offload(off, m, names)
    _restore_inside(off, top, hooked)


def _wrap_one(off: Any, m: nn.Module, key: Any, hook: Any, units: Tuple[Tuple[Any, ...], Tuple[Any, ...]]) -> None:
    """Put an _Acquiring in hook's place in m's pre-hooks, and record it for remove()."""
    ours = _Acquiring(off, m, hook, units)
    m._forward_pre_hooks[key] = ours
    off._prehooks.append((m._forward_pre_hooks, key, hook, ours))


def _keep_at_offload(off: Any, m: nn.Module, names: List[str]) -> None:
    """The attributes of m named (computed by torch's pre-hooks) hold their offload()-time
    values on the CPU now and again after each of m's forwards (_restore_after)."""
    computed = {name: _on_host(m.__dict__[name]) for name in names if name in m.__dict__}
    if computed:
        m.__dict__.update(computed)
        _restore_after(off, m, computed)


def _restore_inside(off: Any, top: nn.Module, hooked: List[nn.Module]) -> None:
    """The modules that are not hooked themselves but lie inside a hooked module's unit (a
    block whose weight-normed convolutions are one unit with it): their pre-hooks already run
    with the units acquired, by the block's hook, but what torch's three compute there would
    stay on the device after the forward, a copy of each such weight outside the budget. So
    their forward is wrapped to restore it, as a hooked module's is."""
    offloaded = {id(e.tensor) for u in off.units for e in u.entries}
    skip = {id(m) for m in hooked} | {id(top)}
    for m in top.modules():
        if (id(m) not in skip and m._forward_pre_hooks
                and any(id(p) in offloaded for p in m._parameters.values() if p is not None)):
            _keep_at_offload(off, m, [n for hook in m._forward_pre_hooks.values() for n in _computed(hook)])


def wrap_late(off: Any) -> None:
    """Wrap the pre-hooks registered on hooked modules below the top level since offload() or
    the previous call. Called before a top-level forward when torch has made hook handles since
    the last look (off._handles_seen); an attribute read otherwise."""
    off._handles_seen = RemovableHandle.next_id
    for m, units in off._prehook_targets:
        for key, hook in list(m._forward_pre_hooks.items()):
            if not isinstance(hook, _Acquiring):
                _wrap_one(off, m, key, hook, units)


def _on_host(value: Any) -> Any:
    """value, or a CPU copy of it if it is a tensor elsewhere: the weight a forward on the
    device computed before offload() (a model built or run there first) is a device copy."""
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        return value.detach().to("cpu")
    return value


def _restore_after(off: Any, m: nn.Module, computed: Dict[str, Any]) -> None:
    """Wrap m's forward (already the offload's) so that after it, also when it raises, the
    attributes in computed hold again their values at offload()."""
    inner = m.forward
    pairs = tuple(computed.items())

    def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if mod is not m:
            return _patch.copied_forward(mod, args, kwargs)
        try:
            return inner(*args, **kwargs)
        finally:
            if not off._closed:
                for name, value in pairs:
                    m.__dict__[name] = value

    _patch.wrap_forward(off, m, forward)
