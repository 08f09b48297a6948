"""Modules added to an offloaded model after offload(): peft's adapters loaded then
(load_lora_weights(), load_adapter(), get_peft_model(), add_adapter()). They hold tensors the
offload does not hold, made where peft makes them: on the device of the weights they wrap,
which offload() keeps in host memory between forwards, so the forward would mix devices.

Where torch reports module registrations (2.0 on), each offload watches its module tree: a
module registered under one of its modules marks it, and the next forward first takes the new
modules in (take_in): their tensors not on the offload's device go there (adapters are small;
they sit outside the budget as the parameters an optimizer trains on the device do), the new
adapter layers' merges are wrapped (_adapters.watch_merges, by the caller), and the new modules
are watched.
One registration hook serves every offload; a registration elsewhere costs it a lookup a live
offload. Without the hook (torch 1.x) such a forward fails with the error naming the tensors
and what to do (_errors.stray_error)."""
from __future__ import annotations

import weakref
from typing import Any, List, Optional

import torch
from torch import nn

_register = getattr(torch.nn.modules.module, "register_module_module_registration_hook", None)
_WATCHING: "weakref.WeakSet[Any]" = weakref.WeakSet()  # the live offloads that watch their trees
_handle: Optional[Any] = None


def _on_register(parent: nn.Module, name: str, sub: Any) -> None:
    for off in list(_WATCHING):
        if parent in off._watched:
            off._added = True


def watch(off: Any, module: nn.Module) -> None:
    """Watch module's tree for modules registered in it (a no-op where torch cannot report them)."""
    global _handle
    off._added = False
    off._watched = None
    if _register is None:
        return
    off._watched = weakref.WeakSet(module.modules())
    _WATCHING.add(off)
    if _handle is None:
        _handle = _register(_on_register)


def unwatch(off: Any) -> None:
    """Stop watching (remove()); the hook goes with the last offload."""
    global _handle
    _WATCHING.discard(off)
    off._added = False
    if not _WATCHING and _handle is not None:
        _handle.remove()
        _handle = None


def take_in(off: Any) -> List[nn.Module]:
    """Before a forward, after modules were registered in the tree: the new modules' tensors
    that the offload does not hold and that lie elsewhere go to its device (the Parameter
    objects kept, so an optimizer holding them still does), and they are watched from now on.
    Returns them (the caller wraps their adapter layers' merges)."""
    off._added = False
    held = {id(e.tensor) for u in off.units for e in u.entries}
    new = [m for m in off.module.modules() if m not in off._watched]
    for m in new:
        for p in m._parameters.values():
            if p is not None and id(p) not in held and p.device != off.device:
                p.data = p.data.to(off.device)
                if p.grad is not None:
                    p.grad = p.grad.to(off.device)
        for k, b in m._buffers.items():
            if b is not None and id(b) not in held and b.device != off.device:
                m._buffers[k] = b.to(off.device)
        off._watched.add(m)
    return new
