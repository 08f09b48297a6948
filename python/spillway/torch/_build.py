"""The construction of an Offload (offload(), offload_all()): its state, the units packed and
registered, the trained parameters and the optimizer set up, the forwards wrapped. What each
part of the state is for is said where it is set; the hot path that uses it is _offload.py's."""
from __future__ import annotations

import ctypes
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn

from .. import _lib
from ..core import Context, format_size
from . import _added, _adapters, _ahead, _alloc, _compile, _edits, _experts, _overlap, _parallel, _patch, _prehooks, _recompute, _setup, _train, _views
from ._budget import resolve_budget
from ._device import _resolve_device
from ._units import _Unit, _param_owners, running_stats

if TYPE_CHECKING:  # pragma: no cover
    from ._offload import Offload

_lib_c = _lib.lib
_STASH_MIN = 1 << 20  # activations below this stay PyTorch's: a buffer each would cost more than it saves
# Host time per acquire is also counted in buckets of 1024 ns (the last one: that and more), so
# that hook_stats() can give the median of the calls, which waits for room do not move.
HIST_BUCKETS = 4096


def build(cls: Any, module: nn.Module, budget: Any, policy: str, device: Any, blocks: Optional[Sequence[nn.Module]],
           trace: Optional[str], offload_trainable: Optional[bool], options: Dict[str, Any],
           context: Optional[Context] = None, optimizer: Any = None,
           activations: bool = False, host_update: str = "spillway",
           overlap_update: Union[bool, str] = False, train_on_device: Any = "auto",
           process_group: Any = "auto", recompute: Any = False) -> "Offload":
    """An Offload (of cls) of module, made as offload() and offload_all() ask: what is offloaded
    and the budget resolved, the units laid out before anything moves (_setup.layout); then each
    unit packed and registered, the trained parameters and the optimizer set up and the forwards
    wrapped, everything undone on failure (_patch.undo)."""
    off = object.__new__(cls)
    off._closed = True
    off._recompute: Optional[_recompute.Recompute] = None
    _setup.check_new(module)
    recompute = _recompute.resolve(recompute, module)
    # the ranks over which training averages its gradients (_parallel), or None
    off._average = _parallel.resolve(process_group, optimizer is not None)
    off._ddp_hidden: Any = None  # what _parallel.hide_offloaded changed, for remove()
    backend, dev = _resolve_device(options.pop("backend", "auto"), device)
    split_experts = _experts.resolve(options.pop("experts", "auto"))
    off.module = module
    off.device = dev
    off.backend = backend

    # ---- what is offloaded ----
    params, names = _setup.check_module(module, blocks)
    trainable, kept = _setup.trainable(module, params, optimizer, offload_trainable)

    # ---- the budget: given, shared with use_allocator, or the device's free memory less a reserve ----
    ctx_opts = dict(options)
    if trace:
        ctx_opts["trace"] = str(trace)
    # Under use_allocator (or in a pipeline) the weights draw on one context of this device.
    shared = context if context is not None else _alloc.shared_context(dev, backend)
    resolved = resolve_budget(budget, backend, dev, (t for t in params + list(module.buffers()) if id(t) not in kept),
                              ctx_opts, shared)
    budget_v = resolved.bytes
    off.budget_source, off.reserve = resolved.source, resolved.reserve

    # ---- the units (nothing moves yet) and the room a forward needs ----
    off._given_blocks = blocks is not None
    lay = _setup.layout(module, blocks, names, trainable, kept, optimizer, train_on_device, budget_v,
                        shared is not None, ctx_opts, activations, recompute, split_experts)
    kept, units, needs, hooked = lay.kept, lay.units, lay.needs, lay.hooked
    off.min_budget, budget_v, ctx_opts = lay.min_budget, lay.budget, lay.ctx_opts
    off.device_trained_bytes = lay.device_trained
    off.stack_segments = lay.stack  # plain segments chosen for the units of a stack (_partition.a_stack)
    # modules whose fused experts move expert by expert (_experts), by id of the module
    off._fused = {id(f.module): f for f in lay.fused}
    off.in_pipeline = context is not None  # one of several modules offloaded into one context
    off._owns_context = shared is None
    off.context = shared or Context(budget=budget_v, policy=policy, backend=backend, **ctx_opts)
    # the keyword options the context was created with (none under use_allocator's context)
    off.context_options: Dict[str, Any] = {} if shared is not None else ctx_opts

    off.units = units
    off._needs = needs
    # the trainable parameters that stay resident (optimizer=: those trained on the device)
    off._trainable = list(kept.values())
    # what offload() moved to the device to stay there (those parameters, the running statistics
    # of normalization layers: _units.running_stats), with the device each came from
    off._moved_trainable: List[Tuple[torch.Tensor, torch.device]] = []
    # optimizer=: the trainable parameters are offloaded and their host Parameters (the views
    # into the packs) are the master copy the optimizer updates on the host; its step is
    # wrapped (_train.wrap_step) so that it ends by dropping the device copies it made stale.
    off.optimizer = optimizer
    # Activations saved for backward of at least this many bytes go to buffers of the
    # context (_saved.stash); None: they stay PyTorch's.
    off._stash_min: Optional[int] = _STASH_MIN if activations else None
    off._stash_pool: Dict[int, Dict[int, Any]] = {}  # bytes -> {id: spare stash buffer} (_saved.stash)
    off._stash_slots: List[Any] = []  # the buffer of the i-th activation stashed in the last step
    off._stash_next = 0  # stashes so far in this step
    off._open_step = False  # a step left open by a forward (see _top_forward)
    off.host_update = host_update  # "spillway": opt's AdamW steps run in C where they can
    # overlap_update: that C step runs beside the next forward (_overlap.py); _update is the
    # one in flight, _update_pool the threads it runs on (made at the first).
    # overlap_update "backward": the updates are also computed during the backward
    # (_ahead.py), on the same pool.
    off.overlap_update = overlap_update
    off._update: Optional[_overlap.Update] = None
    off._update_pool: Any = None
    off._ahead: Optional[_ahead.Updates] = None
    off.c_steps = 0
    # opt's own host step (where the C one does not apply): the heap's kept size it was given
    # (_train.keep_heap: bytes; 0 where the environment's malloc settings stand; None before
    # the first such step or where the C library has no such control, with the reason)
    off.heap_kept: Optional[int] = None
    off.heap_note = ""
    off._heap_checked = False
    off.activations_stashed = 0
    off.activation_bytes = 0
    off.activations_refused = 0  # stashes the budget had no room for (_saved.stash)
    off._stash_refused: Set[int] = set()  # their places in the step: kept out of the stash from then on
    off._train = optimizer is not None
    # gradients of the trained host Parameters on their way from the device (ToHost)
    off._landing: Optional[_train.GradLanding] = _train.GradLanding(dev) if off._train else None
    off._param_unit: Dict[int, _Unit] = {}  # id(trainable parameter) -> its unit (optimizer= only)
    off._holders = None  # id(module._parameters) -> module, made when a slot needs its module (_holder)
    # Methods wrapped as instance attributes (opt.step, and with overlap_update the points that
    # finish its update): (object, name, whether it had that attribute, it, ours), for remove()
    off._method_wraps: List[Tuple[Any, str, bool, Any, Any]] = []
    off._prehooks: List[Tuple[Any, Any, Any, Any]] = []  # the caller's pre-hooks wrapped (_prehooks)
    off._prehook_targets: List[Tuple[nn.Module, Any]] = []  # the hooked modules whose pre-hooks get wrapped
    off._handles_seen = 0  # torch's hook handle counter when they were last looked at (_prehooks.wrap_late)
    off.optimizer_steps = 0
    off.step_evictions = 0  # device copies of units dropped after optimizer steps
    off._edits: Optional[_edits.HostEdits] = None  # the offloaded weights, watched for edits between forwards
    off.edit_evictions = 0  # device copies dropped because their host copies were edited
    # Handles of the hooks on device tensors of offloaded trainable parameters: removed with the
    # offload (a tensor that still holds a Python hook when the interpreter exits makes torch
    # wait for the interpreter lock in its destructor, and the exit hangs).
    off._grad_hooks: List[Any] = []
    # (module, whether its forward was an instance attribute, that attribute): see _patch.wrap_forward
    off._wrapped: List[Tuple[nn.Module, bool, Any]] = []
    off._tops: Set[int] = set()  # ids of modules given a top-level forward besides module (_adapters.follow_unloads)
    off._ctx_handle = off.context._handle
    off._emu = backend == "emu"
    off._acquired: Dict[int, _Unit] = {}  # devptr -> unit, for the saved-tensor lookup
    off._explicit_steps = 0
    off._depth = 0
    off._lock = threading.RLock()  # held by the thread running a forward (_top_forward, _units_call)
    off._owner = 0  # the thread running the top-level forward (threading.get_ident), while _depth
    off._saved_hooks: Optional[Any] = None
    off._devptr = ctypes.c_void_p()
    off._devptr_ref = ctypes.byref(off._devptr)
    off._dev_index = off.device.index if off.device.index is not None else 0
    # What the hot path calls, read from _lib_c here, at offload(), and from these attributes
    # at each call: a stand-in set on _lib_c before offload() (bench/dev/hook_cost.py) or on
    # them after (torch_offload.py's C-call profile) is what the wrappers call.
    off._c_acquire = _lib_c.spw_acquire
    off._c_release = _lib_c.spw_release
    off._c_release_acquire = _lib_c.spw_release_acquire
    # Inside the top-level forward a unit's C release waits for the next acquire and goes
    # with it in one call (spw_release_acquire): one crossing and one lock a block, not two.
    # The record of its last use lands a little later in stream order (later is safe). When
    # the next acquire is of that same unit on the same stream (a run of small modules
    # grouped into one unit), neither call is made: it stays acquired. The forward's end
    # releases what is still pending, before its step ends.
    off._pend: Optional[_Unit] = None
    off._pend_stream: Optional[int] = None
    off._c_sync = _lib_c.spw_stream_synchronize if off._emu else None
    off._raw_stream = off._stream_function()
    off.hook_ns = 0
    off._hook_hist = [0] * HIST_BUCKETS  # host time per hook call, 1024-ns buckets
    off.acquires = 0
    off.view_builds = 0
    off.view_repairs = 0  # releases that pointed device tensors back after a forward replaced them
    off.steps = 0
    off.saved_packed = 0
    off.saved_reacquires = 0
    off.buffer_writebacks = 0
    off.outputs_cloned = 0
    off.final_stats: Optional[Dict[str, Any]] = None

    # ---- move: pack and register each unit; undo everything on failure ----
    _compile.prepare()  # before any compiled call can reach the hooks
    try:
        owners = _param_owners(module)
        pageable = off.context.stats()["host_pageable"]["current"]
        sliced = {id(u) for f in off._fused.values() for u in f.all_units()}
        for u in units:
            if id(u) not in sliced:
                _views.pack(off, u, owners)
        for f in off._fused.values():
            _experts.pack(off, f)
        _warn_pageable(off.context.stats()["host_pageable"]["current"] - pageable, sum(u.nbytes for u in units))
        off._edits = _edits.HostEdits(units)
        if off._train:
            _train.to_host(off, optimizer)
        if backend == "cuda":  # what stays resident, on the device: trainable parameters, running statistics
            for p in [p for _, p in off._trainable] + list(running_stats(module).values()):
                if p.device != dev:
                    off._moved_trainable.append((p, p.device))
                    p.data = p.data.to(dev)
                    if p.grad is not None:
                        p.grad = p.grad.to(dev)
        if off._train:  # the optimizer's state of the parameters trained on the device goes with them
            _train.move_state(optimizer, "param", {id(p) for _, p in off._trainable})
        if off._average is not None:  # every rank starts from rank 0's weights and buffers, as under DDP
            off._average.broadcast(_parallel.module_state(module, _train.trained_tensors(off)), dev)
            off._average.watch(p for _, p in off._trainable)
            off._landing.average = off._average
        install(off, module, hooked)
        if recompute:
            off._recompute = _recompute.install(off, recompute, budget_v if shared is not None else None)
        off._ddp_hidden = _parallel.hide_offloaded(module, offloaded_tensors(off))
        if off._train:
            _train.wrap_step(off, optimizer)
            if overlap_update:
                _train.wrap_sync_points(off, optimizer)
            if overlap_update == "backward" and host_update == "spillway":
                off._update_pool = _overlap.new_pool()
                off._ahead = _ahead.Updates(optimizer, off._update_pool)
                off._landing.ahead = off._ahead
    except BaseException:
        _patch.undo(off)
        raise
    off._closed = False
    _setup.ACTIVE[module] = weakref.ref(off)
    return off



def offloaded_tensors(off: "Offload") -> List[torch.Tensor]:
    """The tensors the modules hold that the offload moves for inference: its entries' (but
    the parameters optimizer= trains) and the fused experts parameters whose slices are its
    entries."""
    out = [e.tensor for u in off.units for e in u.entries
           if not (e.tensor.requires_grad and off._train)]
    return out + [p for f in off._fused.values() for p in f.params]


def _warn_pageable(refused: int, total: int) -> None:
    """Say so when some packs are not page-locked (WSL2 limits pinned memory, pin_limit caps it):
    they stay usable, but a copy from pageable memory is staged by the driver, slower, and holds
    the calling thread until it is done. The library gives the page-locked memory to the packs
    that move (pin_rebalance), so the cost is what moves beyond it."""
    if refused > 0:
        warnings.warn(f"spillway: {format_size(refused)} of the {format_size(total)} of offloaded weights could "
                      "not be page-locked (the system's limit on pinned memory, or pin_limit); the page-locked "
                      "memory goes to the weights that move each step, and uploads of the rest run slower and "
                      "wait on the host (free host memory, or raise the limit)", stacklevel=4)


def install(off: "Offload", module: nn.Module, hooked: List[nn.Module]) -> None:
    """Wrap the forward of each hooked module (_block_forward) and of the top level (_top_forward)."""
    off._top_units = off._needs.get(id(module), [])
    below = [m for m in hooked if m is not module]  # the top level acquires its own units in its wrapper
    for m in below:
        f = off._fused.get(id(m))
        inner = m.forward if f is None else _experts.forward(off, f, m.forward)
        _patch.wrap_forward(off, m, off._block_forward(m, inner, off._needs[id(m)]))
    _patch.swap_device_property(off, module)
    _patch.guard_conversions(off, module)
    _adapters.watch_merges(off, module.modules())
    _adapters.stand_by(off, below)
    _adapters.follow_unloads(off, module, wrap_top)
    _added.watch(off, module)
    wrap_top(off, module)
    _prehooks.wrap(off, module, hooked)


def wrap_top(off: "Offload", module: nn.Module) -> None:
    """Make module's forward a top-level one (_top_forward: steps, edits and additions looked
    at first): the offloaded module's, and the model peft's merge_and_unload() returns from it."""
    inner = module.forward

    # the wrapper holds off: an offload lives as long as its module's forward needs it
    def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if mod is not module:
            return _patch.copied_forward(mod, args, kwargs)
        if off._closed:
            return inner(*args, **kwargs)
        return off._top_forward(inner, args, kwargs)

    _patch.wrap_forward(off, module, forward)
