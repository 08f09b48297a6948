"""spillway: use more GPU memory than the card has, through libspillway (ctypes, no torch).

    import spillway
    with spillway.Context(budget="6GiB", policy="plan") as ctx:
        buf = ctx.buffer("64MiB", read_only=True)
        with ctx.step(), buf.acquired("r") as devptr:
            ...
        print(ctx.summary())

`spillway.torch` (imported separately) offloads a PyTorch module's weights.
"""
from __future__ import annotations

from . import _lib
from .core import (
    Buffer,
    Config,
    Context,
    Stream,
    format_size,
    options_help,
    parse_size,
)
from .errors import (
    BackendError,
    ConfigError,
    Error,
    FileError,
    HostOutOfMemoryError,
    InvalidArgument,
    NoDeviceError,
    NotFoundError,
    NotReadyError,
    OutOfMemoryError,
    ParseError,
    StateError,
    UnsupportedError,
)

__version__ = _lib.version()
#: Where libspillway was loaded from.
library_path = _lib.path

__all__ = [
    "Buffer",
    "Config",
    "Context",
    "Stream",
    "format_size",
    "options_help",
    "parse_size",
    "Error",
    "BackendError",
    "ConfigError",
    "FileError",
    "HostOutOfMemoryError",
    "InvalidArgument",
    "NoDeviceError",
    "NotFoundError",
    "NotReadyError",
    "OutOfMemoryError",
    "ParseError",
    "StateError",
    "UnsupportedError",
    "library_path",
]
