"""Exceptions: one class per spw_status, each carrying the library's message.

Every class derives from spillway.Error and, where one fits, from the matching builtin, so
callers may catch either (ConfigError is a ValueError, OutOfMemoryError a MemoryError). This
module never imports torch: spillway.torch raises spillway.torch.OutOfMemoryError, which is
both this OutOfMemoryError and torch's out-of-memory error.
"""
from __future__ import annotations

from typing import Dict, Optional, Type

from ._lib import Status, last_error, status_name


class Error(Exception):
    """A failed spillway call. .status is the spw_status, .message the library's text."""

    status: Optional[Status] = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(Error, ValueError):
    """SPW_ERR_INVALID_ARGUMENT: NULL handle, zero or absurd size, bad flag or mode."""

    status = Status.ERR_INVALID_ARGUMENT


class OutOfMemoryError(Error, MemoryError):
    """SPW_ERR_OUT_OF_MEMORY: the device budget (or the device) cannot satisfy the request."""

    status = Status.ERR_OUT_OF_MEMORY


class HostOutOfMemoryError(Error, MemoryError):
    """SPW_ERR_HOST_OUT_OF_MEMORY: the pinned host budget or host memory is exhausted."""

    status = Status.ERR_HOST_OUT_OF_MEMORY


class ConfigError(Error, ValueError):
    """SPW_ERR_CONFIG: unknown option or bad option value (the message names the key)."""

    status = Status.ERR_CONFIG


class BackendError(Error, RuntimeError):
    """SPW_ERR_BACKEND: CUDA or the emulated device reported a failure."""

    status = Status.ERR_BACKEND


class UnsupportedError(Error, NotImplementedError):
    """SPW_ERR_UNSUPPORTED: the backend or device cannot do this."""

    status = Status.ERR_UNSUPPORTED


class NotFoundError(Error, LookupError):
    """SPW_ERR_NOT_FOUND: pointer or handle not owned by this context."""

    status = Status.ERR_NOT_FOUND


class StateError(Error, RuntimeError):
    """SPW_ERR_STATE: not valid in the object's current state (double release, closed, ...)."""

    status = Status.ERR_STATE


class NotReadyError(Error):
    """SPW_ERR_NOT_READY: asynchronous work still pending."""

    status = Status.ERR_NOT_READY


class FileError(Error, OSError):
    """SPW_ERR_IO: a file could not be read or written."""

    status = Status.ERR_IO


class ParseError(Error, ValueError):
    """SPW_ERR_PARSE: malformed input file; the message names the line."""

    status = Status.ERR_PARSE


class NoDeviceError(Error, RuntimeError):
    """SPW_ERR_NO_DEVICE: no usable GPU."""

    status = Status.ERR_NO_DEVICE


_BY_STATUS: Dict[int, Type[Error]] = {
    cls.status: cls
    for cls in (
        InvalidArgument,
        OutOfMemoryError,
        HostOutOfMemoryError,
        ConfigError,
        BackendError,
        UnsupportedError,
        NotFoundError,
        StateError,
        NotReadyError,
        FileError,
        ParseError,
        NoDeviceError,
    )
}


def error_for(status: int, message: Optional[str] = None) -> Error:
    """The exception for a failed status, with the library's message for this thread."""
    msg = message if message is not None else last_error()
    if not msg:
        msg = status_name(status)
    cls = _BY_STATUS.get(int(status), Error)
    err = cls(msg)  # one argument: OSError reads two as (errno, strerror)
    err.status = Status(status)
    return err


def check(status: int) -> None:
    """Raise the matching Error when status is not SPW_OK."""
    if status:
        raise error_for(status)
