"""spillway for PyTorch: run a module whose weights do not fit the device.

    import spillway.torch
    model.requires_grad_(False)                       # frozen weights are what is offloaded
    off = spillway.torch.offload(model, budget="4GiB") # weights now live in pinned host memory
    out = model(x)                                     # each block is moved in as it runs
    print(off.summary())

See offload() for what is offloaded and what the budget covers. use_allocator(budget=...) puts
every CUDA allocation of PyTorch under one spillway budget per device, shared with offload().
Importing this module imports torch; `import spillway` alone never does.
"""
from __future__ import annotations

from ._alloc import (
    Allocator,
    collect,
    context,
    current,
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_stats,
    memory_summary,
    reset_peak_memory_stats,
    use_allocator,
)
from ._errors import OutOfMemoryError
from ._api import offload
from ._offload import Offload
from ._pipeline import Offloads

__all__ = [
    "offload",
    "Offload",
    "Offloads",
    "OutOfMemoryError",
    "use_allocator",
    "Allocator",
    "collect",
    "context",
    "current",
    "empty_cache",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "memory_summary",
    "reset_peak_memory_stats",
]
