"""spillway.torch's exceptions: the library's, and where PyTorch has its own kind, both."""
from __future__ import annotations

import torch

from .. import errors as _errors

_TorchOOM = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", RuntimeError)


class OutOfMemoryError(_errors.OutOfMemoryError, _TorchOOM):  # type: ignore[misc, valid-type]
    """Device memory could not be had under the budget (an offloaded unit, or a tensor under
    use_allocator): both spillway.OutOfMemoryError and torch's out-of-memory error
    (torch.OutOfMemoryError / torch.cuda.OutOfMemoryError), so code that handles PyTorch's OOM
    handles this one too."""
