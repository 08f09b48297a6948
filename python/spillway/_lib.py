"""ctypes declarations of include/spillway.h and spillway_optim.h: the only place that knows the C ABI.

Every public function of the header is declared here with its argtypes and restype, so a call
with a wrong type fails in Python instead of corrupting memory. The statistics struct is built
from STAT_NAMES, which must list SPW_STAT_LIST in header order (tests/python checks it against
the header text).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import enum
import os
from pathlib import Path
from typing import Callable, List, Optional, Tuple

#: The names of SPW_STAT_LIST in include/spillway.h, in order; each is a spw_counter field.
STAT_NAMES = (
    "held",
    "live",
    "cached",
    "requested",
    "segments",
    "allocs",
    "frees",
    "backend_allocs",
    "backend_frees",
    "cross_stream_waits",
    "trim_syncs",
    "window_evictions",
    "ring_uploads",
    "ooms",
    "bytes_h2d",
    "bytes_d2h",
    "evictions_clean",
    "evictions_dirty",
    "managed_collapses",
    "prefetch_hits",
    "stalls",
    "stall_ns",
    "buffers_resident",
    "buffers_host",
    "resident_bytes",
    "host_held",
    "host_pageable",
    "h2d_pageable",
    "repins",
    "pinned",
    "plan_hits",
    "plan_divergences",
    "plan_prefetch_bytes",
    "plan_prefetch_used",
    "plan_prefetch_wasted",
    "lock_waits",
    "lock_wait_ns",
)


class Status(enum.IntEnum):
    """spw_status, in header order."""

    OK = 0
    ERR_INVALID_ARGUMENT = 1
    ERR_OUT_OF_MEMORY = 2
    ERR_HOST_OUT_OF_MEMORY = 3
    ERR_CONFIG = 4
    ERR_BACKEND = 5
    ERR_UNSUPPORTED = 6
    ERR_NOT_FOUND = 7
    ERR_STATE = 8
    ERR_NOT_READY = 9
    ERR_IO = 10
    ERR_PARSE = 11
    ERR_NO_DEVICE = 12


STATUS_COUNT = 13  # SPW_STATUS_COUNT_

# Buffer flags and access modes (enum values of the header).
BUF_READ_ONLY = 1 << 0
BUF_MANAGED = 1 << 1
BUF_EXPLICIT = 1 << 2
ACCESS_READ = 1
ACCESS_WRITE = 2
ACCESS_READ_WRITE = 3


class Counter(ctypes.Structure):
    """spw_counter."""

    _fields_ = [("current", ctypes.c_int64), ("peak", ctypes.c_int64), ("total", ctypes.c_int64)]


class Stats(ctypes.Structure):
    """spw_stats: one Counter per STAT_NAMES entry, then budget, largest_free_block, page and
    budget_usable."""

    _fields_ = [(name, Counter) for name in STAT_NAMES] + [
        ("budget", ctypes.c_uint64),
        ("largest_free_block", ctypes.c_uint64),
        ("page", ctypes.c_uint64),
        ("budget_usable", ctypes.c_uint64),
    ]


# Opaque handles. Streams are pointers (cudaStream_t); NULL is the default stream.
ctx_p = ctypes.c_void_p
config_p = ctypes.c_void_p
buf_p = ctypes.c_void_p
stream_t = ctypes.c_void_p
FILE_p = ctypes.c_void_p
status_t = ctypes.c_int
HOST_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
#: spw_torch_reclaim_fn: int (*)(int device)
RECLAIM_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)

# name -> (restype, argtypes). Keep in the header's order.
_SIGNATURES = {
    "spw_status_str": (ctypes.c_char_p, [status_t]),
    "spw_last_error": (ctypes.c_char_p, []),
    "spw_version": (ctypes.c_char_p, []),
    "spw_config_create": (status_t, [ctypes.POINTER(config_p)]),
    "spw_config_destroy": (None, [config_p]),
    "spw_config_set": (status_t, [config_p, ctypes.c_char_p, ctypes.c_char_p]),
    "spw_config_parse": (status_t, [config_p, ctypes.c_char_p]),
    "spw_config_from_env": (status_t, [config_p]),
    "spw_config_get": (status_t, [config_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "spw_config_print_help": (None, [FILE_p]),
    "spw_parse_size": (status_t, [ctypes.c_char_p, ctypes.POINTER(ctypes.c_size_t)]),
    "spw_parse_budget": (
        status_t,
        [ctypes.c_char_p, ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_double)],
    ),
    "spw_format_size": (ctypes.c_char_p, [ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t]),
    "spw_ctx_create": (status_t, [config_p, ctypes.POINTER(ctx_p)]),
    "spw_ctx_destroy": (status_t, [ctx_p]),
    "spw_ctx_backend": (ctypes.c_char_p, [ctx_p]),
    "spw_ctx_budget": (ctypes.c_size_t, [ctx_p]),
    "spw_stream_create": (status_t, [ctx_p, ctypes.POINTER(stream_t)]),
    "spw_stream_destroy": (status_t, [ctx_p, stream_t]),
    "spw_stream_synchronize": (status_t, [ctx_p, stream_t]),
    "spw_launch_host": (status_t, [ctx_p, stream_t, HOST_FN, ctypes.c_void_p]),
    "spw_malloc": (status_t, [ctx_p, ctypes.c_size_t, stream_t, ctypes.POINTER(ctypes.c_void_p)]),
    "spw_free": (status_t, [ctx_p, ctypes.c_void_p, stream_t]),
    "spw_empty_cache": (status_t, [ctx_p]),
    "spw_stats_get": (status_t, [ctx_p, ctypes.POINTER(Stats)]),
    "spw_stats_reset_peaks": (status_t, [ctx_p]),
    "spw_summary": (status_t, [ctx_p, FILE_p]),
    "spw_summary_json": (status_t, [ctx_p, FILE_p]),
    "spw_buf_create": (status_t, [ctx_p, ctypes.c_size_t, ctypes.c_uint, ctypes.POINTER(buf_p)]),
    "spw_buf_register_host": (
        status_t,
        [ctx_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.POINTER(buf_p)],
    ),
    "spw_buf_destroy": (status_t, [buf_p]),
    "spw_buf_write": (status_t, [buf_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]),
    "spw_buf_read": (status_t, [buf_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t]),
    "spw_buf_size": (ctypes.c_size_t, [buf_p]),
    "spw_buf_host_begin": (status_t, [buf_p]),
    "spw_buf_host_end": (status_t, [buf_p]),
    "spw_acquire": (status_t, [buf_p, stream_t, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)]),
    "spw_release": (status_t, [buf_p, stream_t]),
    "spw_release_acquire": (
        status_t,
        [buf_p, stream_t, buf_p, stream_t, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p)],
    ),
    "spw_prefetch": (status_t, [buf_p, stream_t]),
    "spw_prefetch_free": (status_t, [buf_p, stream_t]),
    "spw_evict": (status_t, [buf_p]),
    "spw_discard": (status_t, [buf_p]),
    "spw_step_begin": (status_t, [ctx_p]),
    "spw_step_end": (status_t, [ctx_p]),
    "spw_torch_configure": (status_t, [ctypes.c_char_p]),
    "spw_torch_alloc": (ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_int, stream_t]),
    "spw_torch_set_reclaim": (None, [RECLAIM_FN]),
    "spw_torch_free": (None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, stream_t]),
    "spw_torch_init": (None, [ctypes.c_int]),
    "spw_torch_reset": (None, []),
    "spw_torch_memory_fraction": (None, [ctypes.c_double, ctypes.c_int]),
    "spw_torch_record_stream": (None, [ctypes.c_void_p, stream_t]),
    "spw_torch_context": (status_t, [ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctx_p)]),
    "spw_torch_oom_count": (ctypes.c_uint64, [ctypes.c_int]),
    "spw_torch_oom_pending": (ctypes.c_int, [ctypes.c_int]),
    "spw_torch_oom_message": (status_t, [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]),
    "spw_torch_call_stats": (None, [ctypes.c_int, ctypes.POINTER(ctypes.c_uint64)]),
    "spw_torch_shutdown": (status_t, []),
}

#: Public function names declared here (the sync test compares them with the header).
FUNCTION_NAMES = tuple(_SIGNATURES)


# ---- include/spillway_optim.h: the host optimizer step ----

OPTIM_F32 = 0
OPTIM_BF16 = 1
OPTIM_F16 = 2
ADAM_MAXIMIZE = 1 << 0
ADAM_MOMENT_MUL_ADD = 1 << 1
SGD_MAXIMIZE = 1 << 0
SGD_NESTEROV = 1 << 1
SGD_FIRST_STEP = 1 << 2


class AdamTensor(ctypes.Structure):
    """spw_adam_tensor."""

    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("exp_avg", ctypes.c_void_p),
        ("exp_avg_sq", ctypes.c_void_p),
        ("max_exp_avg_sq", ctypes.c_void_p),
        ("n", ctypes.c_size_t),
        ("grad_dtype", ctypes.c_int),
        ("param_out", ctypes.c_void_p),
        ("exp_avg_out", ctypes.c_void_p),
        ("exp_avg_sq_out", ctypes.c_void_p),
        ("max_exp_avg_sq_out", ctypes.c_void_p),
    ]


class AdamHparams(ctypes.Structure):
    """spw_adam_hparams."""

    _fields_ = [
        ("lr", ctypes.c_double),
        ("beta1", ctypes.c_double),
        ("beta2", ctypes.c_double),
        ("eps", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("step", ctypes.c_int64),
        ("flags", ctypes.c_uint),
    ]


class SgdTensor(ctypes.Structure):
    """spw_sgd_tensor."""

    _fields_ = [
        ("param", ctypes.c_void_p),
        ("grad", ctypes.c_void_p),
        ("momentum_buffer", ctypes.c_void_p),
        ("n", ctypes.c_size_t),
        ("grad_dtype", ctypes.c_int),
    ]


class SgdHparams(ctypes.Structure):
    """spw_sgd_hparams."""

    _fields_ = [
        ("lr", ctypes.c_double),
        ("momentum", ctypes.c_double),
        ("dampening", ctypes.c_double),
        ("weight_decay", ctypes.c_double),
        ("flags", ctypes.c_uint),
    ]


optim_pool_p = ctypes.c_void_p

# name -> (restype, argtypes), in spillway_optim.h's order.
_OPTIM_SIGNATURES = {
    "spw_optim_pool_create": (status_t, [ctypes.c_uint, ctypes.POINTER(optim_pool_p)]),
    "spw_optim_pool_destroy": (None, [optim_pool_p]),
    "spw_optim_pool_threads": (ctypes.c_uint, [optim_pool_p]),
    "spw_adam_step": (
        status_t,
        [optim_pool_p, ctypes.POINTER(AdamHparams), ctypes.POINTER(AdamTensor), ctypes.c_size_t],
    ),
    "spw_adamw_step": (
        status_t,
        [optim_pool_p, ctypes.POINTER(AdamHparams), ctypes.POINTER(AdamTensor), ctypes.c_size_t],
    ),
    "spw_sgd_step": (
        status_t,
        [optim_pool_p, ctypes.POINTER(SgdHparams), ctypes.POINTER(SgdTensor), ctypes.c_size_t],
    ),
    "spw_optim_isa": (ctypes.c_char_p, []),
    "spw_optim_keep_freed": (status_t, [ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
}

#: Public function names of spillway_optim.h declared here (its sync test reads that header).
OPTIM_FUNCTION_NAMES = tuple(_OPTIM_SIGNATURES)

_LIB_NAMES = ("libspillway.so.0", "libspillway.so")


def _candidates() -> List[Path]:
    """Where the library is looked for, in order (see find_library)."""
    here = Path(__file__).resolve().parent
    out: List[Path] = []
    # Running from the source tree: python/spillway -> repo root -> build/.
    repo = here.parent.parent
    for name in _LIB_NAMES:
        out.append(repo / "build" / name)
    # Installed: a copy bundled in the package (pip install with a C toolchain), then the
    # libdir that `make install` recorded relative to the package, then ${prefix}/lib guesses
    # for ${prefix}/lib/python3/dist-packages/spillway and ${prefix}/lib/python3.X/site-packages.
    for name in _LIB_NAMES:
        out.append(here / name)
    try:
        from ._install import LIBDIR_FROM_PACKAGE  # type: ignore[import]

        for name in _LIB_NAMES:
            out.append((here / LIBDIR_FROM_PACKAGE / name).resolve())
    except ImportError:
        pass
    for up in (here.parent.parent, here.parent.parent.parent):
        for libdir in ("", "lib", "lib64"):
            for name in _LIB_NAMES:
                out.append((up / libdir / name) if libdir else (up / name))
    seen = set()
    uniq = []
    for p in out:
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    return uniq


def find_library() -> str:
    """Path or soname of libspillway to load.

    Order: the SPILLWAY_LIBRARY environment variable (a file path, used as given); the build
    tree when running from the repository (build/libspillway.so); the install prefix relative to
    this package (a copy bundled in the package, then ${prefix}/lib); ctypes.util.find_library.
    Raises OSError naming every place tried.
    """
    env = os.environ.get("SPILLWAY_LIBRARY")
    if env:
        if not Path(env).exists():
            raise OSError(f"spillway: SPILLWAY_LIBRARY={env!r} does not exist")
        return env
    tried = _candidates()
    for p in tried:
        if p.is_file():
            return str(p)
    found = ctypes.util.find_library("spillway")
    if found:
        return found
    raise OSError(
        "spillway: libspillway.so not found. Looked at: $SPILLWAY_LIBRARY (unset), "
        + ", ".join(str(p) for p in tried)
        + ", and ctypes.util.find_library('spillway') (ldconfig cache, LD_LIBRARY_PATH). "
        "Build it with `make` in the repository, install it with `make install`, or set "
        "SPILLWAY_LIBRARY to its path."
    )


def _load() -> ctypes.CDLL:
    path = find_library()
    try:
        lib = ctypes.CDLL(path)
    except OSError as e:
        raise OSError(f"spillway: could not load {path}: {e}") from e
    for name, (restype, argtypes) in {**_SIGNATURES, **_OPTIM_SIGNATURES}.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


lib: ctypes.CDLL = _load()
#: The file the library was loaded from (or the soname given to the loader).
path: str = getattr(lib, "_name", "")

# C stdio, for spw_summary / spw_config_print_help (they write to a FILE *).
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.open_memstream.restype = ctypes.c_void_p
_libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_size_t)]
_libc.fclose.restype = ctypes.c_int
_libc.fclose.argtypes = [ctypes.c_void_p]
_libc.free.restype = None
_libc.free.argtypes = [ctypes.c_void_p]


def capture_file(write: Callable[[int], Optional[int]]) -> Tuple[str, Optional[int]]:
    """Run write(FILE *) into an in-memory stream (open_memstream) and return the text.

    open_memstream (POSIX 2008, glibc) grows its buffer as needed, so no temporary file and no
    size guess. Returns (text, what write returned); the caller checks the status.
    """
    bufp = ctypes.c_void_p()
    size = ctypes.c_size_t()
    f = _libc.open_memstream(ctypes.byref(bufp), ctypes.byref(size))
    if not f:
        raise OSError(ctypes.get_errno(), "open_memstream failed")
    try:
        status = write(f)
    finally:
        _libc.fclose(f)  # flushes: bufp/size are valid after this
    try:
        text = ctypes.string_at(bufp.value, size.value).decode("utf-8", "replace") if bufp.value else ""
    finally:
        _libc.free(bufp)
    return text, status


def last_error() -> str:
    """spw_last_error() as text."""
    msg = lib.spw_last_error()
    return msg.decode("utf-8", "replace") if msg else ""


def status_name(status: int) -> str:
    """spw_status_str(status) as text."""
    return lib.spw_status_str(status).decode()


def version() -> str:
    """Library version string."""
    return lib.spw_version().decode()


__all__ = [
    "lib",
    "path",
    "Status",
    "Stats",
    "Counter",
    "STAT_NAMES",
    "FUNCTION_NAMES",
    "OPTIM_FUNCTION_NAMES",
    "find_library",
    "capture_file",
    "last_error",
    "status_name",
    "version",
]
