"""Edits of offloaded weights between forwards. Between forwards the modules hold host views into
the units' packs, and the policy may keep a unit's device copy across forwards: an edit of a
host view (load_state_dict, torch.nn.init, an in-place op under no_grad, a weight's .data
replaced) would leave that copy stale, and the next forward would compute with the old weights.
So each top-level forward first looks for edits since the last one ended, copies a replaced
.data into the pack, and drops the device copies of the units edited (spw_evict: a read-only
buffer's copy goes without a transfer; the next acquire uploads the pack).

An edit is seen through the tensor's version counter (bumped by every in-place op on the tensor
or its detached views) and its data pointer (a .data assignment). An in-place op on `.data`
itself (`w.data += d`) bumps neither and is not seen: do it under torch.no_grad() on the
parameter, or call Offload.refresh_weights(). peft's adapter layers merge that way; _adapters
handles them. The units an optimizer= trains are refreshed by its step instead and are not
watched.

A weight of a wrapper subclass (_wrapped) is watched through its leaves and its own version
counter: its copy_ (load_state_dict) runs below autograd, in its __torch_dispatch__, where the
leaves' counters do not move, but the wrapper's does. A leaf it replaced rather than wrote is
then copied into the pack."""
from __future__ import annotations

import operator
from typing import Any, List, Sequence, Tuple

import torch

from .. import _lib
from ..errors import ConfigError, error_for
from . import _wrapped
from ._units import _Entry, _Unit

_version = operator.attrgetter("_version")
_ptr = torch.Tensor.data_ptr


class HostEdits:
    """The watched tensors of an offload's units and what they were when the last forward
    ended (mark)."""

    __slots__ = ("where", "tensors", "versions", "ptrs", "buffers", "wrapped", "wrappers", "wrapper_versions")

    def __init__(self, units: Sequence[_Unit]) -> None:
        # a wrapper subclass's leaves are watched, each a tensor its parameter holds
        self.where: Tuple[Tuple[_Unit, _Entry], ...] = tuple((u, p) for u in units if not u.trains for e in u.entries
                                                             for p in (e.parts or (e,)))
        self.tensors = tuple(e.tensor for _, e in self.where)
        self.buffers = tuple(i for i, (_, e) in enumerate(self.where) if e.is_buffer)
        self.wrapped = tuple((u, e) for u in units if not u.trains for e in u.entries if e.parts)
        self.wrappers = tuple(e.tensor for _, e in self.wrapped)
        self.versions: List[int] = []
        self.ptrs: List[int] = []
        self.wrapper_versions: List[int] = []
        self.mark()

    def mark(self) -> None:
        self.versions = list(map(_version, self.tensors))
        self.ptrs = list(map(_ptr, self.tensors))
        self.wrapper_versions = list(map(_version, self.wrappers))

    def forward_ended(self) -> None:
        """After a forward: the versions of the buffers it may have written in place (written
        through to their packs, so not edits); a forward writes no parameter."""
        vs, ts = self.versions, self.tensors
        for i in self.buffers:
            vs[i] = ts[i]._version

    def stale(self) -> List[_Unit]:
        """The units with a tensor edited since mark(); a replaced .data is copied into the pack
        first (ConfigError, changing nothing, if its shape or dtype differs)."""
        vs, ps = list(map(_version, self.tensors)), list(map(_ptr, self.tensors))
        ws = list(map(_version, self.wrappers))
        if vs == self.versions and ps == self.ptrs and ws == self.wrapper_versions:
            return []
        edited = [(u, e, _replaced_leaves(e)) for (u, e), w, w0 in zip(self.wrapped, ws, self.wrapper_versions)
                  if w != w0]
        changed = [i for i, (v, p, v0, p0) in enumerate(zip(vs, ps, self.versions, self.ptrs)) if v != v0 or p != p0]
        for i in changed:
            if ps[i] != self.ptrs[i]:
                e = self.where[i][1]
                _check_shape(e, e.tensor.data)
        units: List[_Unit] = []
        for u, e, replaced in edited:
            if replaced:
                with torch.no_grad():
                    for p, x in replaced:
                        p.host_view.copy_(x)
                _wrapped.set_leaves(e.tensor, e.tree, [p.host_view for p in e.parts])
            if u not in units:
                units.append(u)
        for i in changed:
            u, e = self.where[i]
            if ps[i] != self.ptrs[i]:
                with torch.no_grad():
                    e.host_view.copy_(e.tensor.data)
                e.tensor.data = e.host_view
            if u not in units:
                units.append(u)
        self.mark()
        return units


def _replaced_leaves(e: _Entry) -> List[Tuple[_Entry, torch.Tensor]]:
    """(part, the tensor wrapper entry e holds in its place) for each leaf e now holds in place
    of its host copy; ConfigError if one's shape or dtype differs from its part's."""
    leaves = [x for _, x in _wrapped.flatten(e.tensor)[1]]
    out = [(p, x) for p, x in zip(e.parts, leaves) if x is not p.host_view]
    for p, x in out:
        _check_shape(p, x)
    return out


def _check_shape(e: _Entry, new: torch.Tensor) -> None:
    """ConfigError unless new, what replaced entry e's tensor, has e's shape and dtype."""
    if tuple(new.shape) != e.shape or new.dtype != e.dtype:
        raise ConfigError(f"offload: {e.name} was replaced by a {new.dtype} tensor of shape {tuple(new.shape)}, "
                          f"where the offload holds {e.dtype} {e.shape}; remove() the offload and offload again")


def evict(units: Sequence[Any]) -> None:
    """Drop each unit's device copy: the next acquire uploads its host copy."""
    for u in units:
        st = _lib.lib.spw_evict(u.handle)
        if st:
            raise error_for(st)
