"""spillway for PyTorch: run a module whose weights do not fit the device.

    import spillway.torch
    model.requires_grad_(False)                       # frozen weights are what is offloaded
    off = spillway.torch.offload(model, budget="4GiB") # weights now live in pinned host memory
    out = model(x)                                     # each block is moved in as it runs
    print(off.summary())

See offload() for what is offloaded and what the budget covers. Importing this module imports
torch; `import spillway` alone never does.
"""
from __future__ import annotations

from ._offload import Offload, OutOfMemoryError, offload

__all__ = ["offload", "Offload", "OutOfMemoryError"]
