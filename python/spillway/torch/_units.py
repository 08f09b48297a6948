"""The units spillway.torch.offload is made of: the tensors of a block or module packed into one
buffer (_Unit, _Entry), storage over an acquired unit's device memory (_storage_at), and how
a module's tensors are divided into units (_plan_units). No spillway calls here: _offload.py
moves the units.
"""
from __future__ import annotations

import ctypes
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from ..errors import ConfigError
from . import _partition, _wrapped

_SPLIT = object()  # owner of a fused experts parameter: split by expert, in units of its slices (_experts)
_ALIGN = 256  # offset alignment of each tensor inside its unit's pack
_SMALL = 1 << 20  # a tensor below this, in a block with larger ones, goes to the blocks' shared unit


def _align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


_nbytes = _wrapped.nbytes


class _CudaMemory:
    """A device range exposed through __cuda_array_interface__ (version 2, no stream key):
    torch.as_tensor wraps it without a copy, without reading a stream and without syncing. Only
    for a torch without torch._C._construct_storage_from_data_pointer (before 2.1)."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
            "strides": None,
            "version": 2,
        }


_from_pointer = getattr(torch._C, "_construct_storage_from_data_pointer", None)


def _untyped(t: torch.Tensor) -> Any:
    return t.untyped_storage() if hasattr(t, "untyped_storage") else t.storage().untyped()


def _storage_at(ptr: int, nbytes: int, device: torch.device) -> Any:
    """A storage over nbytes of memory at ptr that it does not own: no copy, no sync, and (with
    torch 2.1 or later) no driver call, where torch.as_tensor of a __cuda_array_interface__ asks
    the driver which device the pointer is on. A CPU device is the emu backend, whose device
    memory is host memory."""
    if _from_pointer is not None:
        return _from_pointer(ptr, device, nbytes)
    if device.type == "cpu":
        return _untyped(torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8))
    return _untyped(torch.as_tensor(_CudaMemory(ptr, nbytes), device=device))


class _Entry:
    """One offloaded tensor: where it lives in its unit and how to restore it. A tensor of a
    wrapper subclass (_wrapped) is an entry whose parts are its leaves, each an entry of its own
    in the unit's pieces; its host_view is None."""

    __slots__ = ("tensor", "name", "offset", "nbytes", "dtype", "shape", "orig_stride", "orig_device",
                 "is_buffer", "host_view", "elem_offset", "stride", "parts", "tree")

    def __init__(self, tensor: torch.Tensor, name: str, is_buffer: bool) -> None:
        self.tensor = tensor
        self.name = name
        self.offset = 0
        self.parts: Tuple["_Entry", ...] = ()
        self.tree: Any = None
        if not is_buffer and _wrapped.is_wrapper(tensor):
            self.tree, leaves = _wrapped.flatten(tensor)
            try:  # what each forward will do on the device copies, tried now, before anything moves
                _wrapped.rebuild(self.tree, [x for _, x in leaves])
            except Exception as ex:
                raise ConfigError(f"offload: {name} is a {type(tensor).__name__} that its class cannot rebuild from "
                                  f"the tensors its __tensor_flatten__ names ({type(ex).__name__}: {ex}); "
                                  "it cannot be offloaded") from None
            self.parts = tuple(_Entry(x, f"{name}.{path}", False) for path, x in leaves)
        self.nbytes = sum(p.nbytes for p in self.parts) if self.parts else _nbytes(tensor)
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.orig_stride = tuple(tensor.stride())
        self.orig_device = tensor.device
        self.is_buffer = is_buffer
        self.host_view: Optional[torch.Tensor] = None
        self.elem_offset = 0  # offset in elements of dtype: offsets are aligned to _ALIGN
        self.stride: Tuple[int, ...] = ()  # in the pack (contiguous): its host view's, set at packing


class _Unit:
    """One spillway buffer holding the packed tensors of a block or module."""

    __slots__ = ("name", "index", "entries", "pieces", "buffer_entries", "nbytes", "pack", "buf", "handle", "refs",
                 "stream", "devptr", "versions", "host_pairs", "dev_set", "dev_at", "dev_sets", "slot_plan", "trains",
                 "live", "dev_ptrs", "wrapped")

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.index = index
        self.entries: List[_Entry] = []
        # the plain tensors packed and pointed at: each entry, or the parts of a wrapper's
        self.pieces: List[_Entry] = []
        self.buffer_entries: List[_Entry] = []  # non-parameters: checked for in-place writes
        self.nbytes = 0
        self.pack: Optional[torch.Tensor] = None
        self.buf: Any = None  # spillway Buffer
        self.handle: int = 0  # its spw_buf *
        self.refs = 0
        self.stream: Optional[int] = None
        self.devptr = 0
        self.versions: List[Tuple[_Entry, int]] = []
        # (buffer, its host view) for each buffer entry: what release points buffers back at
        self.host_pairs: Tuple[Tuple[torch.Tensor, torch.Tensor], ...] = ()
        # The device tensors over the unit at device address dev_at, as a _DevSet; dev_sets: every
        # set made, by the address it points at (dev_set among them; 0: not pointed yet), least
        # recently used first. A set is made the first time the unit comes to an address, up to
        # a number; past it the least recently used one is re-pointed (Tensor.set_).
        self.dev_set: Optional[_DevSet] = None
        self.dev_at = 0
        self.dev_sets: Dict[int, _DevSet] = {}
        # The data pointers dev_set's tensors have at dev_at. A module's forward may replace
        # what they hold (a .to(dtype=) on itself, as layerwise casting does): the release sees
        # it by these and points them back, so that no later acquire computes with the old
        # contents and nothing outside the budget stays referenced.
        self.dev_ptrs: Tuple[int, ...] = ()
        # What a set swaps: (holder's _parameters dict, key, entry index) for each parameter
        # slot, and the entry indices of buffers.
        self.slot_plan: Tuple[Tuple[Tuple[Dict[str, Any], str, int], ...], Tuple[int, ...]] = ((), ())
        # Trained through the offload (optimizer=): the unit holds a parameter that required grad
        # at offload(). Under grad its acquire stores in each such slot an autograd alias of the
        # device tensor (_train.ToHost) instead of the device tensor; live is what the slots
        # hold during that acquisition (parallel to the set's slot columns), None otherwise.
        self.trains = False
        self.live: Optional[Tuple[torch.Tensor, ...]] = None
        # Whether an entry is a wrapper subclass's: its device tensor is rebuilt over the device
        # pieces once they point somewhere (_views.complete).
        self.wrapped = False

    def add(self, entry: _Entry) -> None:
        for piece in entry.parts or (entry,):
            piece.offset = _align(self.nbytes)
            piece.elem_offset = piece.offset // piece.tensor.element_size()
            self.nbytes = piece.offset + piece.nbytes
            self.pieces.append(piece)
        if entry.parts:
            entry.offset = entry.parts[0].offset
            self.wrapped = True
        self.entries.append(entry)
        if entry.is_buffer:
            self.buffer_entries.append(entry)


# One set of device tensors of a unit: (devs, slots, buffer_pairs). devs: a device tensor per
# entry, in entry order. slots: for every module that holds a parameter entry, its
# module._parameters, the name, the device tensor and the parameter, as four parallel tuples
# (dicts, names, device tensors, parameters): during a forward the module's dict holds the device
# tensor, outside it the parameter (whose .data is its host view), so the swap is a dict store
# and not a .data assignment (a C call that checks and copies the tensor's metadata). Columns,
# so that a hook swaps them with one map() over operator.setitem: a loop run in C, where the
# same loop in Python bytecode costs the hooks more (the interpreter's own code is cold by
# the time a hook runs, after a layer's worth of torch).
# buffer_pairs: (buffer, device tensor) for each buffer entry: buffers keep their identity (.data
# is swapped), since modules alias them (a rotary table kept as a plain attribute too) and
# re-register them during forward.
_Slots = Tuple[Tuple[Dict[str, Any], ...], Tuple[str, ...], Tuple[torch.Tensor, ...], Tuple[torch.Tensor, ...]]
_DevSet = Tuple[Tuple[torch.Tensor, ...], _Slots, Tuple[Tuple[torch.Tensor, torch.Tensor], ...]]


def _columns(rows: Iterable[Tuple[Any, ...]], width: int) -> Tuple[Tuple[Any, ...], ...]:
    """rows (tuples of `width` items) as `width` parallel tuples."""
    cols = tuple(zip(*rows))
    return cols if cols else ((),) * width


def _param_owners(module: nn.Module) -> Dict[int, List[Tuple[Dict[str, Any], str]]]:
    """id(parameter) -> (module._parameters, name) for every module of module that holds it (a
    tied weight: several)."""
    owners: Dict[int, List[Tuple[Dict[str, Any], str]]] = {}
    for m in module.modules():
        for name, p in m._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((m._parameters, name))
    return owners


def _module_names(module: nn.Module) -> Dict[int, str]:
    return {id(m): (n or type(module).__name__) for n, m in module.named_modules(remove_duplicate=False)}


def _group_name(group: List[nn.Module], names: Dict[int, str]) -> str:
    first = names.get(id(group[0]), type(group[0]).__name__)
    return first if len(group) == 1 else f"{first}..{names.get(id(group[-1]), type(group[-1]).__name__)}"


def running_stats(module: nn.Module) -> Dict[int, torch.Tensor]:
    """id -> buffer for the running statistics of module's normalization layers (batch norm,
    instance norm with track_running_stats). In training their kernel updates them in place
    without moving their version counter, so a write-back at release would not see it; they are
    a few floats a channel, and stay on the device instead of being offloaded."""
    out: Dict[int, torch.Tensor] = {}
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
            for name in ("running_mean", "running_var", "num_batches_tracked"):
                t = m._buffers.get(name)
                if t is not None:
                    out[id(t)] = t
    return out


def _plan_units(module: nn.Module, groups: List[List[nn.Module]], trainable: set,
                names: Dict[int, str], fused: Optional[Dict[int, Any]] = None
                ) -> Tuple[List[_Unit], Dict[int, List[_Unit]], List[nn.Module]]:
    """The units of module (nothing moves yet): (units, id(module) -> the units its hook acquires,
    the modules to hook). Each group (a block, or a run of neighbouring modules) is one unit
    over the tensors of its modules' subtrees; every other module with tensors of its own is
    one; a tensor goes to the first unit that reaches it, so a tied weight is stored once.
    trainable: ids of the parameters that stay resident; running statistics stay too
    (running_stats). fused: id(module) -> _experts.Fused for the modules whose fused experts
    are split by expert (_experts.find): those parameters go to a unit a slice
    (Fused.make_units), and the module is hooked whatever else it holds."""
    fused = fused or {}
    owner: Dict[int, Any] = {id(p): _SPLIT for f in fused.values() for p in f.params}  # id(tensor) -> unit
    units: List[_Unit] = []
    needs: Dict[int, List[_Unit]] = {}  # id(module) -> units its hook acquires
    hooked: List[nn.Module] = []

    stay = set(running_stats(module))

    def tensors_of(mod: nn.Module, recurse: bool) -> List[Tuple[str, torch.Tensor, bool]]:
        out = [(n, t, False) for n, t in mod.named_parameters(recurse=recurse) if id(t) not in trainable]
        return out + [(n, t, True) for n, t in mod.named_buffers(recurse=recurse) if t is not None and id(t) not in stay]

    def claim(unit: _Unit, mod: nn.Module, prefix: str, recurse: bool,
              small: Optional[_Unit] = None, limit: int = _SMALL) -> List[_Unit]:
        used: List[_Unit] = []
        for n, t, is_buf in tensors_of(mod, recurse):
            u = owner.get(id(t))
            if u is _SPLIT:
                continue
            if u is None:
                u = small if small is not None and _nbytes(t) < limit else unit
                owner[id(t)] = u
                u.add(_Entry(t, f"{prefix}.{n}" if prefix else n, is_buf))
            if u not in used:
                used.append(u)
        return used

    def prefix(mod: nn.Module) -> str:  # of its tensors' names: none for the top level's own
        return "" if mod is module else names.get(id(mod), "")

    def label(mod: nn.Module) -> str:
        return names.get(id(mod)) or type(mod).__name__

    def hook(mod: nn.Module, used: List[_Unit]) -> None:
        if used and id(mod) not in needs:
            needs[id(mod)] = used
            hooked.append(mod)

    in_group: set = set()
    for g in groups:
        for b in g:
            for m in b.modules():
                in_group.add(id(m))
    # The tensors a split module's own code reads from the modules below it (Mamba's mixer its
    # dt_proj's weight, a top level computing its head as x @ self.embed.weight.T) are in its
    # own unit, which its hook holds while it runs: their modules' hooks run only while those
    # are called. Claimed before the groups, which then leave them out.
    for m in module.modules():
        read = _partition.children_read(m) if id(m) not in in_group else []
        if read:
            u = _Unit(label(m), len(units))
            claim(u, m, prefix(m), False)  # its own first
            for c in read:
                claim(u, c, prefix(c), False)
            if u.entries:
                units.append(u)
                hook(m, [u])
    # The small tensors of groups that also hold large ones (norms, biases) share one unit,
    # which the top level holds for the whole step: a group of large tensors only is then a
    # whole number of the arena's large pages more often (a Llama layer: 416 MiB, not 416.02),
    # so its upload spans fewer, fuller pages. A group of small tensors only stays whole.
    small = _Unit("small tensors of the blocks", -1)
    for g in groups:
        u = _Unit(_group_name(g, names), len(units))
        sizes = [_nbytes(t) for b in g for _, t, _ in tensors_of(b, True)]
        # small: below _SMALL and below 1/64 of the group (a norm or a bias beside its weights)
        limit = min(_SMALL, sum(sizes) // 64)
        big = any(n >= _SMALL for n in sizes)
        used_by = [claim(u, b, prefix(b), True, small if big else None, limit)
                   for b in g]
        if u.entries:
            units.append(u)
        for b, used in zip(g, used_by):
            hook(b, used)
    if small.entries:
        small.index = len(units)
        units.append(small)
    for m in module.modules():
        if id(m) not in in_group:
            u = _Unit(label(m), len(units))
            used = claim(u, m, prefix(m), False)
            if u.entries:
                units.append(u)
            hook(m, used)
    for f in fused.values():  # wherever the partition placed it, its forward is hooked
        units.extend(f.make_units(prefix(f.module), len(units)))
        if id(f.module) not in needs:
            needs[id(f.module)] = []
            hooked.append(f.module)
    if small.entries:
        top = needs.setdefault(id(module), [])
        if small not in top:
            top.append(small)
        if module not in hooked:
            hooked.append(module)
    return units, needs, hooked


def _held_together(module: nn.Module, needs: Dict[int, List[_Unit]], names: Dict[int, str],
                   footprint: Any) -> Tuple[int, str, List[_Unit]]:
    """The most device bytes a forward can hold at once: a hooked module's units together with
    those of every hooked module around it (a block that shares a tied weight with another holds
    both units; the top level's units are held all along). footprint(units) -> their bytes in
    the arena. Returns (bytes, the module's name, its units)."""
    best: Tuple[int, str, List[_Unit]] = (0, "", [])
    stack: List[Tuple[nn.Module, List[_Unit]]] = [(module, [])]
    seen: set = set()
    while stack:
        m, held = stack.pop()
        own = [u for u in needs.get(id(m), []) if u not in held]
        cur = held + own
        if own:
            n = footprint(cur)
            if n > best[0]:
                best = (n, names.get(id(m), type(m).__name__), cur)
        if id(m) in seen:  # a module reached twice (shared): its subtree is walked once
            continue
        seen.add(id(m))
        stack.extend((c, cur) for c in m.children())
    return best
