"""spillway.torch.offload: a module's frozen weights in pinned host memory, moved to the device
block by block as the forward pass reaches them.

How it works, and the contracts it keeps:

- Units. By default they come from the module tree and the budget (_partition.py): a module whose
  tensors fit a quarter of the budget is one unit, a larger one is split into its children, runs
  of small neighbours form one unit; blocks=[...] names them instead. Every other module with
  parameters or buffers of its own is a unit of its own. A unit's
  tensors are packed contiguously (256-byte aligned) into ONE anonymous mapping that is
  registered as the host copy of ONE read-only spillway buffer (spw_buf_register_host: no second
  host copy). Between forwards every offloaded tensor is a CPU tensor over its bytes of that
  pack, on a storage of its own (_views.pack), so state_dict(), saving and printing work and
  read the real values.
- A tensor is assigned to the first unit that reaches it, so a tied weight (one Parameter in two
  modules) is stored once; each module that holds it acquires that unit.
- Hooks. offload() wraps the forward of every hooked module (each block, each other module with
  tensors of its own, and the top-level module): an instance attribute `forward`, as
  accelerate's hooks are, so nn.Module keeps its fast path; remove() puts back what was there.
  The wrapper acquires the module's units on the current stream (CUDA: torch's current stream;
  emu: the context's default stream, then a synchronize because CPU torch runs synchronously)
  and points the module at the device copy: each module holding an offloaded parameter gets a
  device tensor in its _parameters dict in place of the Parameter (a dict store; the Parameter
  object itself stays the host view), and each buffer's .data is set to a device tensor
  (buffers keep their identity: modules alias and re-register them). After the forward (also
  when it raises) it puts the Parameters and host views back and releases on the same stream.
  Forward hooks of the caller's own run outside the wrapper; its pre-hooks on the modules below
  the top level, present at offload() or registered later, run with the module's units acquired
  (_prehooks.py). A deep copy of an offloaded
  module is a plain module on copies of the host views.
  Acquisitions are counted per unit, so nested and repeated calls are safe. No host
  synchronization on the CUDA path. A parameter that a module replaces during its forward is
  left to it.
- Each tensor has device tensors for the offload's life, one set per device address its unit
  came to (up to _DEV_SETS; past that the least recently used set is re-pointed). When the
  unit comes back at one of them an acquire costs one ctypes call plus a dict store per
  parameter holder; at another address, also one storage over the unit and a Tensor.set_ per
  tensor.
- One call of the top-level module is one plan step (step_begin/step_end around its forward),
  unless the caller marks steps with `with off.step():`.
- Backward. Tensors autograd saves while a unit is acquired that lie inside it are replaced
  (torch.autograd.graph.saved_tensors_hooks, _saved.py) by a record (unit, offset, sizes,
  strides, dtype); backward re-acquires the unit, clones the view (device to device,
  stream-ordered) and releases it. The hooks are active around the top-level forward and
  around any hooked module called outside it (blocks driven by the caller's own loop, a
  checkpoint's recomputation), so nothing saved for backward points at device memory that may
  be evicted, whichever way the model is run.
- Trainable parameters (requires_grad=True) of a model with frozen weights stay resident on the
  device by default and the summary lists them; in a model none of whose weights is frozen they
  are offloaded for inference (a backward that reaches one raises StateError at its end,
  _errors.py). offload_trainable forces either.
- Training (optimizer=opt): the trainable parameters are offloaded and their host Parameters
  are the master copy. While grad is enabled the slot of each one gets, instead of the device
  tensor, _train.ToHost(parameter, device tensor): an alias of the device tensor whose backward
  hands the gradient to _train.GradLanding, which copies it to pinned host memory on a side
  stream without waiting and, at the end of the backward (one wait), sets or adds it to the
  host Parameter's .grad (accumulation, zero_grad, clipping and parameter groups work as on a
  resident model). The device tensors of trained units never require grad. Such a
  unit takes the general acquire path under grad (_acquire, u.live: what the slots hold, for the
  release to recognise); under no_grad and for frozen units the common case is unchanged. opt
  steps on the host (its state is there too); its step is wrapped (an instance attribute, a
  method bound to opt; remove() puts back what was there) so that it ends by evicting the
  units holding opt's parameters: a read-only buffer's device copy is dropped without a
  transfer, and the next acquire uploads the updated host copy. The host step runs after
  the backward's gradients have landed; a unit the plan prefetched meanwhile holds old values
  and is dropped by the eviction.
- Buffers (rotary tables, norm statistics) are offloaded like weights, read-only. A buffer
  modified in place during a forward is detected at release (its version counter moved) and
  its new contents are written through to the host copy, so nothing is lost; this costs a
  device-to-host copy, so modules that update buffers every call (batch norm in training) are
  better left out with blocks=[...]. A module that replaces a buffer object is not supported.
- Weights read directly by a parent's forward (self.child.weight, not through child(...)), or
  through a reference kept outside the modules' parameter dicts, are not covered by any hook:
  on CUDA they are host tensors and torch raises a device mismatch.
"""
from __future__ import annotations

import collections
import contextlib
import operator
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn

from .. import _lib
from ..errors import StateError, error_for
from .. import errors as _errors
from . import _adapters, _added, _alloc, _build, _edits, _parallel, _patch, _prehooks, _report, _train, _views
from ._errors import OutOfMemoryError, stray_error
from ._saved import saving
from ._units import _DevSet, _Unit, _columns, _storage_at

_lib_c = _lib.lib
_READ = _lib.ACCESS_READ
# The swaps of a set's parameter slots, as loops run in C (_units.py says why): _drain consumes
# an iterator, so _drain(map(_setitem, dicts, names, values)) is `for ...: dicts[i][names[i]] =
# values[i]`, and all(map(_is, map(_getitem, dicts, names), values)) checks they still hold them.
_drain = collections.deque(maxlen=0).extend
_setitem, _getitem, _is = operator.setitem, dict.get, operator.is_
_ptr = torch.Tensor.data_ptr
_no_torch_function = torch._C.DisableTorchFunction
# Sets of device tensors per unit, at most, each over one of its recent device addresses: the
# static split streams each unit through one of two slots of its room, alternating step by step
# (bench/dev/mixed_units.c); lru and plan without prefetch cycle a unit through up to a budget's
# worth of places (16 in a 2 GiB budget of 128 MiB blocks, where 8 sets re-pointed every streamed
# unit every pass). A set costs empty tensors; a re-point costs a hook a storage and a Tensor.set_
# per tensor (bench/RESULTS.md).
_DEV_SETS = 32
# The last of the buckets of 1024 ns that host time per acquire is counted in (_build.HIST_BUCKETS)
_HIST_LAST = _build.HIST_BUCKETS - 1
_HIST_NS = _HIST_LAST << 10


class Offload:
    """Handle returned by offload(): statistics, explicit steps, and remove()."""

    def __init__(self) -> None:  # use offload()
        raise TypeError("use spillway.torch.offload(module, budget=...)")

    # ------------------------------------------------------------------ construction
    @classmethod
    def _build(cls, module: nn.Module, *args: Any, **kwargs: Any) -> "Offload":
        """See _build.build (offload()'s arguments, in its order)."""
        return _build.build(cls, module, *args, **kwargs)

    # ------------------------------------------------------------------ hot path
    # Each block costs its wrapper's acquire and release per forward, on the host, before its
    # kernels are enqueued. A wrapper around forward, not a forward pre-hook and forward hook:
    # nn.Module then keeps its fast path (no hook dispatch) and the acquire and release share
    # one Python frame. An acquire is one ctypes call (two on emu), an address compare and one
    # map() of dict stores, a release the reverse: the functions are bound at offload(), a
    # unit's device tensors are made once per address it comes to (up to _DEV_SETS, then
    # re-pointed), and the wrappers make no tensor for a unit of parameters whose module
    # returns one tensor. Inside a forward every distinct piece of code a wrapper runs is cold
    # (a layer's worth of torch ran since), so the common case is written out in one
    # frame (_block_forward) rather than through _acquire and _release.
    def _stream_function(self) -> Any:
        """index -> the raw stream acquires run on: torch's current stream of that device on
        CUDA (0 is the legacy default stream, passed as NULL), NULL on emu."""
        if self._emu:
            return lambda index: 0
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return raw
        return lambda index: torch.cuda.current_stream(index).cuda_stream

    def _stream(self) -> Optional[int]:
        return self._raw_stream(self._dev_index) or None

    def _point(self, u: _Unit, ptr: int) -> _DevSet:
        """u's set of device tensors over u at address ptr, made current: the one already there,
        else a new one (up to _DEV_SETS), else the least recently used one re-pointed: one
        storage and one Tensor.set_ per entry."""
        sets = u.dev_sets
        dset = sets.pop(ptr, None)
        if dset is None:
            self.view_builds += 1
            if 0 in sets:
                dset = sets.pop(0)
            elif len(sets) < _DEV_SETS:
                dset = _views.new_set(self, u)
            else:
                dset = sets.pop(next(iter(sets)))
            dset = self._set_at(u, dset, ptr)
        sets[ptr] = dset
        u.dev_at, u.dev_set, u.dev_ptrs = ptr, dset, tuple(map(_ptr, dset[0]))
        return dset

    def _set_at(self, u: _Unit, dset: _DevSet, ptr: int) -> _DevSet:
        """Point dset's tensors at u's device copy at ptr: one storage, a Tensor.set_ each.
        Returns the set (with its wrapper entries' tensors built, the first time)."""
        storage = _storage_at(ptr, u.nbytes, self.device)
        # no_grad: leaves that require grad (offloaded trainable parameters) too; no torch
        # function: a tensor of a Parameter subclass (_views._empty_like) is set, not converted
        with torch.no_grad(), _no_torch_function():
            for e, d in zip(u.pieces, dset[0]):
                d.set_(storage, e.elem_offset, e.shape, e.stride)
        if u.wrapped and any(v is None for v in dset[1][2]):
            dset = _views.complete(u, dset)
        return dset

    def _repoint(self, u: _Unit) -> None:
        """After a forward that replaced what u's device tensors hold (see _Unit.dev_ptrs): point
        them back at u's device copy."""
        u.dev_set = u.dev_sets[u.dev_at] = self._set_at(u, u.dev_set, u.dev_at)
        self.view_repairs += 1

    def _acquire_raw(self, u: Any, stream: Optional[int], mode: int = _READ) -> int:
        """spw_acquire of u's buffer (a unit, or anything with the handle of one of the context's
        buffers) on stream, after the pending release if any (one call); on emu also wait for
        the upload (CPU torch reads at once)."""
        p = self._pend
        if p is None:
            st = self._c_acquire(u.handle, stream, mode, self._devptr_ref)
        elif p is u and mode == _READ and self._pend_stream == stream:
            self._pend = None  # its own pending release: still acquired, nothing to call
            self.acquires += 1
            return u.devptr
        else:
            self._pend = None  # a failed release acquires nothing: its error is raised below
            st = self._c_release_acquire(p.handle, self._pend_stream, u.handle, stream, mode, self._devptr_ref)
        if st:
            self._acquire_failed(u, stream, st, mode)
        if self._c_sync is not None:
            self._emu_wait(u)
        self.acquires += 1
        return self._devptr.value

    def _emu_wait(self, u: Any) -> None:
        """emu: wait for u's upload after its acquire (CPU torch reads device memory at once)."""
        st = self._c_sync(self._ctx_handle, None)
        if st:
            self._c_release(u.handle, None)
            raise error_for(st)

    def _acquire_failed(self, u: Any, stream: Optional[int], st: int, mode: int = _READ) -> None:
        """After spw_acquire returned st: out of device memory while PyTorch's allocator (under
        use_allocator) holds cached blocks of the same context is retried once after releasing
        them; returns when the retry succeeded, else raises (spillway.torch.OutOfMemoryError for
        out of memory)."""
        if st == _lib.Status.ERR_OUT_OF_MEMORY and _alloc.release_torch_cache(self.context):
            st = self._c_acquire(u.handle, stream, mode, self._devptr_ref)
            if not st:
                return
        err = error_for(st)
        if isinstance(err, _errors.OutOfMemoryError):
            raise OutOfMemoryError(err.message) from None
        raise err

    def _acquire(self, u: _Unit) -> None:
        """Acquire u (counted: nested and repeated calls only count) and point its modules at
        the device copy; _block_forward's common case does the same in its own frame."""
        if u.refs:
            u.refs += 1
            return
        if self._update is not None and u.trains:
            self._update.wait_for(u)  # the optimizer's update of its parameters runs beside this forward
        stream = self._raw_stream(self._dev_index) or None
        ptr = self._acquire_raw(u, stream)
        dset = u.dev_set if u.dev_at == ptr else self._place(u, ptr, stream)
        if u.trains and torch.is_grad_enabled():
            self._swap_trained(u, dset)
        else:
            _drain(map(_setitem, *dset[1][:3]))
        if u.buffer_entries:
            self._buffers_in(u, dset)
        u.stream, u.devptr, u.refs = stream, ptr, 1
        self._acquired[ptr] = u

    def _swap_trained(self, u: _Unit, dset: _DevSet) -> None:
        """Point u's modules at its device copy for a forward under grad: the slot of each
        parameter that requires grad gets _train.ToHost(parameter, device tensor), one per tensor
        (its holders share it), the others their device tensor. u.live keeps what the slots
        hold, for the release to recognise."""
        ds, ks, vs, ps = dset[1]
        landing = self._landing
        made: Dict[int, torch.Tensor] = {}
        live = []
        for v, p in zip(vs, ps):
            if p.requires_grad:
                a = made.get(id(v))
                if a is None:
                    a = made[id(v)] = _train.ToHost.apply(p, v, landing)
                live.append(a)
            else:
                live.append(v)
        u.live = tuple(live)
        _drain(map(_setitem, ds, ks, u.live))

    def _place(self, u: _Unit, ptr: int, stream: Optional[int]) -> _DevSet:
        """u's device tensors at ptr, an address other than its last one: a set kept from an
        earlier visit (the split's slots, lru's places), else one made or re-pointed (_point).
        Releases u if that fails."""
        try:
            return self._point(u, ptr)
        except BaseException:
            self._c_release(u.handle, stream)
            raise

    def _buffers_in(self, u: _Unit, dset: _DevSet) -> None:
        for t, v in dset[2]:
            t.data = v
        u.versions = [(e, e.tensor._version) for e in u.buffer_entries]

    def _buffers_out(self, u: _Unit) -> None:
        self._write_back(u)
        for t, h in u.host_pairs:
            t.data = h

    def _unswap_each(self, u: _Unit, vs: Tuple[torch.Tensor, ...]) -> None:
        """Put u's parameters back holder by holder: some module replaced what its slot held
        (vs: the device tensors, or a trained acquisition's u.live) during its forward, and
        keeps its own. A slot emptied with its tensor come back as a buffer of the same name is
        torch's parametrize undone (peft registers a parametrization on a wrapped module for
        each call, and removing it registers the plain tensor it took as a buffer): the
        Parameter goes back."""
        ds, ks, _, ps = u.dev_set[1]
        for d, k, v, p in zip(ds, ks, vs, ps):
            if k not in d:
                m = self._holder(d)
                if m is not None and m._buffers.get(k) is v:
                    del m._buffers[k]
                    d[k] = p
                    continue
            if d.get(k) is v:
                d[k] = p
            else:
                self._forget_slot(u, d, k)

    def _holder(self, d: Dict[str, Any]) -> Optional[nn.Module]:
        """The module whose _parameters d is (the map made at the first need)."""
        if self._holders is None:
            self._holders = {id(m._parameters): m for m in self.module.modules()}
        return self._holders.get(id(d))

    def _release(self, u: _Unit) -> None:
        refs = u.refs
        if refs != 1:
            if refs > 1:
                u.refs = refs - 1
            return
        if u.buffer_entries:
            self._buffers_out(u)
        ds, ks, vs, ps = u.dev_set[1]
        if u.live is not None:  # a trained acquisition: the slots hold its _train.ToHost aliases
            vs, u.live = u.live, None
        if all(map(_is, map(_getitem, ds, ks), vs)):
            _drain(map(_setitem, ds, ks, ps))
        else:
            self._unswap_each(u, vs)
        if tuple(map(_ptr, u.dev_set[0])) != u.dev_ptrs:
            self._repoint(u)
        u.refs = 0
        self._acquired.pop(u.devptr, None)
        if self._pend is not None:
            self._flush()
        if self._depth:
            self._pend, self._pend_stream = u, u.stream
            return
        st = self._c_release(u.handle, u.stream)
        if st:
            raise error_for(st)

    def _flush(self) -> None:
        """The C release left pending by _release, now."""
        u, self._pend = self._pend, None
        if u is not None:
            st = self._c_release(u.handle, self._pend_stream)
            if st:
                raise error_for(st)

    def _forget_slot(self, u: _Unit, d: Dict[str, Any], k: str) -> None:
        """Stop swapping d[k]: the module stored a tensor of its own there during a forward."""
        def drop(slots: Tuple[Any, ...]) -> Tuple[Any, ...]:  # entries (dict, key, ...) but d[k]
            return tuple(x for x in slots if x[0] is not d or x[1] != k)

        u.dev_sets = {at: (x[0], _columns(drop(tuple(zip(*x[1]))), 4), x[2]) for at, x in u.dev_sets.items()}
        u.dev_set = u.dev_sets[u.dev_at]
        u.slot_plan = (drop(u.slot_plan[0]), u.slot_plan[1])

    def _write_back(self, u: _Unit) -> None:
        for e, ver in u.versions:
            if e.tensor._version != ver:  # modified in place: keep the host copy current
                with torch.no_grad():
                    e.host_view.copy_(e.tensor.data)
                self.buffer_writebacks += 1

    def _hook_units(self, units: List[_Unit]) -> Tuple[Tuple[_Unit, ...], Tuple[_Unit, ...]]:
        """(every unit of a hook, those the top level does not hold for the whole step): inside
        the top-level forward a hook leaves out the second kind (the blocks' shared unit of
        small tensors), which cannot be released before the step ends anyway."""
        return tuple(units), tuple(u for u in units if u not in self._top_units)

    def _block_forward(self, module: nn.Module, inner: Any, units: List[_Unit]) -> Any:
        """A forward for a hooked module: acquire its units, run inner, make the output its own
        (_own_output), release them. Inside the top-level forward a module of one unit (a block)
        takes the common case, written out in this frame: the unit not held yet, its C release
        left pending for the next acquire (spw_release_acquire)."""
        every, inner_units = self._hook_units(units)
        one = inner_units[0] if len(inner_units) == 1 else None
        h = one.handle if one is not None else 0
        raw_stream, dev_index, devptr, devptr_ref = self._raw_stream, self._dev_index, self._devptr, self._devptr_ref
        acquired = self._acquired
        clock = time.perf_counter_ns
        tensor = torch.Tensor
        hist = self._hook_hist
        get_ident = threading.get_ident

        def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if mod is not module:
                return _patch.copied_forward(mod, args, kwargs)
            t0 = clock()
            u = one
            if u is None or u.refs or not self._depth or self._owner != get_ident():
                return self._units_call(inner, every, inner_units, args, kwargs, t0)
            stream = raw_stream(dev_index) or None
            p = self._pend
            if p is None:
                st = self._c_acquire(h, stream, _READ, devptr_ref)
            elif p is u and self._pend_stream == stream:
                self._pend = None  # its own pending release (a run of modules sharing it): still acquired
                st = 0
                devptr.value = u.devptr
            else:
                self._pend = None  # a failed release acquires nothing: its error is raised below
                st = self._c_release_acquire(p.handle, self._pend_stream, h, stream, _READ, devptr_ref)
            if st:
                self._acquire_failed(u, stream, st)
            if self._c_sync is not None:
                self._emu_wait(u)
            ptr = devptr.value
            self.acquires += 1
            dset = u.dev_set if u.dev_at == ptr else self._place(u, ptr, stream)
            _drain(map(_setitem, *dset[1][:3]))
            if u.buffer_entries:
                self._buffers_in(u, dset)
            u.stream, u.devptr, u.refs = stream, ptr, 1
            acquired[ptr] = u
            t1 = clock()
            try:
                output = inner(*args, **kwargs)
            except BaseException:
                self._release(u)
                raise
            t2 = clock()
            # the common outputs, a tensor or a 1-tuple of one, checked without the generic walk
            only = output if isinstance(output, tensor) else (
                output[0] if type(output) is tuple and len(output) == 1 and isinstance(output[0], tensor) else None)
            if only is None or ptr <= only.data_ptr() < ptr + u.nbytes:
                output = self._own_output(output, (u,), 0)
            if u.refs != 1 or u.buffer_entries:
                self._release(u)
            else:
                ds, ks, vs, ps = dset[1]
                if all(map(_is, map(_getitem, ds, ks), vs)):
                    _drain(map(_setitem, ds, ks, ps))
                else:
                    self._unswap_each(u, vs)
                if tuple(map(_ptr, dset[0])) != u.dev_ptrs:
                    self._repoint(u)
                u.refs = 0
                del acquired[ptr]
                if self._pend is not None:
                    self._flush()
                self._pend, self._pend_stream = u, stream
            dt = t1 - t0 + clock() - t2
            self.hook_ns += dt
            hist[dt >> 10 if dt < _HIST_NS else _HIST_LAST] += 1
            return output

        if one is None or not one.trains:
            return forward
        fast = forward
        grad_enabled = torch.is_grad_enabled

        def trained_forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            """A trained unit: under grad, or while the optimizer's update may still write it, the
            general path (_acquire swaps in _train.ToHost aliases, and waits for the update);
            otherwise the common case above."""
            if mod is module and (grad_enabled() or self._update is not None):
                return self._units_call(inner, every, inner_units, args, kwargs, clock())
            return fast(mod, *args, **kwargs)

        return trained_forward

    def _units_call(self, inner: Any, every: Tuple[_Unit, ...], inner_units: Tuple[_Unit, ...], args: Any,
                    kwargs: Any, t0: int) -> Any:
        """inner(*args, **kwargs) with a hook's units acquired around it (_hook_units: every
        one, or inside the top-level forward those it does not hold), in general: any number
        of units, nested or repeated calls, a module called outside the top-level forward or
        from another thread than the one running it (or through a reference to the wrapper
        kept past remove(): then inner alone)."""
        if self._closed:
            return inner(*args, **kwargs)
        if self._depth and self._owner == threading.get_ident():
            return self._units_call_locked(inner, inner_units, args, kwargs, t0)
        # outside the top-level forward, or on a thread other than the one running it: one
        # caller at a time (_top_forward holds the lock for its whole forward)
        with self._lock:
            return self._units_call_locked(inner, inner_units if self._depth else every, args, kwargs, t0)

    def _units_call_locked(self, inner: Any, units: Tuple[_Unit, ...], args: Any, kwargs: Any, t0: int) -> Any:
        if self._added and not self._depth:
            self._take_in_added()
        done = 0
        try:
            for u in units:
                self._acquire(u)
                done += 1
        except BaseException:
            for u in reversed(units[:done]):
                self._release(u)
            self.hook_ns += time.perf_counter_ns() - t0
            raise
        t1 = time.perf_counter_ns()
        # Outside the top-level forward nothing records what backward saves from these units.
        scope = saving(self) if not self._depth and torch.is_grad_enabled() else None
        try:
            if scope is None:
                output = inner(*args, **kwargs)
            else:
                with scope:
                    output = inner(*args, **kwargs)
        except BaseException:
            for u in reversed(units):
                self._release(u)
            raise
        t2 = time.perf_counter_ns()
        ending = [u for u in units if u.refs == 1]
        if ending:
            output = self._own_output(output, ending, 0)
        for u in reversed(units):
            self._release(u)
        self._count_hook(t1 - t0 + time.perf_counter_ns() - t2, len(units))
        return output

    def _count_hook(self, dt: int, n: int) -> None:
        """dt ns of host time for n acquires: into hook_ns and, per acquire, the histogram."""
        self.hook_ns += dt
        if n:
            per = dt // n
            self._hook_hist[per >> 10 if per < _HIST_NS else _HIST_LAST] += n

    def _own_output(self, out: Any, ending: Sequence[_Unit], depth: int) -> Any:
        """out with every tensor that views a unit about to be released replaced by a clone:
        an output aliasing a weight or buffer (a slice of a position table) must not point at
        device memory that the next eviction reuses. Looks into tuples, lists and dicts.
        Compares addresses only: host and device pointers share one address space (CUDA UVA;
        emu device memory is host memory), so a host tensor never falls inside a unit."""
        if isinstance(out, torch.Tensor):
            p = out.data_ptr()
            for u in ending:
                if u.devptr <= p < u.devptr + u.nbytes:
                    self.outputs_cloned += 1
                    return out.clone()
            return out
        if depth >= 3 or not isinstance(out, (tuple, list, dict)):
            return out
        if isinstance(out, dict):
            for k, v in list(out.items()):
                nv = self._own_output(v, ending, depth + 1)
                if nv is not v:
                    out[k] = nv
            return out
        changed = None
        for i, x in enumerate(out):
            nx = self._own_output(x, ending, depth + 1)
            if nx is not x:
                if changed is None:
                    changed = list(out)
                changed[i] = nx
        if changed is None:
            return out
        if isinstance(out, list):
            return changed
        return type(out)(*changed) if hasattr(out, "_fields") else type(out)(changed)

    def _top_forward(self, inner: Any, args: Any, kwargs: Any) -> Any:
        # One forward at a time: the modules' parameter slots, the pending release and the step
        # are the offload's, not a thread's, so a second thread's call waits for the first.
        with self._lock:
            return self._top_forward_locked(inner, args, kwargs)

    def _top_forward_locked(self, inner: Any, args: Any, kwargs: Any) -> Any:
        if self._depth:  # the top module calling itself: one step already open
            return inner(*args, **kwargs)
        self._depth = 1
        self._owner = threading.get_ident()
        auto_step = not self._explicit_steps
        grad = torch.is_grad_enabled()
        try:
            if self._train and grad:
                _parallel.check_not_wrapped(self.module)
            elif self._recompute is not None and grad:
                self._recompute.forward_began()
            if self._added:
                self._take_in_added()
            if _prehooks.RemovableHandle.next_id != self._handles_seen:  # hooks registered since: wrap the pre-hooks
                _prehooks.wrap_late(self)
            self._drop_edited()
        except BaseException:
            self._depth = 0
            raise
        # A step spans forward and backward when activations are kept in the budget (the plan
        # must see the reads of what the forward wrote) and when training under grad (the
        # backward acquires the units again, last first: a step of the forward alone made the
        # plan prefetch the next forward's first units at its end, over the last ones the
        # backward needs first). It is left open, and ends at the optimizer's step
        # (_train.wrap_step) or, without an optimizer, at the next forward.
        spans = auto_step and (self._stash_min is not None or (self._train and grad))
        saved = None
        try:
            if spans:
                if self._open_step and self.optimizer is None:
                    self._end_open_step()
                if not self._open_step:
                    self._step_begin()
                    self._open_step = True
            elif auto_step:
                self._step_begin()
            if grad:
                saved = saving(self)
                saved.__enter__()
            t0 = time.perf_counter_ns()
            for u in self._top_units:
                self._acquire(u)
            self._count_hook(time.perf_counter_ns() - t0, len(self._top_units))
            try:
                return inner(*args, **kwargs)
            except RuntimeError as e:  # a device mismatch caused by modules added after offload(): say so
                stray = stray_error(self, e)
                if stray is None:
                    raise
                raise stray from e
        finally:
            try:
                # normally only the top level's own units are left; after an exception, everything
                for u in list(self._acquired.values()):
                    u.refs = 1
                    self._release(u)
                self._flush()
            finally:
                if saved is not None:
                    saved.__exit__(None, None, None)
                if auto_step and not spans:
                    self._step_end()
                self._depth = 0
                self._edits.forward_ended()  # the buffers it wrote are written through
                if self._update is not None:  # every unit it updates was waited for, or unused
                    self.synchronize()

    def _take_in_added(self) -> None:
        """Modules registered in the tree since the last forward (_added): their tensors to the
        device, their adapter layers' merges wrapped."""
        _adapters.watch_merges(self, _added.take_in(self))

    def _drop_edited(self) -> None:
        """Before a forward: drop the device copies of the units whose host tensors were edited
        since the last forward (_edits)."""
        stale = self._edits.stale()
        if stale:
            self._evict_units(stale)

    def refresh_weights(self) -> None:
        """Drop the device copy of every offloaded unit that no optimizer= trains, so that the
        next forward uploads the host copies: after editing the weights in a way the offload
        cannot see (an in-place op on a parameter's .data), or to be sure. Edits through the
        parameters themselves (load_state_dict, in-place ops under no_grad, a .data
        replaced) are found before each forward without it."""
        self._check_between_forwards("refresh_weights()")
        self._flush()
        self._edits.stale()  # a .data replaced is copied into its pack first (another shape: an error, nothing dropped)
        self._evict_units([u for u in self.units if not u.trains])

    def _check_between_forwards(self, what: str) -> None:
        """StateError unless the offloaded module is between forwards (nothing acquired)."""
        if self._depth or self._acquired:
            raise StateError(f"spillway.torch: {what} during a forward of the offloaded module")

    def _evict_units(self, units: List[_Unit]) -> None:
        """Drop the device copies of edited units (also after an edit no version counter sees:
        an adapter merged through .data, _adapters.watch_merges): the next acquire uploads
        their packs."""
        self._flush()
        _edits.evict(units)
        self.edit_evictions += len(units)

    def _end_open_step(self) -> None:
        """End the step a forward left open (activations kept in the budget)."""
        if self._open_step:
            self._open_step = False
            self._step_end()

    # ------------------------------------------------------------------ steps
    def _step_begin(self) -> None:
        self._stash_next = 0
        st = _lib_c.spw_step_begin(self._ctx_handle)
        if st:
            raise error_for(st)

    def _step_end(self) -> None:
        st = _lib_c.spw_step_end(self._ctx_handle)
        if st:
            raise error_for(st)
        self.steps += 1

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Mark one step explicitly (e.g. one generate() call, or forward + backward); while any
        is open, top-level forwards do not mark their own steps."""
        self._live()
        self._explicit_steps += 1
        self._step_begin()
        try:
            yield
        finally:
            self._explicit_steps -= 1
            if not self._closed:
                self._step_end()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """DistributedDataParallel.no_sync() for a model trained through the offload over several
        ranks (process_group): the gradients of the parameters trained on the device are not
        averaged by the backward passes inside, only accumulated, and the first backward after
        it averages what they accumulated, as under DDP. The offloaded parameters' gradients
        are still averaged by each backward, on the device before their copy to the host
        (averaging their accumulated sum would take it through the device again): the same
        numbers to rounding. Without data parallelism it does nothing."""
        self._live()
        avg = self._average
        if avg is None:
            yield
            return
        avg.paused += 1
        try:
            yield
        finally:
            avg.paused -= 1

    # ------------------------------------------------------------------ observability
    def _live(self) -> None:
        if self._closed:
            raise StateError("spillway.torch: this Offload was removed")

    def hook_stats(self) -> Dict[str, Any]:
        """Counters of the Python side (_report.hook_stats says which)."""
        return _report.hook_stats(self)

    def stats(self) -> Dict[str, Any]:
        """The library's counters (Context.stats()) plus "offload": hook_stats(), unit counts."""
        self._live()
        return _report.stats(self)

    def summary(self) -> str:
        """Readable report: units, what stayed resident, bytes moved per step, stalls, plan hits,
        hook time per acquire, then the library's table."""
        self._live()
        return _report.summary(self)

    def synchronize(self) -> None:
        """Wait for the optimizer's update still running beside the forward or computed ahead
        during the backward (overlap_update) and raise its error (a StateError naming it);
        nothing to do otherwise."""
        if self._ahead is not None:
            self._ahead.drain()
        upd, self._update = self._update, None
        if upd is None:
            return
        err = upd.finish()
        if err is not None:
            raise StateError(f"spillway.torch: the optimizer's update on the host failed: {err}") from err

    # ------------------------------------------------------------------ removal
    def remove(self) -> None:
        """Put the module back as it was: every offloaded tensor restored with its values on its
        original device and strides, trainable parameters moved back, hooks and the forward
        wrapper removed, buffers and the context destroyed. With optimizer=: its step put back
        as it was (unless something wrapped it since, an LR scheduler: then our wrapper, left
        inside, only steps), and gradients and optimizer state moved to their parameters'
        devices. final_stats keeps the library's counters taken after the buffers were
        destroyed."""
        self._live()
        if self._depth or self._acquired:
            raise StateError("spillway.torch: remove() during a forward")
        _patch.undo(self)

    def __repr__(self) -> str:
        state = "removed" if self._closed else _report._plural(len(self.units), "unit")
        return f"<spillway.torch.Offload {type(self.module).__name__}: {state}>"
