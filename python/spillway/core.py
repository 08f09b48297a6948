"""The object API over libspillway: Context, Stream, Buffer, sizes.

Objects own their C handles and free them in close() (also called by `with` and, as a last
resort, by the garbage collector). A Buffer or Stream whose Context is closed is closed with it:
spw_ctx_destroy already returned their memory, so they never touch the freed handles.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
import warnings
import weakref
from typing import Any, Dict, Iterator, Optional, Union

from . import _lib
from ._lib import ACCESS_READ, ACCESS_READ_WRITE, ACCESS_WRITE, STAT_NAMES, lib
from .errors import ConfigError, Error, InvalidArgument, StateError, check, error_for

Size = Union[int, str]
#: A stream: None (the default stream), a Stream, an int address (cudaStream_t), or any object
#: with a `cuda_stream` attribute (torch.cuda.Stream).
StreamLike = Any

_MODES = {
    "r": ACCESS_READ,
    "read": ACCESS_READ,
    "w": ACCESS_WRITE,
    "write": ACCESS_WRITE,
    "rw": ACCESS_READ_WRITE,
    "read_write": ACCESS_READ_WRITE,
    ACCESS_READ: ACCESS_READ,
    ACCESS_WRITE: ACCESS_WRITE,
    ACCESS_READ_WRITE: ACCESS_READ_WRITE,
}


def parse_size(size: Size) -> int:
    """Bytes from an int or a size string ("6GiB", "6 GB", "512M", "1048576"), parsed by the
    library (docs/sizes.md: every unit is binary, GB = GiB = 2**30).

    Percentages are refused here (they need a device: pass them to Context(budget="80%")).
    """
    if isinstance(size, bool):
        raise InvalidArgument(f"size must be an int or a string such as '6GiB', not {size!r}")
    if isinstance(size, int):
        if size < 0:
            raise InvalidArgument(f"size must not be negative, got {size}")
        return size
    if not isinstance(size, str):
        raise InvalidArgument(f"size must be an int or a string such as '6GiB', not {type(size).__name__}")
    out = ctypes.c_size_t()
    check(lib.spw_parse_size(size.encode(), ctypes.byref(out)))
    return out.value


def parse_budget(budget: Any, who: str) -> Union[int, str]:
    """A budget as bytes, or "N%" (of the device, resolved by the library), parsed by the
    library's size grammar. `who` names the caller in the ConfigError raised for anything else
    (bool, float, negative or zero, bad text)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise ConfigError(f"{who}: a budget is bytes (int) or a size string such as '6GiB', got {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise ConfigError(f"{who}: a budget must be positive, got {budget!r}")
        return budget
    nbytes, pct = ctypes.c_uint64(), ctypes.c_double()
    try:
        check(lib.spw_parse_budget(budget.encode(), 0, ctypes.byref(nbytes), ctypes.byref(pct)))
    except Error as e:
        raise ConfigError(f"{who}: bad budget {budget!r}: {e.message}") from None
    if pct.value > 0:
        return "".join(budget.split())  # "N%", as the library reads it
    return int(nbytes.value)


def budget_bytes(budget: Union[int, str], device_total: int) -> int:
    """A parse_budget result in bytes: "N%" resolved by the library against device_total."""
    if isinstance(budget, int):
        return budget
    nbytes = ctypes.c_uint64()
    check(lib.spw_parse_budget(budget.encode(), device_total, ctypes.byref(nbytes), None))
    return int(nbytes.value)


def format_size(n: int) -> str:
    """Bytes as the library prints them: "512 B", else two decimals of KiB, MiB, GiB or TiB
    ("1.50 GiB")."""
    n = int(n)
    buf = ctypes.create_string_buffer(32)
    text = lib.spw_format_size(abs(n), buf, len(buf)).decode()
    return f"-{text}" if n < 0 else text


def _caller_level(*also: str) -> int:
    """warnings.warn's stacklevel, from its caller, of the first frame outside this package and
    the packages named in also, those imported (the user's line, also when the call came
    through spillway.torch, or from torch's autograd into a hook of ours)."""
    dirs = [os.path.dirname(os.path.abspath(__file__)) + os.sep]
    dirs += [os.path.dirname(os.path.abspath(m.__file__)) + os.sep for m in map(sys.modules.get, also)
             if m is not None and getattr(m, "__file__", None)]
    frame, level = sys._getframe(2), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(tuple(dirs)):
        frame, level = frame.f_back, level + 1
    return level


def _option_text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (int, float, str)):
        return str(value)
    if hasattr(value, "__fspath__"):
        return str(value.__fspath__())
    raise ConfigError(f"option '{key}': value must be a string, number or bool, not {type(value).__name__}")


def stream_ptr(stream: StreamLike) -> Optional[int]:
    """The cudaStream_t address of a stream-like object (None: the default stream)."""
    if stream is None:
        return None
    if isinstance(stream, Stream):
        return stream._handle
    if isinstance(stream, int):
        return stream or None
    ptr = getattr(stream, "cuda_stream", None)
    if isinstance(ptr, int):
        return ptr or None
    raise InvalidArgument(f"not a stream: {stream!r} (use None, a spillway Stream, an int, or a torch.cuda.Stream)")


class Config:
    """An spw_config: the options table. Mostly used through Context(**options)."""

    def __init__(self, from_env: bool = True, **options: Any) -> None:
        handle = ctypes.c_void_p()
        check(lib.spw_config_create(ctypes.byref(handle)))
        self._handle: Optional[int] = handle.value
        try:
            if from_env:
                check(lib.spw_config_from_env(self._handle))
            for key, value in options.items():
                if value is not None:
                    self.set(key, value)
        except BaseException:
            self.close()
            raise

    def set(self, key: str, value: Any) -> None:
        """Set one option; ConfigError names the key and the accepted values."""
        check(lib.spw_config_set(self._live(), key.encode(), _option_text(key, value).encode()))

    def get(self, key: str) -> str:
        """The option's current value as text."""
        buf = ctypes.create_string_buffer(4096)
        check(lib.spw_config_get(self._live(), key.encode(), buf, len(buf)))
        return buf.value.decode()

    def parse(self, text: str) -> None:
        """Apply "key=value,key=value" (all or nothing)."""
        check(lib.spw_config_parse(self._live(), text.encode()))

    def _live(self) -> int:
        if not self._handle:
            raise StateError("spillway.Config is closed")
        return self._handle

    def close(self) -> None:
        if self._handle:
            lib.spw_config_destroy(self._handle)
            self._handle = None

    def __enter__(self) -> "Config":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


def options_help() -> str:
    """The options table (name, default, help) as the CLI's --help-options prints it."""
    text, _ = _lib.capture_file(lambda f: lib.spw_config_print_help(f))
    return text


class _Closeable:
    """A handle that close() releases: usable as a context manager, closed when collected
    (errors at collection are swallowed: there is nobody to report them to)."""

    def close(self) -> None:  # pragma: no cover - every subclass defines it
        raise NotImplementedError

    def destroy(self) -> None:
        """The same as close()."""
        self.close()

    def __enter__(self):  # type: ignore[no-untyped-def]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Context(_Closeable):
    """One device, one backend, one budget: spw_ctx.

    Context(budget="6GiB", policy="plan", backend="auto", **options). Sizes are ints (bytes) or
    strings ("6GiB", "80%"); other options are those of `spillway --help-options`. SPILLWAY_CONF
    is applied first, then these keywords (pass from_env=False to ignore the environment).
    """

    def __init__(
        self,
        budget: Optional[Size] = None,
        policy: Optional[str] = None,
        backend: Optional[str] = "auto",
        *,
        from_env: bool = True,
        **options: Any,
    ) -> None:
        self._handle: Optional[int] = None
        self._children: "weakref.WeakSet[Any]" = weakref.WeakSet()
        if isinstance(budget, bool) or (budget is not None and not isinstance(budget, (int, str))):
            raise ConfigError(f"option 'budget': expected bytes (int) or a size string such as '6GiB', got {budget!r}")
        with Config(from_env=from_env, budget=budget, policy=policy, backend=backend, **options) as cfg:
            handle = ctypes.c_void_p()
            check(lib.spw_ctx_create(cfg._handle, ctypes.byref(handle)))
            self._handle = handle.value
            self.options: Dict[str, str] = {}
            for key in ("budget", "policy", "backend", "residency", "prefetch", "trace", "emu_capacity", "device",
                        "vmm"):
                self.options[key] = cfg.get(key)
        self._warn_rounding()

    def _warn_rounding(self) -> None:
        """Warn when whole pages hold more than 1% less than the budget (the rule of the
        library's summary, src/size.h)."""
        s = self.stats()
        budget, usable, page = s["budget"], s["budget_usable"], s["page"]
        if page and usable < budget and budget - usable > budget // 100:
            warnings.warn(
                f"spillway: the device arenas hold whole {format_size(page)} pages, so of the budget "
                f"{format_size(budget)} they can use only {format_size(usable)} "
                f"({100 * (budget - usable) / budget:.1f}% lost); give a multiple of {format_size(page)}",
                stacklevel=_caller_level())

    # ---- lifetime ----
    @property
    def closed(self) -> bool:
        return not self._handle

    def _live(self) -> int:
        if not self._handle:
            raise StateError("spillway.Context is closed")
        return self._handle

    def close(self) -> None:
        """Destroy the context: waits for its streams, returns all memory. Idempotent."""
        if not self._handle:
            return
        for child in list(self._children):
            child._orphan()
        handle, self._handle = self._handle, None
        check(lib.spw_ctx_destroy(handle))

    def __repr__(self) -> str:
        if self.closed:
            return "<spillway.Context closed>"
        return f"<spillway.Context backend={self.backend} budget={format_size(self.budget)}>"

    # ---- properties ----
    @property
    def backend(self) -> str:
        """"cuda" or "emu"."""
        return lib.spw_ctx_backend(self._live()).decode()

    @property
    def budget(self) -> int:
        """The resolved device budget in bytes."""
        return int(lib.spw_ctx_budget(self._live()))

    # ---- streams and the allocator ----
    def stream(self) -> "Stream":
        """A new stream of this context's backend (a CUDA stream on cuda)."""
        return Stream(self)

    def synchronize(self, stream: StreamLike = None) -> None:
        """Wait for the work enqueued on stream (default: the default stream)."""
        check(lib.spw_stream_synchronize(self._live(), stream_ptr(stream)))

    def malloc(self, nbytes: Size, stream: StreamLike = None) -> int:
        """Stream-ordered device allocation under the budget; returns the device address."""
        out = ctypes.c_void_p()
        check(lib.spw_malloc(self._live(), parse_size(nbytes), stream_ptr(stream), ctypes.byref(out)))
        return int(out.value or 0)

    def free(self, ptr: int, stream: StreamLike = None) -> None:
        """Free an address from malloc; stream is where its last use was enqueued."""
        check(lib.spw_free(self._live(), ptr, stream_ptr(stream)))

    def empty_cache(self) -> None:
        """Return all cached (free) device memory to the backend."""
        check(lib.spw_empty_cache(self._live()))

    # ---- buffers and steps ----
    def buffer(self, nbytes: Size, read_only: bool = False, residency: Optional[str] = None) -> "Buffer":
        """A movable buffer of nbytes, zero-filled on the host (spw_buf_create)."""
        return Buffer._create(self, parse_size(nbytes), read_only, residency)

    def register_host(self, memory: Any, nbytes: Optional[int] = None, read_only: bool = False) -> "Buffer":
        """A buffer whose host copy is `memory` (no copy): a writable buffer-protocol object
        (bytearray, numpy array, mmap) or an int address with nbytes. The Buffer keeps a
        reference to the object; an address must stay valid until the Buffer is closed."""
        return Buffer._register(self, memory, nbytes, read_only)

    def step_begin(self) -> None:
        """Mark the start of a repeating step (policy=plan learns one and predicts the next)."""
        check(lib.spw_step_begin(self._live()))

    def step_end(self) -> None:
        check(lib.spw_step_end(self._live()))

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """`with ctx.step():` brackets one step; the end is marked even if the body raises."""
        self.step_begin()
        try:
            yield
        finally:
            if not self.closed:
                self.step_end()

    # ---- observability ----
    def stats(self) -> Dict[str, Any]:
        """The library's counters: {name: {"current", "peak", "total"}}, plus "budget",
        "largest_free_block", "page" and "budget_usable" (ints: the arenas hold whole pages, so
        of the budget they can hold budget_usable, the budget rounded down to whole pages)."""
        st = _lib.Stats()
        check(lib.spw_stats_get(self._live(), ctypes.byref(st)))
        out: Dict[str, Any] = {}
        for name in STAT_NAMES:
            c = getattr(st, name)
            out[name] = {"current": c.current, "peak": c.peak, "total": c.total}
        out["budget"] = int(st.budget)
        out["largest_free_block"] = int(st.largest_free_block)
        out["page"] = int(st.page)
        out["budget_usable"] = int(st.budget_usable)
        return out

    def memory_stats(self) -> Dict[str, int]:
        """The counters flattened as torch.cuda.memory_stats does: "held.current", "live.peak", ..."""
        flat: Dict[str, int] = {}
        for name, value in self.stats().items():
            if isinstance(value, dict):
                for k, v in value.items():
                    flat[f"{name}.{k}"] = v
            else:
                flat[name] = value
        return flat

    def _counter(self, name: str) -> Any:
        """One counter (current, peak, total), read without building the whole table: the
        memory accessors below may be called per module of a forward."""
        st = _lib.Stats()
        check(lib.spw_stats_get(self._live(), ctypes.byref(st)))
        return getattr(st, name)

    def memory_allocated(self) -> int:
        """Device bytes in live allocations and resident buffers (stat 'live')."""
        return int(self._counter("live").current)

    def max_memory_allocated(self) -> int:
        return int(self._counter("live").peak)

    def memory_reserved(self) -> int:
        """Device bytes held from the backend (stat 'held'); never above the budget."""
        return int(self._counter("held").current)

    def max_memory_reserved(self) -> int:
        return int(self._counter("held").peak)

    def summary(self) -> str:
        """The library's readable statistics table (spw_summary)."""
        text, status = _lib.capture_file(lambda f: lib.spw_summary(self._live(), f))
        check(status)
        return text

    memory_summary = summary

    def summary_json(self) -> Dict[str, Any]:
        """The same statistics as the library's JSON object, parsed."""
        return json.loads(self.summary_json_text())

    def summary_json_text(self) -> str:
        text, status = _lib.capture_file(lambda f: lib.spw_summary_json(self._live(), f))
        check(status)
        return text


class Stream(_Closeable):
    """A stream of a Context's backend. On cuda, .cuda_stream is the cudaStream_t address, so a
    Stream can be handed to torch.cuda.ExternalStream."""

    def __init__(self, ctx: Context) -> None:
        out = ctypes.c_void_p()
        check(lib.spw_stream_create(ctx._live(), ctypes.byref(out)))
        self._ctx: Optional[Context] = ctx
        self._handle: Optional[int] = out.value
        ctx._children.add(self)

    @property
    def cuda_stream(self) -> int:
        return int(self._handle or 0)

    def synchronize(self) -> None:
        if self._ctx is None or not self._handle:
            raise StateError("spillway.Stream is closed")
        check(lib.spw_stream_synchronize(self._ctx._live(), self._handle))

    def _orphan(self) -> None:
        self._ctx, self._handle = None, None

    def close(self) -> None:
        if self._ctx is not None and self._handle and not self._ctx.closed:
            handle, self._handle = self._handle, None
            check(lib.spw_stream_destroy(self._ctx._handle, handle))
        self._orphan()


class Buffer(_Closeable):
    """A movable buffer (spw_buf): a host copy, and a device copy while resident.

    Use `with buf.acquired("r", stream) as devptr:` (or acquire()/release()) around device work.
    """

    _handle: Optional[int]

    def __init__(self) -> None:  # use Context.buffer / Context.register_host
        raise TypeError("use Context.buffer() or Context.register_host()")

    @classmethod
    def _new(cls, ctx: Context, handle: int, keep: Any) -> "Buffer":
        self = object.__new__(cls)
        self._ctx = ctx
        self._handle = handle
        self._keep = keep  # the registered host memory must outlive the buffer
        ctx._children.add(self)
        return self

    @classmethod
    def _create(cls, ctx: Context, nbytes: int, read_only: bool, residency: Optional[str]) -> "Buffer":
        flags = _lib.BUF_READ_ONLY if read_only else 0
        if residency == "managed":
            flags |= _lib.BUF_MANAGED
        elif residency == "explicit":
            flags |= _lib.BUF_EXPLICIT
        elif residency is not None:
            raise InvalidArgument(f"residency must be 'explicit', 'managed' or None, not {residency!r}")
        out = ctypes.c_void_p()
        check(lib.spw_buf_create(ctx._live(), nbytes, flags, ctypes.byref(out)))
        return cls._new(ctx, out.value, None)

    @classmethod
    def _register(cls, ctx: Context, memory: Any, nbytes: Optional[int], read_only: bool) -> "Buffer":
        if isinstance(memory, int):
            if nbytes is None:
                raise InvalidArgument("register_host: an address needs nbytes")
            addr, n, keep = memory, parse_size(nbytes), None
        else:
            mv = memoryview(memory)
            if mv.readonly:
                raise InvalidArgument("register_host: memory is read-only; pass a writable buffer")
            if not mv.c_contiguous:
                raise InvalidArgument("register_host: memory must be contiguous")
            mv = mv.cast("B")
            arr = (ctypes.c_char * mv.nbytes).from_buffer(mv)
            addr, keep = ctypes.addressof(arr), (memory, mv, arr)
            n = mv.nbytes if nbytes is None else parse_size(nbytes)
            if n > mv.nbytes:
                raise InvalidArgument(f"register_host: nbytes {n} exceeds the memory's {mv.nbytes} B")
        flags = _lib.BUF_READ_ONLY if read_only else 0
        out = ctypes.c_void_p()
        check(lib.spw_buf_register_host(ctx._live(), addr, n, flags, ctypes.byref(out)))
        return cls._new(ctx, out.value, keep)

    def _live(self) -> int:
        if not self._handle or self._ctx.closed:
            raise StateError("spillway.Buffer is closed (or its Context is)")
        return self._handle

    @property
    def handle(self) -> int:
        """The spw_buf * address (for calls through spillway._lib)."""
        return self._live()

    @property
    def size(self) -> int:
        return int(lib.spw_buf_size(self._live()))

    def __len__(self) -> int:
        return self.size

    def write(self, data: Any, offset: int = 0) -> None:
        """Copy a bytes-like object into the buffer at offset (blocking)."""
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        if n == 0:
            return
        arr = (ctypes.c_char * n).from_buffer_copy(mv) if mv.readonly else (ctypes.c_char * n).from_buffer(mv)
        check(lib.spw_buf_write(self._live(), offset, arr, n))

    def read(self, nbytes: Optional[int] = None, offset: int = 0) -> bytes:
        """Copy nbytes (default: to the end) out of the buffer at offset (blocking)."""
        n = self.size - offset if nbytes is None else nbytes
        if n < 0:
            raise InvalidArgument(f"read: offset {offset} is past the buffer's {self.size} B")
        out = ctypes.create_string_buffer(n)
        if n:
            check(lib.spw_buf_read(self._live(), offset, out, n))
        return out.raw

    def read_into(self, dst: Any, offset: int = 0) -> None:
        """Copy len(dst) bytes at offset into a writable buffer-protocol object (blocking)."""
        mv = memoryview(dst).cast("B")
        if mv.nbytes:
            arr = (ctypes.c_char * mv.nbytes).from_buffer(mv)
            check(lib.spw_buf_read(self._live(), offset, arr, mv.nbytes))

    def acquire(self, mode: Union[str, int] = "r", stream: StreamLike = None) -> int:
        """Make resident for work on stream and pin it until release(); returns the device
        address, valid for work enqueued on stream after this call. Does not block the host."""
        m = _MODES.get(mode)
        if m is None:
            raise InvalidArgument(f"acquire: mode must be 'r', 'w' or 'rw', not {mode!r}")
        out = ctypes.c_void_p()
        check(lib.spw_acquire(self._live(), stream_ptr(stream), m, ctypes.byref(out)))
        return int(out.value or 0)

    def release(self, stream: StreamLike = None) -> None:
        """End a use begun by acquire() on stream; StateError if not acquired."""
        check(lib.spw_release(self._live(), stream_ptr(stream)))

    @contextlib.contextmanager
    def acquired(self, mode: Union[str, int] = "r", stream: StreamLike = None) -> Iterator[int]:
        """`with buf.acquired("rw", s) as devptr:` acquire, then release on exit."""
        ptr = self.acquire(mode, stream)
        try:
            yield ptr
        finally:
            self.release(stream)

    def host_begin(self) -> None:
        """The caller is about to write the host copy in place (an optimizer stepping master
        weights): the device copy is dropped (written back first if dirty), and until
        host_end() nothing uploads the host copy (prefetches move nothing; acquire, evict,
        read, write, discard and close raise StateError). StateError while acquired or open."""
        check(lib.spw_buf_host_begin(self._live()))

    def host_end(self) -> None:
        """End host_begin(): the host copy is the contents; the next acquire uploads it."""
        check(lib.spw_buf_host_end(self._live()))

    @contextlib.contextmanager
    def host_writes(self) -> Iterator[None]:
        """`with buf.host_writes(): ...`: host_begin(), then host_end() on exit."""
        self.host_begin()
        try:
            yield
        finally:
            self.host_end()

    def prefetch(self, stream: StreamLike = None) -> None:
        """Hint: start moving to the device, ordered before later work on stream."""
        check(lib.spw_prefetch(self._live(), stream_ptr(stream)))

    def evict(self) -> None:
        """Hint: move off the device now (StateError while acquired)."""
        check(lib.spw_evict(self._live()))

    def discard(self) -> None:
        """Declare the contents dead: nothing is copied back; next acquire should be 'w'."""
        check(lib.spw_discard(self._live()))

    def _orphan(self) -> None:
        self._handle = None

    def close(self) -> None:
        """Destroy the buffer (waits for its pending work). Idempotent."""
        if self._handle and not self._ctx.closed:
            st = lib.spw_buf_destroy(self._handle)
            if st:
                raise error_for(st)
        self._handle = None
        self._keep = None

    def __repr__(self) -> str:
        if not self._handle:
            return "<spillway.Buffer closed>"
        return f"<spillway.Buffer {format_size(self.size)}>"
