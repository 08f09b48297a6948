"""A method of a caller's object replaced for the life of an offload: an instance attribute bound
to the object, recorded in the offload's _method_wraps so that remove() (_patch.undo) puts
back what was there."""
from __future__ import annotations

import types
from typing import Any


def install(off: Any, obj: Any, name: str, fn: Any) -> None:
    """Make fn, bound to obj, obj's instance attribute `name`, and record what was there."""
    had = name in obj.__dict__
    prev = obj.__dict__.get(name)
    bound = types.MethodType(fn, obj)
    setattr(obj, name, bound)
    off._method_wraps.append((obj, name, had, prev, bound))
