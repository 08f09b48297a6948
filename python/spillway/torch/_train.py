"""Training through an offload (offload(..., optimizer=opt)): the user's optimizer updates the
host Parameters, the master copies in the units' pinned packs. Gradients reach them through
autograd (ToHost, the alias a trained parameter's slot holds under grad); after each step the
units holding opt's parameters drop their device copies, which the step made stale. Functions
over an Offload's attributes; the hot path that swaps the aliases in is _offload.py's."""
from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .. import _lib
from .. import optim as spw_optim  # the host optimizer's bindings (no torch import there)
from ..errors import ConfigError, InvalidArgument, StateError, UnsupportedError, error_for
from . import _edits, _methods, _overlap
from ._units import _Unit

_lib_c = _lib.lib


def check_optimizer(module: nn.Module, opt: Any, trainable: Dict[int, Tuple[str, torch.Tensor]],
                     offload_trainable: Optional[bool]) -> None:
    """offload(optimizer=opt) is refused before anything moves unless opt is a torch optimizer
    all of whose parameters are parameters of module, and module has trainable ones. Frozen
    parameters in opt (AdamW(model.parameters()) over a model with a frozen encoder) are
    offloaded as frozen weights: opt never sees a gradient of theirs and skips them, as torch's
    optimizers do."""
    if not isinstance(opt, torch.optim.Optimizer):
        raise InvalidArgument(f"offload: optimizer must be a torch.optim.Optimizer, got {type(opt).__name__}")
    if offload_trainable is False:
        raise ConfigError("offload: optimizer= trains the offloaded trainable parameters on the host; it cannot go "
                          "with offload_trainable=False (leave offload_trainable out)")
    if not trainable:
        raise InvalidArgument(f"offload: optimizer= given, but no parameter of {type(module).__name__} requires "
                              "grad: nothing to train")
    names = {id(p): n for n, p in module.named_parameters()}
    for gi, group in enumerate(opt.param_groups):
        for pi, p in enumerate(group["params"]):
            if id(p) in names:  # trainable or frozen: a parameter of the module
                continue
            raise InvalidArgument(f"offload: the optimizer's parameter group {gi}, parameter {pi} is a "
                                  f"{tuple(p.shape)} tensor that is not a parameter of {type(module).__name__}; "
                                  "every parameter of optimizer= must be a parameter of the module")


class GradLanding:
    """The gradients of an Offload's trained host Parameters on their way from the device. A
    ToHost backward hands its gradient here (take) instead of to autograd: on CUDA a copy into
    pinned host memory is enqueued on a side stream (ordered after the backward's stream, so the
    backward's kernels do not wait for it) and the host goes on. At the end of the backward
    (a callback queued with autograd's engine, before backward() returns) land waits for the
    side stream once and sets, or adds to, each Parameter's .grad: accumulation over backwards,
    zero_grad, clipping and parameter groups then act on the host Parameters as on resident ones.
    One host wait a backward, not one a parameter. Hooks registered on the host Parameters do
    not run (autograd never accumulates into them)."""

    __slots__ = ("pending", "queued", "stream", "ahead", "average")

    def __init__(self, device: torch.device) -> None:
        self.pending: list = []  # (host Parameter, host tensor), in the order backward made them
        self.queued = False
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.ahead: Any = None  # _ahead.Updates: told of each gradient and each landing (overlap_update)
        self.average: Any = None  # _parallel.GradAverage: each gradient averaged over the ranks first

    def take(self, host: torch.Tensor, grad: torch.Tensor) -> None:
        ours = self.average is not None
        if ours:
            grad = self.average.average(grad)  # a new tensor, contiguous
        if grad.device == host.device:  # emu: the device tensors are host memory already; a copy of
            h = grad if ours else grad.detach().clone(memory_format=torch.contiguous_format)  # our own
        else:
            s = self.stream
            s.wait_stream(torch.cuda.current_stream(grad.device))
            with torch.cuda.stream(s):
                h = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=True)
                h.copy_(grad, non_blocking=True)
            grad.record_stream(s)
        self.pending.append((host, h))
        if self.ahead is not None:
            self.ahead.offer(host, h, self.stream)
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.land)

    def land(self) -> None:
        """Every pending gradient into its Parameter's .grad (after the copies are done). Also
        called before an optimizer step and a forward, in case a failed backward left some."""
        self.queued = False
        pend, self.pending = self.pending, []
        if not pend:
            return
        if self.ahead is not None:
            self.ahead.landed()
        if self.stream is not None:
            self.stream.synchronize()
        # A parameter used more than once (a tied weight, a block called twice) gets several: they
        # are summed in the order backward made them, then added to .grad, as autograd sums a
        # leaf's incoming gradients before its AccumulateGrad (so accumulation over backwards
        # adds the same sums in the same order as on a resident model).
        sums: Dict[int, list] = {}
        for p, h in pend:
            e = sums.get(id(p))
            if e is None:
                sums[id(p)] = [p, h]
            else:
                e[1] = e[1] + h
        with torch.no_grad():
            for p, h in sums.values():
                if p.grad is None:
                    p.grad = h
                else:
                    p.grad.add_(h)


class ToHost(torch.autograd.Function):
    """What the slot of a trained parameter holds during a forward under grad: an alias of its
    device tensor, whose gradient goes to the host Parameter. forward(host, dev, landing)
    returns a view of dev (the module computes with the device copy); backward gives the
    incoming gradient to landing (GradLanding: copied to the host without a wait, put in
    host.grad at the end of the backward) and nothing to autograd (no device .grad is ever
    kept)."""

    @staticmethod
    def forward(  # type: ignore[override]
            ctx: Any, host: torch.Tensor, dev: torch.Tensor, landing: GradLanding) -> torch.Tensor:
        ctx.host = host
        ctx.landing = landing
        return dev.view_as(dev)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[None, None, None]:  # type: ignore[override]
        ctx.landing.take(ctx.host, grad)
        return None, None, None


def offloaded_trained(off: Any) -> List[Any]:
    """The entries of the parameters off trains on the host (offloaded), in the units' order."""
    return [e for u in off.units if u.trains for e in u.entries if not e.is_buffer and e.tensor.requires_grad]


def trained_tensors(off: Any) -> List[torch.Tensor]:
    """The parameters off trains: the offloaded ones (host Parameters), in the units' order,
    then those trained on the device."""
    return [e.tensor for e in offloaded_trained(off)] + [p for _, p in off._trainable]


def to_host(off: Any, opt: torch.optim.Optimizer) -> None:
    """The gradients of the offloaded parameters, and opt's state of them (all but "step",
    as Optimizer.load_state_dict casts), on the host beside the host Parameters (they are
    already there unless the model was on the device); from_host moves them back."""
    for u in off.units:
        for e in u.entries:
            g = None if e.is_buffer else e.tensor.grad
            if g is not None and g.device != e.host_view.device:
                e.tensor.grad = g.to(e.host_view.device)
    move_state(opt, None)


def from_host(off: Any, opt: torch.optim.Optimizer) -> None:
    for u in off.units:
        for e in u.entries:
            g = None if e.is_buffer else e.tensor.grad
            if g is not None and g.device != e.tensor.device:
                e.tensor.grad = g.to(e.tensor.device)
    move_state(opt, "param")


def move_state(opt: torch.optim.Optimizer, to: Optional[str], only: Optional[set] = None) -> None:
    """opt's state tensors of each parameter (but "step"), or of those whose id is in only, to
    the host (to None) or to the parameter's device (to "param")."""
    for group in opt.param_groups:
        for p in group["params"]:
            if only is not None and id(p) not in only:
                continue
            st = opt.state.get(p)
            if not st:
                continue
            dev = p.device if to == "param" else torch.device("cpu")
            for k, v in list(st.items()):
                if k != "step" and isinstance(v, torch.Tensor) and v.device != dev:
                    st[k] = v.to(dev)


def wrap_step(off: Any, opt: torch.optim.Optimizer) -> None:
    """Make opt.step end by dropping the device copies of the units that hold opt's
    parameters (refresh): the step changed their host copies. An instance attribute, a
    method bound to opt (torch's LR schedulers re-wrap opt.step through its __func__);
    remove() puts back what was there. The wrapper holds this Offload weakly and, once it
    is removed or gone, only steps (so a scheduler that wrapped it afterwards keeps working).
    A closure (LBFGS calls it several times per step, changing the parameters between calls)
    is wrapped too: each call first drops the stale device copies."""
    inner = opt.step
    ref = weakref.ref(off)

    def fresh(closure: Any) -> Any:
        def call() -> Any:
            off = ref()
            if off is not None and not off._closed:
                refresh(off)
            return closure()
        return call

    def step(opt_self: Any, *args: Any, **kwargs: Any) -> Any:
        off = ref()
        if off is None or off._closed:
            return inner(*args, **kwargs)
        if args and callable(args[0]):
            args = (fresh(args[0]),) + args[1:]
        elif kwargs.get("closure") is not None:
            kwargs["closure"] = fresh(kwargs["closure"])
        off.synchronize()  # the last step's update, if it still runs beside the forward
        off._landing.land()
        done: set = set()
        try:
            c_path = off.host_update == "spillway" and not args and kwargs.get("closure") is None and \
                _c_eligible(opt, off)
            # the updates computed during the backward that still hold (none off the C path)
            kept = off._ahead.keep(c_path) if off._ahead is not None else {}
            if c_path:
                # the parameters trained on the device first: their step is enqueued on the
                # device, which runs it while the host updates the others
                device_step(off, opt, inner)
                (_overlap_start if off.overlap_update else c_step)(off, step_work(opt, off, kept), done)
                off.c_steps += 1
                return None
            if not off._heap_checked:
                keep_heap(off, opt)
            return inner(*args, **kwargs)
        finally:  # also after a failed step: it may have updated some parameters
            refresh(off, done)
            off.optimizer_steps += 1
            if off._recompute is not None:
                off._recompute.step_done()
            off._end_open_step()  # forward, backward and this step were one plan step

    for attr in ("__doc__", "__name__", "__qualname__"):
        if hasattr(inner, attr):
            setattr(step, attr, getattr(inner, attr))
    step.__wrapped__ = inner  # type: ignore[attr-defined]
    if getattr(inner, "_with_counter", False):  # a scheduler's count, kept: it runs inside inner
        step._with_counter = True  # type: ignore[attr-defined]
    _methods.install(off, opt, "step", step)


def keep_heap(off: Any, opt: torch.optim.Optimizer) -> None:
    """Before opt's own step first runs on the host: keep freed allocations of its largest host
    parameter's size in the process's heap (spillway.optim.keep_freed). torch's single-tensor
    CPU steps make temporaries of each parameter's size and free them within the step; above
    glibc's own 32 MiB ceiling each is a new mapping whose pages fault in again every step.
    Once per offload; what it kept, or why not, is in the summary. A C library without the
    control only leaves the step as slow as it was: never an error."""
    off._heap_checked = True
    largest = max((p.numel() * p.element_size() for g in opt.param_groups for p in g["params"]
                   if p.device.type == "cpu"), default=0)
    if not largest:
        return
    try:
        off.heap_kept = spw_optim.keep_freed(min(largest, spw_optim.KEEP_FREED_MAX))
    except UnsupportedError as e:
        off.heap_note = e.message


def wrap_sync_points(off: Any, opt: Any) -> None:
    """Make opt.zero_grad(set_to_none=False) (which zeroes the gradients the update reads),
    opt.state_dict() and the module's state_dict() finish the update in flight first
    (Offload.synchronize), for overlap_update. Instance attributes, methods bound to their objects
    (a deep copy binds the copy, which finishes nothing); remove() puts back what was there."""
    ref = weakref.ref(off)

    def zeroes(args: Tuple[Any, ...], kwargs: Dict[str, Any], default: bool) -> bool:
        set_to_none = kwargs.get("set_to_none", args[0] if args else default)
        return not set_to_none

    def wrap(obj: Any, name: str, needs: Any) -> None:
        inner = getattr(obj, name)

        def call(self_: Any, *args: Any, **kwargs: Any) -> Any:
            if self_ is not obj:  # a copy: its class's method
                return getattr(type(self_), name)(self_, *args, **kwargs)
            o = ref()
            if o is not None and not o._closed and needs(args, kwargs) and \
                    (o._update is not None or (o._ahead is not None and o._ahead.busy())):
                o.synchronize()
            return inner(*args, **kwargs)

        functools.update_wrapper(call, inner)
        _methods.install(off, obj, name, call)

    param = inspect.signature(opt.zero_grad).parameters.get("set_to_none")
    default = bool(param.default) if param is not None and param.default is not inspect.Parameter.empty else True
    wrap(opt, "zero_grad", lambda a, k: zeroes(a, k, default))
    wrap(opt, "state_dict", lambda a, k: True)
    wrap(off.module, "state_dict", lambda a, k: True)


def device_step(off: Any, opt: torch.optim.Optimizer, inner: Any) -> None:
    """opt's own step (inner) over the parameters trained on the device (train_on_device) and
    none other: the host-trained parameters' gradients are hidden from it (set to None, as
    torch's optimizers skip a parameter without one) and put back after. Nothing to do when
    every trained parameter is offloaded."""
    pu = off._param_unit
    with_grad = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    if all(id(p) in pu for p in with_grad):
        return  # no parameter trained on the device has a gradient
    hidden = [(p, p.grad) for p in with_grad if id(p) in pu]
    try:
        for p, _ in hidden:
            p.grad = None
        inner()
    finally:
        for p, g in hidden:
            p.grad = g


def _overlap_start(off: Any, work: Work, done: set) -> None:
    """Start the C update of work (step_work) beside the next forward (_overlap.Update). done
    gets the units it opened (their device copies are dropped already)."""
    if off._update_pool is None:
        off._update_pool = _overlap.new_pool()
    upd = _overlap.Update(work, off._update_pool, off._stream())
    upd.start()
    off._update = upd
    opened = {u.index for u, _ in work if u is not None}
    off.step_evictions += len(opened)  # their device copies went with the begin
    done.update(opened)


def refresh(off: Any, done: Optional[set] = None) -> None:
    """Drop the device copy of every unit holding a parameter of the optimizer (spw_evict;
    a read-only buffer's copy is dropped without a transfer): the next acquire uploads the
    host copy the step updated. done: indices of units already refreshed (c_step)."""
    if off._depth or off._acquired:
        raise StateError("spillway.torch: the optimizer stepped during a forward of the offloaded module; "
                         "call opt.step() after backward")
    units: Dict[int, _Unit] = {}
    pu = off._param_unit
    for group in off.optimizer.param_groups:
        for p in group["params"]:
            u = pu.get(id(p))
            if u is not None:
                units[u.index] = u
    stale = [u for u in units.values() if not (done and u.index in done)]
    _edits.evict(stale)
    off.step_evictions += len(stale)


def _renew(off: Any, u: _Unit) -> None:
    """u's parameters were just updated on the host: drop its stale device copy and start
    uploading the new one, so that the upload overlaps the update of the units after it. Into
    free room only (spw_prefetch_free): the units are renewed in the forward's order, and one
    that makes room would push out those renewed before it, which the forward needs sooner; a
    unit the backward left on the device is renewed in its own room, the first ones the forward
    needs as a rule (the backward ends with them)."""
    _edits.evict((u,))
    st = _lib_c.spw_prefetch_free(u.handle, off._stream())
    if st:
        raise error_for(st)
    off.step_evictions += 1


def _host_trained(off: Any, p: torch.Tensor) -> bool:
    """Whether the C step updates p: a parameter offloaded with off (not one it trains on the
    device), or any parameter without an offload."""
    return off is None or id(p) in off._param_unit


def _kernel(opt: torch.optim.Optimizer, group: Dict[str, Any]) -> Any:
    """The spillway.optim step that computes what opt's single-tensor path computes for this
    group, or None: AdamW (and Adam with decoupled weight decay), Adam, SGD; exactly those
    classes, not subclasses, which may change the update."""
    t = type(opt)
    if t is torch.optim.AdamW or (t is torch.optim.Adam and group.get("decoupled_weight_decay", False)):
        return spw_optim.adamw_step
    if t is torch.optim.Adam:
        return spw_optim.adam_step
    if t is torch.optim.SGD:
        return spw_optim.sgd_step
    return None


def _c_eligible(opt: torch.optim.Optimizer, off: Any = None) -> bool:
    """Whether spillway's C step (_kernel) can run opt's step, for the parameters it updates
    (_host_trained), as torch's single-tensor path would: AdamW, Adam or SGD, plain float lr, no
    foreach/fused/capturable/differentiable, every such parameter with a gradient a contiguous
    float32 CPU tensor with a dense float32 gradient."""
    for g in opt.param_groups:
        if _kernel(opt, g) is None or not _group_eligible(g):
            return False
        for p in g["params"]:
            if p.grad is not None and _host_trained(off, p) and not _tensor_eligible(p, p.grad):
                return False
    return True


def _group_eligible(g: Dict[str, Any]) -> bool:
    """A group's options ask for nothing the C step lacks."""
    return not (g.get("foreach") or g.get("fused") or g.get("capturable") or g.get("differentiable")) \
        and isinstance(g["lr"], float)


def _tensor_eligible(p: torch.Tensor, q: torch.Tensor) -> bool:
    """p, with gradient q, is what the C step updates: contiguous float32 on the CPU, q dense
    float32 and contiguous."""
    return (p.device.type == "cpu" and p.dtype == torch.float32 and p.is_contiguous() and not q.is_sparse
            and q.dtype == torch.float32 and q.is_contiguous())


Work = List[Tuple[Optional[_Unit], List[Tuple[Any, Dict[str, Any]]]]]


def step_work(opt: torch.optim.Optimizer, off: Any = None, kept: Optional[Dict[int, Any]] = None) -> Work:
    """opt.step()'s work for spillway's C step, where _c_eligible said yes:
    (unit, [(kernel, its keyword arguments)] for its parameters), in the order of the units (the
    forward's, as a rule; parameters in no unit first). Everything a step reads from opt is
    taken now: its state initialized as torch does (Adam: state["step"], "exp_avg",
    "exp_avg_sq", "max_exp_avg_sq"; SGD: "momentum_buffer"), so that state_dict() and a later
    torch step carry on, and each step count incremented; the hyper-parameters are copied into
    the calls, so that a scheduler changing them afterwards changes the next step only. kept:
    the updates computed ahead to keep (_ahead.Updates.keep), by id(parameter): their step
    counts are incremented and their unit's calls end with their commit."""
    pu = off._param_unit if off is not None else {}
    # unit index (-1: none) -> group index -> its parameters with a gradient, in the group's order
    work: Dict[int, Dict[int, list]] = {}
    for gi, g in enumerate(opt.param_groups):
        for p in g["params"]:
            if p.grad is not None and _host_trained(off, p):
                u = pu.get(id(p))
                work.setdefault(u.index if u is not None else -1, {}).setdefault(gi, []).append(p)
    units = {u.index: u for u in pu.values()}
    out: Work = []
    with torch.no_grad():
        for ui in sorted(work):
            calls: List[Tuple[Any, Dict[str, Any]]] = []
            ahead = []
            for gi, params in work[ui].items():
                g = opt.param_groups[gi]
                kernel = _kernel(opt, g)
                if kept:
                    for p in params:
                        if id(p) in kept:
                            opt.state[p]["step"] += 1
                            ahead.append(kept[id(p)])
                    params = [p for p in params if id(p) not in kept]
                maker = _sgd_calls if kernel is spw_optim.sgd_step else _adam_calls
                calls += [(kernel, kw) for kw in maker(opt, g, params)] if params else []
            if ahead:
                calls.append((off._ahead.commit, dict(aheads=ahead)))
            out.append((units[ui] if ui >= 0 else None, calls))
    return out


def _adam_calls(opt: torch.optim.Optimizer, g: Dict[str, Any], params: List[torch.Tensor]) -> List[Dict[str, Any]]:
    """The adam_step/adamw_step calls of a group's parameters: one per step count."""
    by_step: Dict[int, Tuple[list, list, list, list, list]] = {}
    for p in params:
        st = opt.state[p]
        if not st:
            st["step"] = torch.tensor(0.)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if g["amsgrad"]:
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        st["step"] += 1
        lists = by_step.setdefault(int(st["step"].item()), ([], [], [], [], []))
        for lst, t in zip(lists, (p, p.grad, st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq"))):
            lst.append(t)
    return [dict(params=ps, grads=gs, exp_avgs=m1, exp_avg_sqs=m2, step=step,
                 max_exp_avg_sqs=mx if g["amsgrad"] else None, **adam_hparams(g))
            for step, (ps, gs, m1, m2, mx) in by_step.items()]


def adam_hparams(g: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments of an adam_step/adamw_step call that come from the group, copied."""
    return dict(lr=g["lr"], betas=tuple(g["betas"]), eps=g["eps"], weight_decay=g["weight_decay"],
                maximize=g.get("maximize", False))


def _sgd_calls(opt: torch.optim.Optimizer, g: Dict[str, Any], params: List[torch.Tensor]) -> List[Dict[str, Any]]:
    """The sgd_step calls of a group's parameters: with momentum, those whose buffer is still
    torch's None (their first step: the kernel sets it to the gradient) apart from the others."""
    hp = dict(lr=g["lr"], momentum=g["momentum"], dampening=g["dampening"], weight_decay=g["weight_decay"],
              nesterov=g["nesterov"], maximize=g.get("maximize", False))
    if not g["momentum"]:
        return [dict(params=list(params), grads=[p.grad for p in params], **hp)]
    first: Tuple[list, list, list] = ([], [], [])
    later: Tuple[list, list, list] = ([], [], [])
    for p in params:
        st = opt.state[p]
        buf = st.get("momentum_buffer")
        lists = first if buf is None else later
        if buf is None:
            buf = st["momentum_buffer"] = torch.empty_like(p, memory_format=torch.preserve_format)
        for lst, t in zip(lists, (p, p.grad, buf)):
            lst.append(t)
    calls = []
    for (ps, gs, bs), is_first in ((first, True), (later, False)):
        if ps:
            calls.append(dict(params=ps, grads=gs, momentum_buffers=bs, first_step=is_first, **hp))
    return calls


def c_step(off: Any, work: Work, done: set) -> None:
    """Run the work of a torch.optim.AdamW's, Adam's or SGD's step (step_work) in spillway's C
    kernels (spillway.optim: all cores, vectorized), unit by unit in the order of the units,
    each unit renewed (_renew) as soon as its parameters are done, its index added to done;
    every parameter's update is the same whatever the order."""
    for unit, calls in work:
        for kernel, kw in calls:
            kernel(**kw)
        if unit is not None:
            _renew(off, unit)
            done.add(unit.index)
