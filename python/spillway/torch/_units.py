"""The units spillway.torch.offload is made of: the tensors of a block or module packed into one
buffer (_Unit, _Entry), storage over an acquired unit's device memory (_storage_at), records of
tensors saved for backward (_Saved), and how the default blocks are found (_default_blocks). No
spillway calls here: _offload.py moves the units.
"""
from __future__ import annotations

import ctypes
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

_ALIGN = 256  # offset alignment of each tensor inside its unit's pack


def _align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


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


def _contiguous_stride(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


class _Entry:
    """One offloaded tensor: where it lives in its unit and how to restore it."""

    __slots__ = ("tensor", "name", "offset", "nbytes", "dtype", "shape", "orig_stride", "orig_device",
                 "is_buffer", "host_view", "elem_offset", "stride")

    def __init__(self, tensor: torch.Tensor, name: str, is_buffer: bool) -> None:
        self.tensor = tensor
        self.name = name
        self.offset = 0
        self.nbytes = tensor.numel() * tensor.element_size()
        self.dtype = tensor.dtype
        self.shape = tuple(tensor.shape)
        self.orig_stride = tuple(tensor.stride())
        self.orig_device = tensor.device
        self.is_buffer = is_buffer
        self.host_view: Optional[torch.Tensor] = None
        self.elem_offset = 0  # offset in elements of dtype: offsets are aligned to _ALIGN
        self.stride = _contiguous_stride(self.shape)  # packed contiguously


class _Unit:
    """One spillway buffer holding the packed tensors of a block or module."""

    __slots__ = ("name", "index", "entries", "buffer_entries", "nbytes", "pack", "buf", "handle", "refs",
                 "stream", "devptr", "versions", "host_pairs", "dev_pairs", "dev_at")

    def __init__(self, name: str, index: int) -> None:
        self.name = name
        self.index = index
        self.entries: List[_Entry] = []
        self.buffer_entries: List[_Entry] = []  # non-parameters: checked for in-place writes
        self.nbytes = 0
        self.pack: Optional[torch.Tensor] = None
        self.buf: Any = None  # spillway Buffer
        self.handle: int = 0  # its spw_buf *
        self.refs = 0
        self.stream: Optional[int] = None
        self.devptr = 0
        self.versions: List[Tuple[_Entry, int]] = []
        # (entry.tensor, its host view) for each entry: what release points the tensors back at
        self.host_pairs: Tuple[Tuple[torch.Tensor, torch.Tensor], ...] = ()
        # (entry.tensor, its device tensor) for each entry: one device tensor per entry for the
        # unit's life, pointed (Tensor.set_) at the unit's device address dev_at when it changes
        self.dev_pairs: Tuple[Tuple[torch.Tensor, torch.Tensor], ...] = ()
        self.dev_at = 0

    def add(self, entry: _Entry) -> None:
        entry.offset = _align(self.nbytes)
        entry.elem_offset = entry.offset // entry.tensor.element_size()
        self.nbytes = entry.offset + entry.nbytes
        self.entries.append(entry)
        if entry.is_buffer:
            self.buffer_entries.append(entry)


class _Saved:
    """A tensor saved for backward that lay inside an acquired unit: enough to rebuild it."""

    __slots__ = ("unit", "offset", "dtype", "size", "stride")

    def __init__(self, unit: _Unit, offset: int, t: torch.Tensor) -> None:
        self.unit = unit
        self.offset = offset
        self.dtype = t.dtype
        self.size = tuple(t.size())
        self.stride = tuple(t.stride())


def _module_names(module: nn.Module) -> Dict[int, str]:
    return {id(m): (n or type(module).__name__) for n, m in module.named_modules(remove_duplicate=False)}


def _default_blocks(module: nn.Module) -> List[nn.Module]:
    """The children of the largest nn.ModuleList/nn.Sequential, by parameter and buffer bytes."""
    best: Optional[nn.Module] = None
    best_key = (0, 0)
    for m in module.modules():
        if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 0:
            nbytes = sum(t.numel() * t.element_size() for t in list(m.parameters()) + list(m.buffers()))
            key = (nbytes, len(m))
            if key > best_key:
                best, best_key = m, key
    if best is None:
        return []
    seen: set = set()
    out = []
    for child in best.children():
        if id(child) not in seen:
            seen.add(id(child))
            out.append(child)
    return out
