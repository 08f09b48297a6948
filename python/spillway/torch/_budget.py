"""Budgets as users write them, resolved in one place: offload()'s for a module and for a
pipeline (given, use_allocator's, or the device's free memory less a reserve for activations),
and use_allocator's option text (one size for every device, or per device). Sizes and
percentages are parsed by the library's grammar (spillway.core.parse_budget)."""
from __future__ import annotations

from typing import Any, Dict, Iterable, NamedTuple, Optional

import torch

from ..core import Context, _option_text, budget_bytes, format_size, parse_budget
from ..errors import ConfigError
from ._device import _device_memory

# Without a budget, offload() takes the device's free memory less a reserve for what PyTorch
# allocates beside the weights (activations, a KV cache): _reserve(device memory).
_RESERVE_MIN = 1 << 30


def _reserve(total: int) -> int:
    """A quarter of the device, and at least 1 GiB (on a device of 2 GiB or less, half of it)."""
    return max(total // 4, min(_RESERVE_MIN, total // 2))


class Budget(NamedTuple):
    """What an offload's weights may hold on the device, and where that figure came from."""

    bytes: int
    source: str  # "given", "shared" (use_allocator's context) or "default"
    reserve: int  # with source "default": what is left free for activations


def resolve_budget(budget: Any, backend: str, dev: torch.device, tensors: Iterable[torch.Tensor],
                   ctx_opts: Dict[str, Any], shared: Optional[Context]) -> Budget:
    """The one budget resolution of offload() for a module and for a pipeline: under a shared
    context (use_allocator's) its budget, whatever was passed; else the budget given (bytes, a
    size, or "N%" of the device, which the library resolves), else the device's free memory less
    _reserve(device memory). Raises ConfigError for a budget that is not one, and for one the
    free device memory cannot hold."""
    given = None if budget is None else parse_budget(budget, "offload")
    if shared is not None:
        return Budget(shared.budget, "shared", 0)
    free, total = _device_memory(backend, dev, tensors, ctx_opts)
    if given is None:
        reserve = _reserve(total)
        if free - reserve <= 0:
            raise ConfigError(
                f"offload: no budget given, and the device's free memory ({format_size(free)} of "
                f"{format_size(total)}) leaves nothing beside the reserve for activations "
                f"({format_size(reserve)}); pass budget=")
        return Budget(free - reserve, "default", reserve)
    nbytes = budget_bytes(given, total)
    if nbytes > free:
        raise ConfigError(
            f"offload: budget {format_size(nbytes)} is above the free device memory "
            f"({format_size(free)} of {format_size(total)} on {dev if backend == 'cuda' else 'emu'})")
    return Budget(nbytes, "given", 0)


def _budget_text(budget: Any) -> Optional[str]:
    """The budget option as the library reads it: one size for every device, or per device
    ("0:4GiB;1:8GiB" or {0: "4GiB", 1: "8GiB"}). Every size is checked here, by the library's
    size grammar (spillway.core.parse_budget), so a bad one fails at use_allocator()."""
    if budget is None:
        return None
    if isinstance(budget, str) and ":" in budget:
        entries: Dict[Any, Any] = {}
        for item in budget.split(";"):
            dev, sep, size = item.partition(":")
            if not sep or not dev.strip().isdigit():
                raise ConfigError(f"use_allocator: bad per-device budget entry {item!r} in {budget!r} "
                                  "(expected DEVICE:SIZE;DEVICE:SIZE, e.g. 0:4GiB;1:8GiB)")
            if int(dev) in entries:
                raise ConfigError(f"use_allocator: device {int(dev)} is given twice in the budget {budget!r}")
            entries[int(dev)] = size
        budget = entries
    if isinstance(budget, dict):
        items = []
        for dev, size in sorted(budget.items()):
            if isinstance(dev, bool) or not isinstance(dev, int) or dev < 0:
                raise ConfigError(f"use_allocator: budget keys must be device indices (int >= 0), got {dev!r}")
            items.append(f"{dev}:{_size_text(size)}")
        if not items:
            raise ConfigError("use_allocator: budget={} names no device")
        return ";".join(items)
    return _size_text(budget)


def _size_text(size: Any) -> str:
    return str(parse_budget(size, "use_allocator"))


def _conf_text(budget: Any, options: Dict[str, Any]) -> str:
    parts = []
    for key, value in options.items():
        if value is None:
            continue
        if key == "device":
            raise ConfigError("use_allocator: option 'device' is chosen per allocation by PyTorch; "
                              "give per-device budgets as budget={0: '4GiB', 1: '8GiB'} or '0:4GiB;1:8GiB'")
        text = _option_text(key, value)
        if "," in text:
            raise ConfigError(f"use_allocator: option {key!r}: the value may not contain ','")
        parts.append(f"{key}={text}")
    b = _budget_text(budget)
    if b is not None:
        parts.append(f"budget={b}")
    return ",".join(parts)
