"""spillway.torch.use_allocator: one budget per device for everything PyTorch allocates there.

How it is wired (PyTorch 2.11), and why:

- libspillway exports PyTorch's pluggable-allocator entry points (spw_torch_alloc/free: one
  spillway context per device, created on the first allocation from SPILLWAY_CONF and the options
  given here). They are registered with torch._C._cuda_customAllocator and used as the memory
  source of a torch.cuda.MemPool per device.
- mode="global": every allocation on each device, from every thread and stream (autograd's
  backward threads included), is routed to that pool (torch._C._cuda_beginAllocateToPool).
  mode="pool": only what the current thread allocates inside `with allocator:` (use_mem_pool).
- PyTorch's caching allocator stays the current allocator and caches blocks of the pool's
  segments; spillway holds those segments under the budget. So torch.cuda.memory_stats,
  cacheInfo (cudnn.benchmark) and torch.compile keep working, and a refused segment takes
  PyTorch's out-of-memory path (free its cache, retry) instead of reaching a tensor as NULL.
  change_current_allocator is not used: in PyTorch 2.11 a NULL from a replaced allocator is not
  turned into an exception, and memory_stats/cacheInfo/record_stream are not supported there.
- An out-of-memory observer turns a refusal by spillway into spillway.torch.OutOfMemoryError
  (a torch.OutOfMemoryError) carrying spillway's message: requested, budget, held, live, cached,
  and what would help. OOMs that spillway did not cause keep PyTorch's message.
- PyTorch frees the cached blocks of a pool only once the pool is "freeable" (its use count is 0),
  and its malloc skips the free-all-and-retry step while any pool is routed to. So in global mode
  each device's pool is made freeable as soon as it holds an anchor block (a segment that stays
  allocated, so that releasing the cache never removes the routed pool from PyTorch's table); then
  torch.cuda.empty_cache(), spillway's empty_cache() and the OOM observer give its cached blocks
  back while it stays routed. In pool mode a pool is retired (made freeable, replaced by a new one
  for the next `with`) when the cache is emptied outside `with`. PyTorch's ~MemPool releases the
  pool once more, which would underflow the use count of a freeable pool: every pool object is
  kept alive for the life of the process.
- Blocks used on a second stream (record_stream, NCCL): while any pool of a device is routed to,
  PyTorch's free() defers their end-of-life events until no capture is underway, its malloc skips
  process_events, and its empty_cache skips synchronize_and_free_events, so under permanent
  routing they would never come back. A routing cycle brings them back (global mode, a device
  whose counters show such blocks, i.e. active_bytes above allocated_bytes): a fresh MemPool is
  made, the routing to the old one ends, torch.cuda.empty_cache() runs with no capture underway on
  the device (it inserts the deferred events, waits for them and frees those blocks, then releases
  every free segment of the freeable pools), and the device is routed to the fresh pool, which gets
  its own anchor (a freeable pool can never be routed to again: PyTorch asserts its use count is
  above 0). The old pool keeps its live tensors; its segments go back to spillway as they become
  entirely free, and it leaves PyTorch's table once its anchor, dropped one cycle later, and its
  other segments are gone. Cycles run at the points where a user expects memory back and never per
  allocation: spillway's collect() and empty_cache(), torch.cuda.empty_cache() (wrapped in global
  mode), the OOM observer, and the reclaim hook below. Between the end of the old routing and the
  start of the new one, allocations by other threads on the device come from PyTorch's own pool,
  outside the budget.
- A segment refused under the budget first calls back into Python (spw_torch_set_reclaim): once
  the pool is freeable, torch.cuda.empty_cache() gives PyTorch's cached blocks back (after a
  routing cycle when blocks await other streams) and spillway tries the segment again, so the
  allocation that hit the budget succeeds where the default allocator's own free-and-retry would
  have. The callback runs on the allocating thread inside PyTorch's allocator, whose lock is
  recursive; the allocation in flight goes on in the pool it started in, which keeps its anchor
  until the next cycle.
- CUDA graph capture where the routing applies fails at once (see use_allocator).
"""
from __future__ import annotations

import ctypes
import functools
import threading
import warnings
from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from .. import _lib
from ..core import Context, format_size
from ..errors import ConfigError, InvalidArgument, StateError, check
from .. import errors as _errors
from ._budget import _conf_text
from ._errors import OutOfMemoryError

_lib_c = _lib.lib
_MODES = ("global", "pool")
_TORCH_OOM = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError


_lock = threading.RLock()
_active: Optional["Allocator"] = None
_contexts: Dict[int, "_SharedContext"] = {}
_pools_keep: List[Any] = []  # pools and anchors live as long as the process (see the module's docstring)
_observer_attached = False
_graph_guard_installed = False
_empty_cache_hooked = False
_tls = threading.local()  # .pool_depth: `with allocator:` (pool mode) nesting; .cycling: in a routing cycle
_in_observer = threading.local()  # .active: the OOM observer is releasing PyTorch's cache on this thread


def _keep_forever(obj: Any) -> None:
    """Never destroy obj, not even at interpreter exit: PyTorch's ~MemPool releases its pool once
    more, which fails an assertion (and terminates the process) for a pool made freeable here."""
    _pools_keep.append(obj)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _hold(anchor: Any) -> None:
    """Keep an anchor alive even through interpreter exit (the routed pool must stay in PyTorch's
    table as long as anything may allocate); _let_go() undoes it once the pool is retired."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(anchor))


def _let_go(anchor: Any) -> None:
    ctypes.pythonapi.Py_DecRef(ctypes.py_object(anchor))


def _pytorch_empty_cache() -> None:
    """PyTorch's own torch.cuda.empty_cache(), never the wrapper global mode installs."""
    fn = torch.cuda.empty_cache
    getattr(fn, "_spillway_wraps", fn)()


def _awaiting_streams(device: int) -> int:
    """Bytes of blocks on device whose tensors are gone but which PyTorch has not recycled, because
    they were used on another stream: active (PyTorch's counter of blocks allocated or waiting for
    streams) above allocated."""
    s = torch.cuda.memory_stats(device)
    return max(0, int(s.get("active_bytes.all.current", 0)) - int(s.get("allocated_bytes.all.current", 0)))


def _awaiting(devices: Iterable[int]) -> Dict[int, int]:
    """device -> _awaiting_streams(device), for those of devices where blocks await."""
    out = {}
    for d in devices:
        n = _awaiting_streams(d)
        if n > 0:
            out[d] = n
    return out


class _SharedContext(Context):
    """The context of one device, owned by the library's torch entry points: close() forgets it
    but never destroys it (PyTorch may still hold memory from it)."""

    def __init__(self, handle: int) -> None:  # noqa: D401 - not Context's constructor
        import weakref

        self._handle = handle
        self._children = weakref.WeakSet()
        self.options = {"shared": "torch allocator"}

    def close(self) -> None:
        """Nothing: the context is shared (its users each close their own buffers)."""

    def _forget(self) -> None:
        for child in list(self._children):
            child._orphan()
        self._handle = None


def _device_index(device: Any) -> int:
    if device is None:
        if _active is not None and not _active.routed:
            return 0
        return torch.cuda.current_device()
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    d = torch.device(device)
    if d.type == "cpu":
        return 0
    if d.type != "cuda":
        raise InvalidArgument(f"spillway.torch: not a CUDA device: {device!r}")
    return d.index if d.index is not None else torch.cuda.current_device()


def context(device: Any = None, create: bool = True) -> Context:
    """The spillway Context of device (default: the current CUDA device) used by the allocator:
    stats(), summary(), buffers. It is shared: closing it only forgets this Python object."""
    idx = _device_index(device)
    with _lock:
        ctx = _contexts.get(idx)
        if ctx is not None and not ctx.closed:
            return ctx
        out = ctypes.c_void_p()
        check(_lib_c.spw_torch_context(idx, 1 if create else 0, ctypes.byref(out)))
        ctx = _SharedContext(out.value)
        _contexts[idx] = ctx
        return ctx


def _oom_observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
    """PyTorch's out-of-memory observer: raise spillway's error when spillway refused. Before
    raising, PyTorch's cached blocks of the routed pools go back to spillway: PyTorch does not free
    them itself while a pool is routed to, and the next allocation would be refused as well."""
    if not _lib_c.spw_torch_oom_pending(device):
        return  # not ours: PyTorch raises its own message
    err = _oom_error(device, alloc)
    a = current()
    if a is not None and a.routed and not getattr(_in_observer, "active", False):
        _in_observer.active = True
        try:
            _torch_empty_cache(a)
        except Exception:  # noqa: BLE001 - the refusal is the error to report
            pass
        finally:
            _in_observer.active = False
    raise err


#: reclaim hook calls and how many of them gave memory back (what memory_summary reports)
_reclaims = {"calls": 0, "freed": 0}
#: routing cycles and the bytes of blocks awaiting other streams they brought back (memory_summary)
_cycles = {"count": 0, "bytes": 0}


def _reclaim(device: int) -> int:
    """spillway's reclaim hook: a segment for device was refused under the budget. Give back
    PyTorch's cached blocks of the freeable pools; 1 (try again) when PyTorch's reserved memory
    on device went down. Never raises: ctypes would only print the exception."""
    _reclaims["calls"] += 1
    try:
        a = current()
        if a is None or not a.routed or (a.mode == "global" and device not in a._freeable):
            return 0
        before = torch.cuda.memory_reserved(device)
        cycled = False
        # Never wait for _lock here: its holder may be waiting for PyTorch's device lock, which this
        # thread holds. The pool of the allocation in flight is anchored (freeable), so the cycle
        # cannot remove it from PyTorch's table under that allocation.
        if a.mode == "global" and not getattr(_tls, "cycling", False) and _lock.acquire(blocking=False):
            try:
                awaiting = _awaiting([device])
                if awaiting:
                    a._cycle(awaiting)
                    cycled = True
            finally:
                _lock.release()
        if not cycled:
            _pytorch_empty_cache()
        if torch.cuda.memory_reserved(device) >= before:
            return 0
        _reclaims["freed"] += 1
        return 1
    except BaseException:  # noqa: BLE001 - the refusal stands; PyTorch reports it
        return 0


_reclaim_cb = _lib.RECLAIM_FN(_reclaim)  # referenced for the life of the process (C keeps the pointer)


def _oom_error(device: int, alloc: Optional[int]) -> Exception:
    buf = ctypes.create_string_buffer(1024)
    _lib_c.spw_torch_oom_message(device, buf, len(buf))
    msg = buf.value.decode("utf-8", "replace")
    what = f"PyTorch asked for {format_size(alloc)} ({alloc} B) on cuda:{device}" if alloc is not None else \
        f"an allocation on device {device}"
    mode = _active.mode if _active is not None else "closed"
    err = OutOfMemoryError(
        f"spillway: out of memory under the budget (use_allocator, mode={mode}): {what}, and spillway refused "
        f"the segment after releasing its cache and evicting unpinned offloaded weights. {msg}. "
        "What would help: a larger budget (use_allocator(budget=...)), a smaller batch, "
        "spillway.torch.empty_cache(), or offloading frozen weights with spillway.torch.offload(...)")
    err.status = _lib.Status.ERR_OUT_OF_MEMORY
    return err


def _install_empty_cache_hook() -> None:
    """Global mode: make torch.cuda.empty_cache() what it is under PyTorch's own allocator, which
    also frees the blocks that awaited other streams: while spillway routes, it is spillway's
    empty_cache of PyTorch's cache (a routing cycle where blocks await other streams), otherwise
    PyTorch's own. Installed once per process; code that bound the function before keeps PyTorch's."""
    global _empty_cache_hooked
    if _empty_cache_hooked:
        return
    orig = torch.cuda.empty_cache

    @functools.wraps(orig)
    def empty_cache() -> None:
        a = current()
        if a is not None and a.routed and a.mode == "global":
            _torch_empty_cache(a)
        else:
            orig()

    empty_cache._spillway_wraps = orig  # type: ignore[attr-defined]
    torch.cuda.empty_cache = empty_cache
    mem = getattr(torch.cuda, "memory", None)
    if mem is not None and getattr(mem, "empty_cache", None) is orig:
        mem.empty_cache = empty_cache
    _empty_cache_hooked = True


def _install_graph_guard() -> None:
    global _graph_guard_installed
    if _graph_guard_installed:
        return
    cls = getattr(torch.cuda, "CUDAGraph", None)
    if cls is None:
        return
    orig = cls.capture_begin

    def capture_begin(self: Any, *args: Any, **kwargs: Any) -> Any:
        a = _active
        if a is not None and a.routed and a.mode == "global":
            raise RuntimeError(
                "spillway.torch: CUDA graph capture is refused while use_allocator(mode='global') routes every "
                "allocation to spillway's pool (the graph's private memory would be shared with eager tensors). "
                "Use mode='pool' and capture outside its `with` block, or close() the allocator first")
        if getattr(_tls, "pool_depth", 0):
            raise RuntimeError(
                "spillway.torch: CUDA graph capture is refused inside `with use_allocator(mode='pool')`: the graph's "
                "private memory would be shared with the pool's tensors. Capture outside the `with` block")
        return orig(self, *args, **kwargs)

    cls.capture_begin = capture_begin
    _graph_guard_installed = True


class Allocator:
    """Returned by use_allocator(): the statistics of its devices, empty_cache(), and close().
    In mode="pool" use it as `with allocator:` around the code whose allocations it budgets."""

    def __init__(self) -> None:  # use use_allocator()
        raise TypeError("use spillway.torch.use_allocator(budget=...)")

    @classmethod
    def _start(cls, mode: str, conf: str, backend: str) -> "Allocator":
        self = object.__new__(cls)
        self.mode = mode
        self.conf = conf
        self.backend = backend
        self.routed = False
        self.closed = False
        self._pools: Dict[int, Any] = {}
        self._freeable: set = set()  # global mode: devices whose routed pool is freeable
        self._anchors: Dict[int, Any] = {}  # global mode: the anchor of each device's routed pool
        self._retired_anchors: Dict[int, Any] = {}  # the anchor of the pool the last cycle retired
        self._entered: Dict[int, int] = {}  # pool mode: device -> `with` depth (routing to _pools[device])
        self._pool_ctx: List[Any] = []
        self._pluggable = None
        if backend == "emu":
            return self  # contexts only: CPU tensors do not come from it (tests, offload on CPU)
        if not torch.cuda.is_available():
            raise _errors.NoDeviceError("spillway.torch.use_allocator: no CUDA device (torch.cuda.is_available() "
                                        "is False); backend='emu' gives the contexts without routing")
        if not hasattr(torch.cuda, "MemPool") or not hasattr(torch._C, "_cuda_beginAllocateToPool"):
            raise _errors.UnsupportedError(
                f"spillway.torch.use_allocator needs torch.cuda.MemPool (PyTorch >= 2.8); this is {torch.__version__}")
        alloc_fn = ctypes.cast(_lib_c.spw_torch_alloc, ctypes.c_void_p).value
        free_fn = ctypes.cast(_lib_c.spw_torch_free, ctypes.c_void_p).value
        self._pluggable = torch._C._cuda_customAllocator(alloc_fn, free_fn)
        _lib_c.spw_torch_set_reclaim(_reclaim_cb)
        _attach_observer()
        _install_graph_guard()
        if mode == "global":
            _install_empty_cache_hook()
        if mode == "global":
            for d in range(torch.cuda.device_count()):
                pool = self._pool(d)
                torch._C._cuda_beginAllocateToPool(d, pool.id)
        self.routed = True
        if mode == "global":
            self._make_freeable(torch.cuda.current_device())
        return self

    def _make_freeable(self, device: int) -> bool:
        """Global mode: allocate device's anchor in its routed pool, then drop the pool's two uses
        (the routing's and the MemPool's) so that PyTorch frees its cached blocks on empty_cache.
        False when the anchor could not be allocated (the pool keeps its cache until next time)."""
        if device in self._freeable:
            return True
        pool = self._pools.get(device)
        if pool is None:
            return False
        try:
            anchor = torch.empty(512, dtype=torch.uint8, device=torch.device("cuda", device))
        except _TORCH_OOM:
            return False
        _hold(anchor)
        self._anchors[device] = anchor
        torch._C._cuda_releasePool(device, pool.id)
        torch._C._cuda_releasePool(device, pool.id)
        self._freeable.add(device)
        return True

    def _cycle(self, awaiting: Dict[int, int]) -> int:
        """Global mode, under _lock: one routing cycle on the devices of `awaiting` (see the
        module's docstring; _awaiting() gives it: device -> bytes awaiting other streams), so
        that PyTorch recycles those blocks. Returns the bytes that awaited.
        Each device ends routed to a fresh pool, made freeable when its anchor could be allocated.
        A pool is kept out of PyTorch's table only once no allocation can be in flight in it: the
        anchor of the pool retired here is dropped by the next cycle."""
        devices = [d for d in awaiting if d in self._pools]
        if not devices:
            return 0
        awaited = sum(awaiting[d] for d in devices)
        fresh: Dict[int, Any] = {}
        for d in devices:  # first, so that a failure here leaves the routing as it was
            with torch.cuda.device(d):
                fresh[d] = torch.cuda.MemPool(self._pluggable)
            _keep_forever(fresh[d])
        _tls.cycling = True
        ended: List[int] = []
        try:
            for d in devices:
                old = self._pools[d]
                torch._C._cuda_endAllocateToPool(d, old.id)
                ended.append(d)
                if d not in self._freeable:  # no longer routed to: freeable without an anchor
                    torch._C._cuda_releasePool(d, old.id)
                    torch._C._cuda_releasePool(d, old.id)
                gone = self._retired_anchors.pop(d, None)
                if gone is not None:
                    _let_go(gone)
                    del gone
            _pytorch_empty_cache()  # no capture underway on these devices: deferred blocks come back
        finally:
            for d in ended:  # whatever happened above, no device stays outside the budget
                torch._C._cuda_beginAllocateToPool(d, fresh[d].id)
                self._pools[d] = fresh[d]
                self._freeable.discard(d)
                anchor = self._anchors.pop(d, None)
                if anchor is not None:
                    self._retired_anchors[d] = anchor
            try:
                for d in ended:
                    self._make_freeable(d)
            finally:
                _tls.cycling = False
        _cycles["count"] += 1
        _cycles["bytes"] += awaited
        return awaited

    def _pool(self, device: int) -> Any:
        pool = self._pools.get(device)
        if pool is None:
            with torch.cuda.device(device):
                pool = torch.cuda.MemPool(self._pluggable)
            self._pools[device] = pool
            _keep_forever(pool)
        return pool

    def _retire_pools(self) -> None:
        """Pool mode, outside every `with`: make each device's pool freeable (its MemPool's use is
        its only one) and start a new one for the next `with`. Tensors from a retired pool stay
        valid; their blocks are freed to the device by a later empty_cache."""
        for d, pool in list(self._pools.items()):
            if self._entered.get(d, 0):
                continue
            torch._C._cuda_releasePool(d, pool.id)
            del self._pools[d]

    # ---- pool mode: the region ----
    def __enter__(self) -> "Allocator":
        if self.closed:
            raise StateError("spillway.torch: this allocator is closed")
        if self.mode == "pool" and self.routed:
            with _lock:
                d = torch.cuda.current_device()
                cm = torch.cuda.use_mem_pool(self._pool(d), d)
                cm.__enter__()
                self._pool_ctx.append((d, cm))
                self._entered[d] = self._entered.get(d, 0) + 1
            _tls.pool_depth = getattr(_tls, "pool_depth", 0) + 1
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.mode == "pool":
            if self._pool_ctx:
                _tls.pool_depth -= 1
                with _lock:
                    d, cm = self._pool_ctx.pop()
                    self._entered[d] -= 1
                    cm.__exit__(*exc)
        else:
            self.close()

    def close(self) -> None:
        """Stop routing new allocations (global mode). Tensors already allocated stay valid and go
        back to spillway when freed; the device contexts stay (offloaded modules keep using them)."""
        global _active
        with _lock:
            if self.closed:
                return
            if self.routed and self.mode == "global":
                for d, pool in self._pools.items():
                    torch._C._cuda_endAllocateToPool(d, pool.id)
            self.closed = True
            if _active is self:
                _active = None

    def collect(self) -> int:
        """See spillway.torch.collect()."""
        return collect() if current() is self else 0

    # ---- statistics (see the module functions) ----
    def memory_stats(self, device: Any = None) -> Dict[str, int]:
        return memory_stats(device)

    def memory_summary(self, device: Any = None) -> str:
        return memory_summary(device)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("routing" if self.routed else "contexts only")
        return f"<spillway.torch.Allocator mode={self.mode} backend={self.backend} {state} conf={self.conf!r}>"


def _attach_observer() -> None:
    global _observer_attached
    if _observer_attached:
        return
    torch._C._cuda_attach_out_of_memory_observer(_oom_observer)
    _observer_attached = True


def use_allocator(budget: Union[int, str, Dict[int, Union[int, str]], None] = None, mode: str = "global",
                  **options: Any) -> Allocator:
    """Put PyTorch's CUDA allocations under spillway's budget, one context per device.

    budget: bytes or a size ("6GiB", "80%") for every device, or per device as a dict
    ({0: "4GiB", 1: "8GiB"}) or the string "0:4GiB;1:8GiB" (unlisted devices: 90%). The budget
    covers everything routed to spillway on the device: tensors, PyTorch's cached blocks of them,
    and the weights of modules offloaded with spillway.torch.offload() while this is active (an
    allocation that does not fit evicts unpinned weights by the policy before it fails).
    mode: "global" routes every allocation of every device from every thread (training: the
    backward pass runs on autograd's threads); "pool" routes only what the current thread
    allocates inside `with allocator:` (PyTorch's use_mem_pool), so a backward pass started
    inside still allocates on autograd's threads outside the budget.
    options: other spillway options (policy="lru"|"plan", on_exhaust="fail"|"evict", ...);
    SPILLWAY_CONF applies first. backend="emu" creates emulated contexts and routes nothing
    (tests; offload on CPU).
    Call it before the first CUDA allocation you want budgeted, once per process: the contexts
    are created with these options on first use and kept (a second call with other options
    raises StateError). An allocation refused under the budget raises
    spillway.torch.OutOfMemoryError, a torch.OutOfMemoryError, with spillway's message.
    CUDA graph capture raises at once in mode="global", and inside `with` in mode="pool".
    """
    global _active
    if mode not in _MODES:
        raise ConfigError(f"use_allocator: mode must be 'global' or 'pool', got {mode!r}")
    backend = options.get("backend", "auto")
    if backend == "auto":
        backend = "cuda" if torch.cuda.is_available() else "emu"
        options["backend"] = backend
        if backend == "emu":
            warnings.warn("spillway.torch.use_allocator: no CUDA device (torch.cuda.is_available() is False): "
                          "PyTorch's tensors are not routed and nothing they allocate is capped; the contexts "
                          "are emulated (pass backend='emu' to ask for that)", RuntimeWarning, stacklevel=2)
    # Offloaded weights in these contexts are stepped and learned by the plan policy unless asked.
    options.setdefault("policy", "plan")
    conf = _conf_text(budget, options)
    with _lock:
        if _active is not None and not _active.closed:
            raise StateError(f"use_allocator: one is already active ({_active!r}); close() it first")
        st = _lib_c.spw_torch_configure(conf.encode())
        if st == _lib.Status.ERR_STATE:
            if conf != _configured.get("conf"):
                raise StateError(
                    f"use_allocator: the device contexts were created with {_configured.get('conf')!r}; options "
                    f"{conf!r} apply only to contexts not yet created (one configuration per process)")
        else:
            check(st)
            _configured["conf"] = conf
        alloc = Allocator._start(mode, conf, backend)
        _active = alloc
        return alloc


_configured: Dict[str, str] = {}


def current() -> Optional[Allocator]:
    """The active Allocator, or None."""
    return _active if _active is not None and not _active.closed else None


def shared_context(device: Any, backend: str) -> Optional[Context]:
    """For offload(): the context of device while use_allocator is active on the same backend,
    else None."""
    a = current()
    if a is None or a.backend != backend:
        return None
    return context(device)


def release_torch_cache(ctx: Context) -> bool:
    """For offload(): weights cannot become resident in ctx. When ctx is the allocator's, give
    PyTorch's cached blocks back to spillway (torch.cuda.empty_cache) and return True (retry)."""
    a = current()
    if a is None or not a.routed or not isinstance(ctx, _SharedContext):
        return False
    _torch_empty_cache(a)
    return True


# ---- statistics, named as torch.cuda names them ----

def memory_stats(device: Any = None) -> Dict[str, int]:
    """spillway's counters of device's context, flattened ("held.current", "live.peak", ...),
    plus "weights.current"/"tensors.current" (bytes of offloaded weights on the device and of
    everything else spillway hands to PyTorch), "budget", and PyTorch's calls into spillway on the
    device ("torch_alloc_calls"/"torch_free_calls": segments, and "torch_alloc_ns"/"torch_free_ns":
    host time inside them)."""
    ctx = context(device)
    flat = ctx.memory_stats()
    flat["weights.current"] = flat["resident_bytes.current"]
    flat["weights.peak"] = flat["resident_bytes.peak"]
    flat["tensors.current"] = _tensor_bytes(flat["requested.current"], flat["resident_bytes.current"])
    flat.update(_call_stats(_device_index(device)))
    return flat


def _call_stats(device: int) -> Dict[str, int]:
    """PyTorch's calls into spillway on device since the process started: segment allocations
    and frees (its cache of blocks serves the rest) and the host time spent inside them."""
    out = (ctypes.c_uint64 * 4)()
    _lib_c.spw_torch_call_stats(device, out)
    return {"torch_alloc_calls": int(out[0]), "torch_alloc_ns": int(out[1]),
            "torch_free_calls": int(out[2]), "torch_free_ns": int(out[3])}


def _routed() -> bool:
    a = current()
    return a is not None and a.routed


def memory_allocated(device: Any = None) -> int:
    """Device bytes of live tensors and resident offloaded weights on device. While routed, the
    tensors are PyTorch's own count (its cached free blocks are not allocated, as in
    torch.cuda.memory_allocated); otherwise everything spillway has handed out."""
    s = context(device).stats()
    if _routed():
        return torch.cuda.memory_allocated(_device_index(device)) + s["resident_bytes"]["current"]
    return s["live"]["current"]


def max_memory_allocated(device: Any = None) -> int:
    """Peak of memory_allocated since the last reset_peak_memory_stats. While routed: PyTorch's
    peak of tensors plus the peak of offloaded weights (a bound: the two peaks may not coincide)."""
    s = context(device).stats()
    if _routed():
        return torch.cuda.max_memory_allocated(_device_index(device)) + s["resident_bytes"]["peak"]
    return s["live"]["peak"]


def memory_reserved(device: Any = None) -> int:
    """Device bytes spillway holds on device; never above the budget."""
    return context(device).memory_reserved()


def max_memory_reserved(device: Any = None) -> int:
    return context(device).max_memory_reserved()


def reset_peak_memory_stats(device: Any = None) -> None:
    """Start the peaks of device's counters again from now (also PyTorch's, on CUDA)."""
    ctx = context(device)
    check(_lib_c.spw_stats_reset_peaks(ctx._live()))
    if _routed():
        torch.cuda.reset_peak_memory_stats(_device_index(device))


def empty_cache() -> None:
    """Give PyTorch's cached blocks back to spillway, then spillway's cache back to the device. In
    global mode the blocks that awaited other streams (record_stream, NCCL) come back too (see
    collect()). Blocks PyTorch cannot free are kept: those of segments partly in use, and in pool
    mode those of the pool a `with` is routing to, including its blocks used on another stream."""
    a = current()
    if a is not None and a.routed or (a is None and torch.cuda.is_available() and torch.cuda.is_initialized()):
        _torch_empty_cache(a)
    _lib_c.spw_torch_reset()


def _torch_empty_cache(a: Optional[Allocator]) -> None:
    """PyTorch's empty_cache with the routed pools made freeable first (see the module's
    docstring): global mode, every device spillway has a context for, after a routing cycle of
    those whose blocks await other streams; pool mode, the pools no `with` is routing to, retired.
    Inside a routing cycle (the anchor's allocation failing there), PyTorch's empty_cache only."""
    if a is not None and a.routed and not getattr(_tls, "cycling", False):
        with _lock:
            if a.mode == "global":
                used = _context_devices(a)
                awaiting = _awaiting(used)
                if awaiting:
                    a._cycle(awaiting)  # empties PyTorch's cache itself
                for d in used:
                    if d not in a._freeable:
                        a._make_freeable(d)  # in the observer, a refused anchor raises there and is caught
                if awaiting:
                    return
            else:
                a._retire_pools()
    _pytorch_empty_cache()


def collect() -> int:
    """Global mode: give back the blocks PyTorch keeps for tensors that were used on another stream
    (Tensor.record_stream, NCCL collectives: DDP, FSDP) and are gone. PyTorch recycles them only
    while no pool is routed to, so under use_allocator(mode="global") they would stay out of reach;
    a routing cycle (see the module's docstring) brings them back to spillway. Returns the bytes
    that awaited (0 when none did: one look at PyTorch's counters, nothing else).

    A cycle waits for the other streams' work on those blocks, empties PyTorch's cache, and starts
    a fresh pool. spillway.torch.empty_cache(), torch.cuda.empty_cache(), a segment refused under
    the budget and the out-of-memory error do the same; call collect() once per step where other
    streams use tensors (after optimizer.step()), so those blocks never push offloaded weights out.
    Call it where no other thread allocates: their allocations during the cycle come from PyTorch's
    own pool, outside the budget. Nothing to do (0) in pool mode or when nothing is routed."""
    a = current()
    if a is None or not a.routed or a.mode != "global":
        return 0
    with _lock:
        awaiting = _awaiting(_context_devices(a))
        return a._cycle(awaiting) if awaiting else 0


def _has_context(device: int) -> bool:
    out = ctypes.c_void_p()
    return _lib_c.spw_torch_context(device, 0, ctypes.byref(out)) == 0


def _context_devices(a: Allocator) -> List[int]:
    """The devices a routes to that spillway has a context for (where anything was allocated)."""
    return [d for d in list(a._pools) if _has_context(d)]


def _tensor_bytes(requested: int, weights: int) -> int:
    """Device bytes spillway hands to PyTorch: requested, not live, less the offloaded weights
    (live counts whole blocks, a plain segment's rounding to pages included)."""
    return max(0, requested - weights)


def memory_summary(device: Any = None) -> str:
    """Readable report of device: budget, held, tensors and offloaded weights apart, refusals,
    then spillway's table."""
    idx = _device_index(device)
    ctx = context(idx)
    s = ctx.stats()
    weights = s["resident_bytes"]["current"]
    tensors = _tensor_bytes(s["requested"]["current"], weights)
    a = current()
    lines = [
        f"spillway.torch allocator, device {idx} ({ctx.backend}, mode {a.mode if a else 'closed'})",
        f"  budget            {format_size(s['budget'])}",
        f"  held              {format_size(s['held']['current'])} (peak {format_size(s['held']['peak'])})",
        f"  tensors           {format_size(tensors)}  (PyTorch's segments: its tensors and its cache of them)",
        f"  offloaded weights {format_size(weights)} on the device in {s['buffers_resident']['current']} units, "
        f"{s['buffers_host']['current']} units on the host only",
        f"  cached            {format_size(s['cached']['current'])}",
        f"  evictions         {s['evictions_clean']['total'] + s['evictions_dirty']['total']}, "
        f"refusals {int(_lib_c.spw_torch_oom_count(idx))}, PyTorch's cache reclaimed {_reclaims['freed']} of "
        f"{_reclaims['calls']} times asked",
        f"  other streams     {format_size(_cycles['bytes'])} of blocks used on other streams brought back by "
        f"{_cycles['count']} routing cycles",
        "",
        ctx.summary(),
    ]
    return "\n".join(lines)


def _shutdown() -> None:
    """Tests: forget every context (the library destroys them; refused while memory is live)."""
    global _active
    with _lock:
        check(_lib_c.spw_torch_shutdown())
        for ctx in _contexts.values():
            ctx._forget()
        _contexts.clear()
        _configured.clear()
        if _active is not None:
            _active.closed = True
        _active = None
