"""A unit's tensors in its two places: packed into one pinned host buffer registered with the
context (pack), and the sets of device tensors over the unit's device copy that its modules are
pointed at while it is acquired (new_set; _offload.Offload._point re-points them)."""
from __future__ import annotations

import mmap
from typing import Any, Dict, List, Tuple

import torch

from . import _wrapped
from ._device import _PAGE
from ._errors import _needs_grad
from ._units import _DevSet, _Unit, _align, _columns

_HUGE = 2 << 20  # a transparent huge page


def pack(off: Any, u: _Unit, owners: Dict[int, List[Tuple[Dict[str, Any], str]]]) -> None:
    """Copy u's tensors into one page-aligned anonymous mapping, register it as the host copy of
    u's read-only buffer in off's context, and point every tensor of u at its own tensor there.

    Whole pages: the library pins the range (cudaHostRegister), and a page shared with another
    allocation that is registered too would make that registration fail. Each tensor's host
    copy has a storage of its own over its bytes of the mapping (torch.frombuffer, which keeps
    the mapping alive), as a resident model's tensors have: code that tells tied weights by
    their storage (transformers' save_pretrained drops all but one tensor of a storage shared
    by several, safetensors refuses them) sees the offloaded model's tensors as distinct."""
    reg = _align(u.nbytes, _PAGE)
    mem = mapping(reg)
    pack = torch.frombuffer(mem, dtype=torch.uint8)
    for e in u.pieces:
        view = own_storage(mem, e.offset, e.nbytes, e.dtype, e.shape)
        with torch.no_grad():
            view.copy_(e.tensor.data)
        e.host_view = view
        e.stride = tuple(view.stride())
    # registered only after the copy: the library's host copy must be the final contents
    u.buf = off.context.register_host(pack.data_ptr(), reg, read_only=True)
    u.handle = u.buf.handle
    u.pack = pack
    u.host_pairs = tuple((e.tensor, e.host_view) for e in u.entries if e.is_buffer)
    u.slot_plan = (tuple((d, k, i) for i, e in enumerate(u.entries) if not e.is_buffer
                         for d, k in owners.get(id(e.tensor), ())),
                   tuple(i for i, e in enumerate(u.entries) if e.is_buffer))
    u.trains = off._train and any(e.tensor.requires_grad for e in u.entries if not e.is_buffer)
    if u.trains:
        for e in u.entries:
            if not e.is_buffer and e.tensor.requires_grad:
                off._param_unit[id(e.tensor)] = u
    u.dev_set, u.dev_at = new_set(off, u), 0
    u.dev_sets = {0: u.dev_set}
    for e in u.entries:
        if e.parts:  # the wrapper holds the host copies of its leaves, which are watched for edits
            _wrapped.set_leaves(e.tensor, e.tree, [p.host_view for p in e.parts])
            for p in e.parts:
                p.tensor = p.host_view
        else:
            e.tensor.data = e.host_view


def mapping(nbytes: int) -> mmap.mmap:
    """An anonymous mapping of nbytes (whole pages), private to the process, for packs."""
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if nbytes >= _HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
        # the copy into it faults every page in, and the registration pins each: in 2 MiB pages
        # where the system allows them (transparent huge pages "madvise"), a 512th of the faults
        try:
            mem.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: small pages, as before
            pass
    return mem


def new_set(off: Any, u: _Unit) -> _DevSet:
    """A set of device tensors for u, pointing nowhere yet: normal tensors (not inference
    tensors, whatever mode runs), usable with autograd, so re-pointing them needs no
    inference_mode(False) switch (a large part of a re-point's cost otherwise). A trained
    unit's device tensors do not require grad: its gradients go to the host Parameters
    through _train.ToHost."""
    with torch.inference_mode(False):
        devs = tuple(_empty_like(e, off.device) for e in u.pieces)
        for e, d in zip(u.pieces, devs):
            if e.tensor.requires_grad and not off._train:  # offloaded for inference: a backward that needs it says so
                d.requires_grad_(True)
                off._grad_hooks.append(d.register_hook(_needs_grad(e.name)))
    return _with_slots(u, devs, _objects(u, devs, None))


def complete(u: _Unit, dset: _DevSet) -> _DevSet:
    """dset with the device tensor of each wrapper entry rebuilt over its pieces, once they
    point at u's device copy (a subclass's constructor may read its leaves' shapes)."""
    devs = dset[0]
    return _with_slots(u, devs, _objects(u, devs, _wrapped.rebuild))


def _objects(u: _Unit, devs: Tuple[torch.Tensor, ...], rebuild: Any) -> List[Any]:
    """The device tensor of each entry of u: its piece's, or for a wrapper's entry one rebuilt
    over its pieces' (None while rebuild is None)."""
    out: List[Any] = []
    at = 0
    for e in u.entries:
        if e.parts:
            n = len(e.parts)
            out.append(rebuild(e.tree, devs[at:at + n], like=e.tensor) if rebuild is not None else None)
            at += n
        else:
            out.append(devs[at])
            at += 1
    return out


def _with_slots(u: _Unit, devs: Tuple[torch.Tensor, ...], objs: List[Any]) -> _DevSet:
    slots, bufs = u.slot_plan
    return (devs, _columns(((d, k, objs[i], u.entries[i].tensor) for d, k, i in slots), 4),
            tuple((u.entries[i].tensor, objs[i]) for i in bufs))


def _empty_like(e: Any, device: torch.device) -> torch.Tensor:
    """An empty device tensor for entry e. A parameter of a subclass of its own (diffusers'
    GGUFParameter, bitsandbytes' Params4bit: quantized data whose quantization type, shape and
    statistics are attributes its module's forward reads) gets one of its class, sharing its
    attributes (one __dict__: what the host Parameter gains later, the device tensor has too)."""
    d = torch.empty(0, dtype=e.dtype, device=device)
    cls = type(e.tensor)
    if e.is_buffer or cls is torch.Tensor or cls is torch.nn.Parameter:
        return d
    d = torch.Tensor._make_subclass(cls, d, False)
    d.__dict__ = e.tensor.__dict__
    return d


def own_storage(mem: mmap.mmap, offset: int, nbytes: int, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    """The bytes [offset, offset + nbytes) of mem as a contiguous tensor of dtype and shape, on
    a storage of its own (empty for no bytes)."""
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(mem, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype).view(shape)
