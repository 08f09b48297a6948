"""Tensors autograd saves for backward while offloaded units are on the device.

A tensor saved during a forward that lies inside an acquired unit (a weight, a view of one, a
buffer) points at device memory that the unit leaves when it is released: by the time backward
reads it, another unit may have been uploaded there. So while any hooked module of an Offload
runs with grad enabled, saved_tensors_hooks are pushed that replace such a tensor by a record
(unit, offset, dtype, sizes, strides); backward acquires the unit, copies the view out (device
to device, in stream order) and releases it. The hooks are pushed around the top-level forward
and around a hooked module called outside it (blocks called one by one from the caller's own
loop, a checkpoint's recomputation during backward), never twice by one Offload.

Hooks that were active when ours were pushed (torch.utils.checkpoint, save_on_cpu, another
Offload's) would be shadowed by ours. They are found (the top of torch's stack; a torch that cannot
be asked has its saved_tensors_hooks pushes tracked here) and keep their role: a tensor outside
this Offload's units goes to them as it would have; a tensor inside a unit goes to another
Offload's hooks never (it is this one's to record) and to foreign hooks as a copy, since they
may keep it past the unit's release.
"""
from __future__ import annotations

import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import torch

from .. import _lib
from ..core import _caller_level, format_size
from ..errors import StateError, error_for
from ._errors import OutOfMemoryError
from . import _wrapped
from ._units import _Unit, _storage_at

if TYPE_CHECKING:  # pragma: no cover
    from ._offload import Offload

_Hookpair = Tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]
_top_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_local = threading.local()  # .pushed: hooks pushed through saved_tensors_hooks, innermost last


def _pushed() -> List[_Hookpair]:
    s = getattr(_local, "pushed", None)
    if s is None:
        s = _local.pushed = []
    return s


if _top_hooks is None:
    # A torch that cannot be asked for its active hooks: keep the stack here, for every push
    # made through torch.autograd.graph.saved_tensors_hooks (torch.utils.checkpoint and
    # save_on_cpu push theirs through it too).
    _cls = torch.autograd.graph.saved_tensors_hooks
    _enter, _exit = _cls.__enter__, _cls.__exit__

    def _tracked_enter(self: Any) -> None:
        _enter(self)
        _pushed().append((self.pack_hook, self.unpack_hook))

    def _tracked_exit(self: Any, *exc: Any) -> None:
        _pushed().pop()
        _exit(self, *exc)

    _cls.__enter__, _cls.__exit__ = _tracked_enter, _tracked_exit  # type: ignore[method-assign]


class _Saved:
    """A tensor saved for backward that lay inside an acquired unit: enough to rebuild it."""

    __slots__ = ("unit", "offset", "dtype", "size", "stride")

    def __init__(self, unit: _Unit, offset: int, t: torch.Tensor) -> None:
        self.unit = unit
        self.offset = offset
        self.dtype = t.dtype
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())


class _SavedWrapped:
    """A tensor of a wrapper subclass saved for backward whose leaves lay inside acquired units
    (an offloaded quantized weight an autograd function saved): its leaves' records, and how to
    rebuild it over copies of them."""

    __slots__ = ("tree", "leaves")

    def __init__(self, tree: Any, leaves: List[_Saved]) -> None:
        self.tree = tree
        self.leaves = leaves


class _Stashed:
    """An activation saved for backward, kept in a spillway buffer of the Offload's context:
    on the device while the budget holds it, written back to pinned host memory when the
    engine needs the room (a dirty buffer), uploaded again when backward reads it. The buffer
    is this record's as long as it lives (autograd drops it with the graph; backward may read
    it more than once with retain_graph); then its contents are discarded and it goes to the
    Offload's pool of spare buffers of its size, for the next step's activation of that size:
    a buffer and its device block are made once, not per step (a new device block at the budget
    would take a trim, which waits for the device)."""

    __slots__ = ("buf", "dtype", "size", "layout", "owner", "__weakref__")

    def __init__(self, buf: Any, t: torch.Tensor, layout: Optional["_Layout"], owner: "Offload") -> None:
        self.buf = buf
        self.dtype = t.dtype
        self.size = tuple(t.size())
        self.layout = layout
        self.owner = weakref.ref(owner)  # a removed Offload keeps no spares: the buffer is closed

    def __del__(self) -> None:
        try:
            off = self.owner()
            if off is not None and not off._closed:
                self.buf.discard()
                off._stash_pool.setdefault(self.buf.size, {})[id(self.buf)] = self.buf
            else:
                self.buf.close()
        except Exception:  # the context went first (it closes its buffers), or the interpreter is ending
            pass


class _Outer:
    """What an outer pair of hooks made of a saved tensor, with the unpack that undoes it."""

    __slots__ = ("unpack", "packed")

    def __init__(self, unpack: Callable[[Any], torch.Tensor], packed: Any) -> None:
        self.unpack = unpack
        self.packed = packed


def _outer() -> Optional[_Hookpair]:
    """The saved-tensor hooks active now, or None."""
    if _top_hooks is not None:
        try:
            top = _top_hooks(True)
        except TypeError:
            top = _top_hooks()
        return tuple(top) if top else None  # type: ignore[return-value]
    s = _pushed()
    return s[-1] if s else None


class _Hooks:
    """One push of an Offload's pack and unpack hooks, with the hooks it shadows."""

    __slots__ = ("off", "outer", "foreign", "ctx")

    def __init__(self, off: "Offload", outer: Optional[_Hookpair]) -> None:
        self.off = off
        self.outer = outer
        owner = getattr(outer[0], "__self__", None) if outer is not None else None
        self.foreign = outer is not None and not isinstance(owner, _Hooks)
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t: torch.Tensor) -> Any:
        off = self.off
        rec = record(off, t)
        outer = self.outer
        if rec is None:
            if outer is not None:
                return _Outer(outer[1], outer[0](t))
            if off._stash_min is not None and _stashable(off, t):
                return stash(off, t)
            return t
        if self.foreign:
            return _Outer(outer[1], outer[0](t.clone()))  # type: ignore[index]
        return rec

    def unpack(self, s: Any) -> torch.Tensor:
        if type(s) is _Saved:
            return rebuild(self.off, s)
        if type(s) is _SavedWrapped:
            return _wrapped.rebuild(s.tree, [rebuild(self.off, r) for r in s.leaves])
        if type(s) is _Stashed:
            return unstash(self.off, s)
        if type(s) is _Outer:
            return s.unpack(s.packed)
        return s


class _Scope:
    """Context manager: the Offload's hooks pushed unless they are already the innermost."""

    __slots__ = ("off", "hooks")

    def __init__(self, off: "Offload") -> None:
        self.off = off
        self.hooks: Optional[_Hooks] = None

    def __enter__(self) -> None:
        outer = _outer()
        owner = getattr(outer[0], "__self__", None) if outer is not None else None
        if isinstance(owner, _Hooks) and owner.off is self.off:
            return
        h = self.hooks = _Hooks(self.off, outer)
        h.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        h, self.hooks = self.hooks, None
        if h is not None:
            h.ctx.__exit__(*exc)


def saving(off: "Offload") -> _Scope:
    """The scope in which tensors saved for backward inside off's acquired units are recorded."""
    return _Scope(off)


def record(off: "Offload", t: torch.Tensor) -> Any:
    """The record of t if it lies inside one of off's acquired units (a _Saved; a _SavedWrapped
    for a wrapper subclass whose leaves all do), else None."""
    if not off._acquired or t.device.type != off.device.type:
        return None
    if type(t) is not torch.Tensor and _wrapped.is_wrapper(t):
        tree, leaves = _wrapped.flatten(t)
        recs = [record(off, x) for _, x in leaves]
        return _SavedWrapped(tree, recs) if recs and None not in recs else None
    p = t.data_ptr()
    for base, u in off._acquired.items():
        if base <= p < base + u.nbytes:
            off.saved_packed += 1
            return _Saved(u, p - base, t)
    return None


def _copy_out(off: "Offload", holder: Any, nbytes: int, dtype: torch.dtype, size: Tuple[int, ...],
              byte_offset: int = 0, stride: Optional[Tuple[int, ...]] = None,
              into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The tensor at byte_offset of holder's buffer (a unit, or a stashed activation's buffer:
    nbytes long), copied out (device to device, stream-ordered) while the buffer is acquired on
    the current stream: into `into` where given (returned), else a clone. Contiguous sizes where
    no stride is given."""
    stream = off._stream()
    ptr = off._acquire_raw(holder, stream)
    try:
        out = torch.empty(0, dtype=dtype, device=off.device)
        storage = _storage_at(ptr, nbytes, off.device)
        at = byte_offset // out.element_size()
        out = out.set_(storage, at, size) if stride is None else out.set_(storage, at, size, stride)
        out = out.clone() if into is None else into.copy_(out)
    finally:
        st = off._c_release(holder.handle, stream)
    if st:
        raise error_for(st)
    return out


def rebuild(off: "Offload", s: _Saved) -> torch.Tensor:
    """The tensor of record s, copied out of its unit re-acquired for the copy."""
    if off._closed:
        raise StateError("spillway.torch: backward needs offloaded weights, but the Offload was removed; "
                         "run backward before remove()")
    out = _copy_out(off, s.unit, s.unit.nbytes, s.dtype, s.size, s.offset, s.stride)
    off.saved_reacquires += 1
    return out


def _stashable(off: "Offload", t: torch.Tensor) -> bool:
    """An activation worth a buffer: on the offload's device, at least off._stash_min bytes, not
    a parameter or another leaf that requires grad (the caller's own tensors), nor a view of one
    (a linear layer saves its weight transposed: a copy in the budget would hold it twice)."""
    if type(t) is not torch.Tensor and _wrapped.is_wrapper(t):  # no storage of its own to copy
        return False
    base = t._base if t._base is not None else t
    return (t.device.type == off.device.type and t.numel() * t.element_size() >= off._stash_min
            and not (base.is_leaf and base.requires_grad) and not isinstance(base, torch.nn.Parameter))


_ALIGN = 256  # bytes: the widest alignment a kernel's choice of code path depends on


class _Layout:
    """How a stashed activation lay in memory, to give backward the same: its strides, the
    elements its strides span from its first one, its first element's offset from an _ALIGN
    boundary (in elements), and its element size. Backward kernels pick their code path, and so the order of
    their sums, by strides (and may by alignment): a transposed activation, or one chunk of a
    projection's output, given back contiguous makes gradients that differ from resident ones in
    the last bits. The stash holds the elements alone, contiguous; the layout is rebuilt when
    backward reads it, in a fresh tensor of `span` elements (as the resident one's storage is)."""

    __slots__ = ("stride", "span", "pad", "esize")

    def __init__(self, stride: Tuple[int, ...], span: int, pad: int, esize: int) -> None:
        self.stride, self.span, self.pad, self.esize = stride, span, pad, esize


def _layout_of(t: torch.Tensor) -> Optional[_Layout]:
    """t's layout, or None where the contiguous one is the same (contiguous, on an _ALIGN
    boundary) or cannot be rebuilt cheaply: elements that overlap (an expanded tensor), negative
    strides, or strides that span more than four times its elements (a thin slice of a larger
    tensor)."""
    size, stride, esize = t.size(), t.stride(), t.element_size()
    ptr = t.data_ptr()
    pad = (ptr % _ALIGN) // esize if ptr % esize == 0 else 0
    if t.is_contiguous() and not pad:
        return None
    if t.numel() == 0:
        return None
    extent = 1  # non-overlapping: each dimension, by stride, steps past all those below it
    for st, n in sorted((st, n) for n, st in zip(size, stride) if n > 1):
        if st < extent:
            return None
        extent = st * (n - 1) + extent
    span = 1 + sum((n - 1) * st for n, st in zip(size, stride))
    if any(st < 0 for st in stride) or span > 4 * t.numel():
        return None
    return _Layout(tuple(stride), span, pad, esize)


def _stash_buffer(off: "Offload", nbytes: int) -> Any:
    """A buffer for the step's next stashed activation: the one the activation at the same place
    in the last step had, if it is spare (so that a step's accesses repeat buffer for buffer and
    the plan policy can follow them), else any spare one of its size, else a new one."""
    i = off._stash_next
    off._stash_next = i + 1
    slots = off._stash_slots
    buf = None
    spare = off._stash_pool.get(nbytes)
    if spare:
        want = slots[i] if i < len(slots) else None
        if want is not None:
            buf = spare.pop(id(want), None)
        if buf is None:
            buf = spare.popitem()[1]
    if buf is None:
        buf = off.context.buffer(nbytes)
    if i < len(slots):
        slots[i] = buf
    else:
        slots.append(buf)
    return buf


def stash(off: "Offload", t: torch.Tensor) -> Any:
    """t copied (device to device, in stream order) into a buffer of off's context, a spare one
    of its size where there is one: the engine then keeps it, or writes it back to the host,
    under the one budget. Where the budget cannot hold it beside what the step holds at once
    (a budget about the size of a unit, or its room cut in pieces), t itself: it stays in
    PyTorch's memory, as without the stash, and so does the activation at the same place of
    every later step (each refusal first evicts every buffer that can go)."""
    i = off._stash_next
    if i in off._stash_refused:
        off._stash_next = i + 1
        return t
    layout = _layout_of(t)
    nbytes = t.numel() * t.element_size()
    rec = _Stashed(_stash_buffer(off, nbytes), t, layout, off)
    stream = off._stream()
    try:
        ptr = off._acquire_raw(rec.buf, stream, _lib.ACCESS_WRITE)
    except OutOfMemoryError:
        off._stash_refused.add(i)
        off.activations_refused += 1
        if len(off._stash_refused) == 1:
            warnings.warn(f"spillway: an activation saved for backward ({format_size(nbytes)}) does not fit the "
                          "budget beside the weights the step holds at once; it and any other such stay in "
                          "PyTorch's memory, outside the budget (raise the budget, or pass recompute=True)",
                          stacklevel=_caller_level("torch"))
        return t  # rec goes: its buffer returns to the spares
    try:
        dev = torch.empty(0, dtype=t.dtype, device=off.device).set_(_storage_at(ptr, nbytes, off.device), 0, rec.size)
        with torch.no_grad():
            dev.copy_(t)
    finally:
        st = off._c_release(rec.buf.handle, stream)
    if st:
        raise error_for(st)
    off.activations_stashed += 1
    off.activation_bytes += nbytes
    return rec


def unstash(off: "Offload", s: _Stashed) -> torch.Tensor:
    """The activation of record s, copied out of its buffer (uploaded again if it was written
    back)."""
    if off._closed:
        raise StateError("spillway.torch: backward needs activations kept by an Offload that was removed; "
                         "run backward before remove()")
    lay = s.layout
    if lay is None:
        return _copy_out(off, s.buf, s.buf.size, s.dtype, s.size)
    # its layout rebuilt: a fresh storage of lay.span elements, its first one at the offset from
    # an _ALIGN boundary it had, filled from the buffer through a view of its strides
    esize = lay.esize
    out = torch.empty(lay.span + lay.pad + _ALIGN // esize, dtype=s.dtype, device=off.device)
    at = lay.pad + (-out.data_ptr() % _ALIGN) // esize
    return _copy_out(off, s.buf, s.buf.size, s.dtype, s.size, into=out.as_strided(s.size, lay.stride, at))
