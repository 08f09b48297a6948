"""spillway.torch's exceptions: the library's, and where PyTorch has its own kind, both."""
from __future__ import annotations

import itertools
from typing import Any, List, Optional

import torch

from .. import errors as _errors
from ..errors import ConfigError, StateError

_TorchOOM = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", RuntimeError)


class OutOfMemoryError(_errors.OutOfMemoryError, _TorchOOM):  # type: ignore[misc, valid-type]
    """Device memory could not be had under the budget (an offloaded unit, or a tensor under
    use_allocator): both spillway.OutOfMemoryError and torch's out-of-memory error
    (torch.OutOfMemoryError / torch.cuda.OutOfMemoryError), so code that handles PyTorch's OOM
    handles this one too."""


# The guard on parameters offloaded for inference that a backward pass reaches.
_needed_grads: List[str] = []  # parameters a running backward found offloaded for inference


def _raise_needed_grads() -> None:
    names, _needed_grads[:] = list(dict.fromkeys(_needed_grads)), []
    shown = ", ".join(repr(n) for n in names[:4]) + (" ..." if len(names) > 4 else "")
    raise StateError(
        f"spillway.torch: backward needs the gradient of {shown}, parameters that require grad but were "
        "offloaded for inference (offload() offloads every parameter of a model none of whose weights is "
        "frozen). To train adapters, freeze the base first (module.requires_grad_(False), then enable the "
        "adapters): trainable parameters of a model with frozen weights stay resident; or pass optimizer= to "
        "offload() to train them on the host. For inference, run "
        "under torch.no_grad() or torch.inference_mode().")


def _needs_grad(name: str) -> Any:
    """A hook on the device tensor of an offloaded trainable parameter: the backward that reaches
    it fails once it has run to its end (raising inside the backward would leave its remaining
    nodes to the thread's exit, where torch 1.x needs the interpreter lock to free them)."""
    def hook(grad: torch.Tensor) -> None:
        if not _needed_grads:
            torch.autograd.Variable._execution_engine.queue_callback(_raise_needed_grads)
        _needed_grads.append(name)
    return hook


def stray_error(off: Any, error: BaseException) -> Optional[ConfigError]:
    """For a forward of off's module that failed with PyTorch's device mismatch ("same device"
    in its message): a ConfigError naming the module's parameters and buffers that the offload
    does not hold and that lie on another device than its own (modules added after offload():
    peft creates adapters on the device of the weights they wrap, which offload() keeps on the
    host between forwards); None otherwise (the error is the caller's own)."""
    if not isinstance(error, RuntimeError) or "same device" not in str(error):
        return None
    held = {id(e.tensor) for u in off.units for e in u.entries}
    stray = [(n, t.device) for n, t in itertools.chain(off.module.named_parameters(), off.module.named_buffers())
             if id(t) not in held and t.device != off.device]
    if not stray:
        return None
    shown = ", ".join(f"{n!r} ({d})" for n, d in stray[:4]) + (f" and {len(stray) - 4} more" if len(stray) > 4 else "")
    return ConfigError(
        f"spillway.torch: the forward mixes devices: {shown} not offloaded and not on {off.device}, where the "
        "offloaded module runs. Modules added after offload() stay where they were made (peft makes adapters on "
        "the device of the weights they wrap, which offload() keeps on the host between forwards): add them "
        "before offload() (remove() it, add them, offload again), or move those modules to the device.")
