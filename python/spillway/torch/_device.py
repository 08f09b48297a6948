"""Where offloaded weights go: the device and backend an offload runs on, the device memory free
for it, and the arena pages its units are mapped in."""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional, Tuple

import torch

from .. import errors as _errors
from ..core import _option_text, parse_size
from ..errors import ConfigError
from . import _wrapped

_PAGE = 4096
_ARENA_PAGE = 2 << 20  # the arena's mapping granularity (2 MiB on emu and CUDA)
_SMALL_LIMIT = 1 << 20  # units up to this size come from the small-block arena (option small_limit)
_LARGE_PAGE_MAX = 1 << 30  # the default large page of an offload's own context, at most (the library's limit)


def _large_page(sizes: Iterable[int]) -> int:
    """The default vmm_large_page for units of these sizes: the largest power of two up to 1 GiB
    for which rounding every unit above 1 MiB (those the large-block arena holds) up to whole
    pages adds at most 1/32 of their bytes, else the 2 MiB granularity. A copy costs the host
    time per physical allocation it spans, so fewer pages make acquires cheaper (bench/RESULTS.md
    has the figures). The bound on the rounding keeps pages that units only partly fill rare: the
    arena cannot give those back when another size needs the room, and waits for the GPU to trim
    instead, inside an acquire."""
    large = [n for n in sizes if n > (1 << 20)]
    total = sum(large)
    page = _ARENA_PAGE
    while large and page < _LARGE_PAGE_MAX:
        p2 = page * 2
        if 32 * sum(-n % p2 for n in large) > total:
            break
        page = p2
    return page


def _arena_page(requested: int) -> int:
    """The large-block arena's page for option vmm_large_page=requested, as the library rounds it:
    a power of two from the granularity up."""
    page = _ARENA_PAGE
    while page < requested:
        page *= 2
    return page


def _resolve_device(backend: str, device: Any) -> Tuple[str, torch.device]:
    """(backend, device) for offload's backend and device arguments: "auto" is cuda where torch
    has a device, emu runs on CPU tensors, a cuda device without an index is the current one."""
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "emu"
    if backend not in ("cuda", "emu"):
        raise ConfigError(f"offload: backend must be 'auto', 'cuda' or 'emu', got {backend!r}")
    if backend == "emu":
        dev = torch.device("cpu") if device is None else torch.device(device)
        if dev.type != "cpu":
            raise ConfigError(f"offload: backend 'emu' runs on CPU tensors; device {dev} is not 'cpu'")
        return backend, dev
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        raise ConfigError(f"offload: backend 'cuda' needs a cuda device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return backend, dev


def _device_memory(backend: str, dev: torch.device, tensors: Iterable[torch.Tensor],
                   ctx_opts: Dict[str, Any]) -> Tuple[int, int]:
    """(free, total) device bytes for a context of offloaded tensors: free counts those already
    on dev (they leave it for their host copy). On CUDA ctx_opts gets the device index and the
    prefetch worker (under plan most of the hooks' C time is enqueuing the next unit's upload and
    the last-use event, which the worker issues instead: bench/RESULTS.md), unless SPILLWAY_CONF
    or the call says otherwise; on emu the device is emu_capacity."""
    if backend == "emu":
        try:
            free = parse_size(ctx_opts.get("emu_capacity", "80GiB"))
        except _errors.Error as e:
            raise ConfigError(f"offload: option 'emu_capacity': {e.message}") from None
        return free, free
    free, total = torch.cuda.mem_get_info(dev)
    free += sum(map(_wrapped.nbytes, (t for t in {id(t): t for t in tensors}.values() if t.device == dev)))
    ctx_opts.setdefault("device", dev.index)
    if conf_option(ctx_opts, "prefetch_thread") is None:
        ctx_opts["prefetch_thread"] = "on"
    return free, total


def conf_option(ctx_opts: Dict[str, Any], key: str) -> Optional[str]:
    """Option `key` of a context made with the keyword options ctx_opts, which win over
    SPILLWAY_CONF (key=value,...): its value as a string, or None where neither sets it."""
    if key in ctx_opts:
        return _option_text(key, ctx_opts[key])
    value = None
    for item in os.environ.get("SPILLWAY_CONF", "").split(","):
        k, eq, v = item.partition("=")
        if eq and k.strip() == key:
            value = v.strip()  # the last one wins, as the library reads the list
    return value
