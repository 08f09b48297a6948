"""Fused experts: a mixture's experts stored as one tensor a projection, [experts, out, in]
(transformers 5's experts modules, and code written like them), moved expert by expert.

A decoded token runs the few experts its router picks, but a fused tensor is one parameter, so
a unit of the module would move every expert for each token. Here each expert's slice of each
such parameter is a unit of its own (one registered host range inside the parameter's pack:
the parameter stays one host tensor), and during the module's forward each parameter's slot
holds an ExpertWeights: `self.gate_up_proj[expert_idx]` acquires that expert's unit and
answers its device tensor, so the eager experts function (a loop over the experts hit) runs
unchanged on the same 2D slices a resident module computes with. The experts the router picked
(the call's top_k_index) are acquired before the function runs, so their uploads are enqueued
back to back rather than one at each step of its loop (which waits on the host for its picks
every step). The units acquired are held until the forward returns. Any other use of the
parameter (a batched kernel taking the whole tensor) gets the whole tensor, gathered on the
device expert by expert: correct, and as costly as moving the layer, so the forward runs the
eager function where the module dispatches on `config._experts_implementation` (transformers'
experts modules).

A module is split so when it has 3D parameters of one leading size (the experts), its source
indexes at least one of them as self.name[...], and its tensors are more than a unit may hold
(_setup keeps it whole where the slices need more room than the budget has and the whole fits);
2D parameters of that leading size that it indexes so (per-expert biases) are split with them.
Between forwards the parameter's host tensor spans one pinned range a slice: CUDA refuses one
copy across them, so it is copied to a device slice by slice (remove() does). No spillway calls
here but through the Offload's acquire and release."""
from __future__ import annotations

import functools
import inspect
import operator
import re
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import nn

from ..errors import ConfigError
from . import _views, _wrapped
from ._device import _PAGE
from ._units import _Entry, _Unit, _align


class Fused:
    """A module's fused parameters and the units of their slices: units[name][e] holds expert
    e's slice of parameter name."""

    __slots__ = ("module", "label", "names", "experts", "units", "params", "pack", "layouts")

    def __init__(self, module: nn.Module, label: str, names: Tuple[str, ...]) -> None:
        self.module = module
        self.label = label
        self.names = names
        self.params: Tuple[torch.Tensor, ...] = tuple(module._parameters[n] for n in names)
        # where and as each parameter was at offload(): remove() puts it back so
        self.layouts = tuple((p.device, tuple(p.stride())) for p in self.params)
        self.experts = int(self.params[0].shape[0])
        self.units: Dict[str, List[_Unit]] = {}
        self.pack: Dict[str, Any] = {}  # name -> the parameter's whole host tensor (its mapping)

    def make_units(self, prefix: str, first_index: int) -> List[_Unit]:
        """The units (self.units filled): for each fused parameter, one unit an expert holding
        its slice, named name[e]. A slice of a parameter that requires grad requires it too
        (offloaded for inference, a backward that reaches it says so: _views.new_set)."""
        made: List[_Unit] = []
        for n, p in zip(self.names, self.params):
            us = []
            for e, t in enumerate(_slices(p)):
                u = _Unit(f"{prefix}.{n}[{e}]" if prefix else f"{n}[{e}]", first_index + len(made))
                u.add(_Entry(t, u.name, False))
                us.append(u)
                made.append(u)
            self.units[n] = us
        return made

    def all_units(self) -> List[_Unit]:
        return [u for n in self.names for u in self.units[n]]


def _slices(p: torch.Tensor) -> List[torch.Tensor]:
    """p's slices by expert, detached views (sharing its version counter: an in-place edit of p
    is seen through them), requiring grad where p does."""
    out = list(p.detach().unbind(0))
    if p.requires_grad:
        for t in out:
            t.requires_grad_(True)
    return out


@functools.lru_cache(maxsize=None)
def _class_source(cls: type) -> str:
    """The source of cls and of its bases outside torch: a decorator that replaced forward (one
    dispatching to other implementations) leaves the class's own text of it."""
    out = []
    for c in cls.__mro__:
        if c is nn.Module or c.__module__.startswith("torch."):
            break
        try:
            out.append(inspect.getsource(c))
        except (OSError, TypeError):
            continue
    return "\n".join(out)


def resolve(experts: Any) -> bool:
    """offload()'s experts= option: "auto" (fused experts move expert by expert where a layer's
    are more than a unit) -> True; "whole" (each layer's experts one unit, as any module) -> False."""
    if experts not in ("auto", "whole"):
        raise ConfigError(f"offload: experts must be 'auto' or 'whole', got {experts!r}")
    return experts == "auto"


def fused_names(m: nn.Module, skip: Set[int]) -> Tuple[str, ...]:
    """The parameters of m (its own) that are split by expert, or () if m's experts are not
    fused: see the module docstring. skip: ids of parameters that are not offloaded."""
    own = [(n, p) for n, p in m._parameters.items() if p is not None]
    if not own or any(id(p) in skip or _wrapped.is_wrapper(p) for _, p in own):
        return ()
    three = [p for _, p in own if p.dim() == 3]
    if not three:
        return ()
    experts = three[0].shape[0]
    if experts < 2 or any(p.shape[0] != experts for p in three):
        return ()
    src = _class_source(type(m))
    picked = tuple(n for n, p in own if p.dim() in (2, 3) and p.shape[0] == experts
                   and re.search(rf"\bself\.{re.escape(n)}\s*\[", src))
    return picked if any(m._parameters[n].dim() == 3 for n in picked) else ()


def find(module: nn.Module, skip: Set[int], hi: int, names: Dict[int, str]) -> Dict[int, Fused]:
    """id(m) -> Fused (units not made yet) for each module of module whose experts are fused and
    whose tensors are more than hi bytes (a unit's most: smaller ones stay whole)."""
    out: Dict[int, Fused] = {}
    for m in module.modules():
        picked = fused_names(m, skip)
        if picked and sum(_wrapped.nbytes(t) for t in list(m.parameters(recurse=False))
                          + [b for b in m.buffers(recurse=False) if b is not None]) > hi:
            out[id(m)] = Fused(m, names.get(id(m)) or type(m).__name__, picked)
    return out


def pack(off: Any, f: Fused) -> None:
    """Each fused parameter copied into one anonymous mapping, an expert's slice to a page of
    its own (whole pages: each is registered, as a unit's pack is: _views.pack), the parameter
    pointed at it, and each slice registered as its unit's host copy."""
    for n, p in zip(f.names, f.params):
        units = f.units[n]
        one = units[0].nbytes
        stride = _align(one, _PAGE)
        flat = torch.frombuffer(_views.mapping(stride * f.experts), dtype=torch.uint8)
        esize = p.element_size()
        rows = [1]  # the contiguous strides of a slice
        for d in reversed(p.shape[2:]):
            rows.insert(0, rows[0] * d)
        host = flat.view(p.dtype).as_strided(tuple(p.shape), (stride // esize,) + tuple(rows[:p.dim() - 1]))
        with torch.no_grad():
            host.copy_(p.data)
        f.pack[n] = host
        for e, u in enumerate(units):
            entry = u.entries[0]
            entry.host_view = host[e]
            entry.stride = tuple(host[e].stride())
            u.buf = off.context.register_host(flat.data_ptr() + e * stride, stride, read_only=True)
            u.handle = u.buf.handle
            u.pack = flat
            u.slot_plan = ((), ())
            u.dev_set, u.dev_at = _views.new_set(off, u), 0
            u.dev_sets = {0: u.dev_set}
        p.data = host
        # the slices the edits are watched through view the parameter as it is now
        for u, t in zip(units, _slices(p)):
            u.entries[0].tensor = t


def undo(f: Fused) -> None:
    """The parameters back on memory of their own, where and as they were at offload(), before
    the packs go."""
    for n, p, (device, stride) in zip(f.names, f.params, f.layouts):
        host = f.pack.pop(n, None)
        if host is not None and p.data.data_ptr() == host.data_ptr():
            fresh = torch.empty_strided(tuple(p.shape), stride, dtype=p.dtype, device=device)
            with torch.no_grad():  # slice by slice: CUDA refuses one copy over several pinned ranges
                for e in range(f.experts):
                    fresh[e].copy_(host[e])
            p.data = fresh
        for u in f.units.get(n, ()):
            u.entries[0].host_view = None


def _expert_of(idx: Any, experts: int) -> Tuple[Optional[int], Any]:
    """(the expert an index picks, what indexes its slice after, or None) for idx, an int or a
    0-d integer tensor, alone or first in a tuple; (None, None) for any other index."""
    rest = None
    if type(idx) is tuple and idx:
        idx, rest = idx[0], (idx[1:] if len(idx) > 2 else idx[1] if len(idx) == 2 else None)
    if isinstance(idx, torch.Tensor):
        if idx.dim() != 0 or idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            return None, None
        e = int(idx.item())  # the eager loop has synchronized on its picks already
    else:
        try:
            e = operator.index(idx)
        except TypeError:
            return None, None
    if not -experts <= e < experts:
        raise IndexError(f"index {e} is out of bounds for dimension 0 with size {experts}")
    return e % experts, rest


class ExpertWeights:
    """What a fused parameter's slot holds during its module's forward: indexed by one expert
    it acquires that expert's unit and answers its device tensor; shape, dtype and device
    answer as the parameter would on the device; anything else (a torch function taking it,
    another attribute) gets the whole tensor, gathered on the device once for the forward."""

    __slots__ = ("_off", "_param", "_units", "_held", "_holding", "_whole", "_label")
    _warned: Set[str] = set()

    def __init__(self, off: Any, param: torch.Tensor, units: Sequence[_Unit], label: str) -> None:
        self._off = off
        self._param = param
        self._units = units
        self._held: List[_Unit] = []
        self._holding: Set[int] = set()  # the experts in _held
        self._whole: Optional[torch.Tensor] = None
        self._label = label

    @property
    def shape(self) -> torch.Size:
        return self._param.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._param.dtype

    @property
    def device(self) -> torch.device:
        return self._off.device

    @property
    def ndim(self) -> int:
        return self._param.dim()

    @property
    def requires_grad(self) -> bool:
        return self._param.requires_grad

    def size(self, dim: Optional[int] = None) -> Any:
        return self._param.size() if dim is None else self._param.size(dim)

    def dim(self) -> int:
        return self._param.dim()

    def __len__(self) -> int:
        return len(self._units)

    def __getitem__(self, idx: Any) -> torch.Tensor:
        e, rest = _expert_of(idx, len(self._units))
        if e is None:
            return self.whole()[idx]
        t = self._expert(e)
        return t if rest is None else t[rest]

    def _expert(self, e: int) -> torch.Tensor:
        u = self._units[e]
        if e not in self._holding:
            t0 = time.perf_counter_ns()
            self._off._acquire(u)
            self._held.append(u)
            self._holding.add(e)
            self._off._count_hook(time.perf_counter_ns() - t0, 1)
        return u.dev_set[0][0]

    def whole(self) -> torch.Tensor:
        """The whole parameter on the device, gathered expert by expert (once a forward)."""
        if self._whole is None:
            if self._label not in ExpertWeights._warned:
                ExpertWeights._warned.add(self._label)
                warnings.warn(f"spillway: {self._label} is used whole in its forward (a batched kernel over every "
                              "expert): each call gathers all its experts on the device, moving the whole layer; "
                              "the eager experts function moves only the experts its router picks", stacklevel=3)
            out = torch.empty(tuple(self._param.shape), dtype=self._param.dtype, device=self._off.device)
            for e in range(len(self._units)):
                held = e in self._holding
                out[e].copy_(self._expert(e))
                if not held:  # the copy is queued before the release: stream order keeps it
                    self._held.pop()
                    self._holding.discard(e)
                    self._off._release(self._units[e])
            self._whole = out
        return self._whole

    def release(self) -> None:
        held, self._held = self._held, []
        self._holding = set()
        self._whole = None
        for u in reversed(held):
            self._off._release(u)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.whole(), name)

    def __repr__(self) -> str:
        return f"ExpertWeights({self._label}, shape={tuple(self._param.shape)}, dtype={self._param.dtype})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*_wholes(args), **_wholes(kwargs or {}))


def _wholes(x: Any) -> Any:
    """x with each ExpertWeights in it (in tuples, lists and dicts) replaced by its whole tensor."""
    if isinstance(x, ExpertWeights):
        return x.whole()
    if isinstance(x, (tuple, list)):
        return type(x)(_wholes(v) for v in x)
    if isinstance(x, dict):
        return {k: _wholes(v) for k, v in x.items()}
    return x


def _picks(args: Tuple[Any, ...], kwargs: Dict[str, Any], experts: int) -> List[int]:
    """The experts a call's router picked, read from its first integer tensor argument (the
    experts function's top_k_index) where every value of it names an expert; else none. One
    host sync, which the eager loop over the experts hit makes anyway."""
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, torch.Tensor) and not x.dtype.is_floating_point and x.dtype != torch.bool \
                and not x.dtype.is_complex and x.numel():
            ids = torch.unique(x).tolist()
            return ids if 0 <= ids[0] and ids[-1] < experts else []
    return []


def _eager(m: nn.Module) -> Tuple[Any, str, Any]:
    """(config, attribute, its value) to put back after the forward, where m dispatches on
    config._experts_implementation and another than "eager" is set; else (None, "", None)."""
    cfg = getattr(m, "config", None)
    impl = getattr(cfg, "_experts_implementation", None)
    if cfg is None or impl is None or impl == "eager":
        return None, "", None
    # the attribute under the property, where there is one: its setter also sets sub-configs
    attr = "_experts_implementation_internal" if "_experts_implementation_internal" in vars(cfg) else \
        "_experts_implementation"
    return cfg, attr, getattr(cfg, attr)


def forward(off: Any, f: Fused, inner: Any) -> Any:
    """inner (the module's forward) with each fused parameter's slot holding an ExpertWeights,
    run eagerly; the experts it acquired released when it returns."""
    m = f.module
    slots = m._parameters

    def run(*args: Any, **kwargs: Any) -> Any:
        stand = [ExpertWeights(off, p, f.units[n], f"{f.label}.{n}") for n, p in zip(f.names, f.params)]
        cfg, attr, impl = _eager(m)
        try:
            for n, s in zip(f.names, stand):
                slots[n] = s
            if cfg is not None:
                setattr(cfg, attr, "eager")
            picks = _picks(args, kwargs, f.experts)
            for e in picks:  # every upload enqueued before the loop over the experts starts
                for s in stand:
                    s._expert(e)
            out = inner(*args, **kwargs)
            held = [u for s in stand for u in s._held]
            return off._own_output(out, held, 0) if held else out
        finally:
            if cfg is not None:
                setattr(cfg, attr, impl)
            for n, p in zip(f.names, f.params):
                slots[n] = p
            for s in stand:
                s.release()

    return run
