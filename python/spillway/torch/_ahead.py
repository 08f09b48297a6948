"""offload(optimizer=opt, overlap_update="backward"): each offloaded parameter's host update is computed
while the backward still runs, as soon as its gradient is in host memory, into shadow tensors
(spillway.optim's Adam with separate outputs: the parameter and opt's state are only read).
opt.step() keeps an update computed ahead where everything it read is still what the step would
read, and computes the update as before where it is not; results are bitwise those of
overlap_update=False either way.

Contracts:
- A parameter's update is computed ahead in a backward pass when opt's step for it would be
  spillway's C Adam or AdamW (_train._kernel, the checks of _train._c_eligible), its state
  exists (not its first step), it got exactly one gradient in the backward of the last step, it
  has no .grad when this one arrives (zero_grad(set_to_none=False) keeps one: nothing is computed
  ahead), the last step had one backward pass, and this is the first backward since that step
  (gradient accumulation: nothing is computed ahead).
- What the update reads is recorded when it is queued: the gradient, the parameter and each state
  tensor (identity and autograd version counter), the step count and the group's
  hyper-parameters. keep() keeps it only if all are unchanged at opt.step(): clipping, a
  scaler's unscale, another backward, zero_grad(set_to_none=False), load_state_dict or a changed
  learning rate each change one, and that parameter's update is computed again then.
- Kept: opt's state takes the shadow moments (its old ones become the next shadows) and the
  shadow parameter is copied into the host Parameter (its unit's pack) by commit(), which the
  step's work runs in the unit's place.
- A step that keeps nothing of what was computed ahead (a loop that clips every step) pauses the
  work ahead for 1, 2, 4 ... up to 64 steps, so that such a loop spends little on it.
- One worker thread per offload, started at the first update queued; it waits for each
  gradient's copy (a CUDA event) and runs the kernels on the offload's pool. drain() waits for
  it to be idle: whatever writes what it reads, or frees it, drains first (opt.step(), through
  Offload.synchronize(); remove()).
- Never raises into the backward: a failed update computed ahead is computed again in the step.
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from .. import optim as spw_optim
from . import _train

_MAX_PAUSE = 64


class Ahead:
    """One parameter's update computed ahead: its inputs as recorded, its outputs, its state."""

    __slots__ = ("p", "g", "gv", "pv", "st", "ins", "vers", "step", "hp", "kernel", "outs", "event", "done",
                 "failed")

    def __init__(self, p: torch.Tensor, g: torch.Tensor, st: Dict[str, Any], ins: Tuple[torch.Tensor, ...],
                 step: int, hp: Dict[str, Any], kernel: Any, outs: Tuple[torch.Tensor, ...],
                 event: Any) -> None:
        self.p = p
        self.g = g
        self.gv = g._version
        self.pv = p._version
        self.st = st
        self.ins = ins  # exp_avg, exp_avg_sq[, max_exp_avg_sq]: opt's state tensors it reads
        self.vers = tuple(t._version for t in ins)
        self.step = step  # the step count after the update
        self.hp = hp
        self.kernel = kernel
        self.outs = outs  # param, exp_avg, exp_avg_sq[, max_exp_avg_sq]: where it writes
        self.event = event  # the gradient's copy to host memory (CUDA), or None
        self.done = False
        self.failed = False


_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


class Updates:
    """The updates of one offload computed ahead (see the module docstring)."""

    def __init__(self, opt: torch.optim.Optimizer, pool: Any) -> None:
        self.opt = opt
        self.pool = pool  # the spillway.optim.Pool the kernels run on
        self.shadows: Dict[int, Tuple[torch.Tensor, ...]] = {}  # id(p) -> spare param[, moments]
        self.pending: Dict[int, Ahead] = {}  # this step's, by id(p)
        self.counts: Dict[int, int] = {}  # gradients each parameter got since the last step
        self.last_counts: Dict[int, int] = {}
        self.backwards = 0  # backward passes since the last step
        self.last_backwards = 0
        self.pause = 0  # steps left without work ahead
        self.pause_len = 1
        self.kept = 0  # parameters whose update computed ahead was kept, in all
        self.dropped = 0  # ... and computed again
        self._queue: List[Ahead] = []
        self._busy = 0  # queued or running
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self._group_of = self._groups()  # id(parameter) -> its group, as of the last step

    # ---- the backward pass (autograd's thread) ----
    def offer(self, p: torch.Tensor, g: torch.Tensor, stream: Any) -> None:
        """p's gradient g is on its way to host memory (its copy enqueued on stream, None on the
        emu backend): queue its update if the contract allows."""
        n = self.counts[id(p)] = self.counts.get(id(p), 0) + 1
        if (n != 1 or self.pause or self.backwards or self.last_backwards != 1 or self.last_counts.get(id(p)) != 1
                or p.grad is not None):
            return
        try:
            a = self._ahead(p, g, stream)
        except Exception:  # noqa: BLE001 - nothing computed ahead; the step computes it
            return
        if a is None:
            return
        with self._cond:
            self.pending[id(p)] = a
            self._queue.append(a)
            self._busy += 1
            self._cond.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="spillway-update-ahead", daemon=True)
            self._thread.start()

    def _ahead(self, p: torch.Tensor, g: torch.Tensor, stream: Any) -> Optional[Ahead]:
        group = self._group_of.get(id(p))
        if group is None:
            return None
        kernel = _train._kernel(self.opt, group)
        if kernel not in (spw_optim.adamw_step, spw_optim.adam_step) or not _train._group_eligible(group):
            return None
        if not _train._tensor_eligible(p, g):
            return None
        st = self.opt.state.get(p)
        if not st or "exp_avg" not in st:
            return None
        keys = _STATE_KEYS if group["amsgrad"] else _STATE_KEYS[:2]
        ins = tuple(st[k] for k in keys)
        if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous() or t.shape != p.shape
               for t in ins):
            return None
        outs = self.shadows.get(id(p))
        if outs is None or len(outs) != 1 + len(ins):
            outs = self.shadows[id(p)] = tuple(torch.empty_like(p, memory_format=torch.contiguous_format)
                                               for _ in range(1 + len(ins)))
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        return Ahead(p, g, st, ins, int(st["step"].item()) + 1, _train.adam_hparams(group), kernel, outs, event)

    def _groups(self) -> Dict[int, Dict[str, Any]]:
        return {id(q): g for g in self.opt.param_groups for q in g["params"]}

    def landed(self) -> None:
        """A backward pass ended (its gradients are in the Parameters' .grad)."""
        self.backwards += 1

    # ---- the worker ----
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
            for a in batch:
                try:
                    if a.event is not None:
                        a.event.synchronize()
                    _compute(a, self.pool, params_out=[a.outs[0]])
                except BaseException:  # noqa: BLE001 - computed again in the step
                    a.failed = True
                with self._cond:
                    a.done = True
                    self._busy -= 1
                    self._cond.notify_all()

    def wait(self, a: Ahead) -> None:
        with self._cond:
            while not a.done:
                self._cond.wait()

    def busy(self) -> bool:
        return self._busy > 0

    def drain(self) -> None:
        """Return once nothing is queued or running."""
        with self._cond:
            while self._busy:
                self._cond.wait()

    def close(self) -> None:
        self.drain()
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.shadows.clear()
        self.pending.clear()

    # ---- opt.step() (the caller's thread) ----
    def keep(self, use: bool = True) -> Dict[int, Ahead]:
        """At opt.step(), after the backward's gradients landed: the updates computed ahead that
        are still valid, by id(parameter) (the step runs commit for them instead of the kernel),
        and the counts reset for the next step. Each kept one's state already holds its shadow
        moments. use=False (a step that does not run the C step): nothing is kept, and this
        returns once the worker is idle."""
        if not use:
            self.drain()
        pending, self.pending = self.pending, {}
        self._group_of = self._groups()
        kept: Dict[int, Ahead] = {}
        for key, a in pending.items():
            if use and self._valid(a):
                kept[key] = a
        for a in kept.values():
            for k, t in zip(_STATE_KEYS, a.outs[1:]):
                a.st[k] = t
            self.shadows[id(a.p)] = (a.outs[0],) + a.ins  # the next shadows: written only after this update ends
        self.kept += len(kept)
        self.dropped += len(pending) - len(kept)
        if pending and not kept:
            self.pause = self.pause_len
            self.pause_len = min(self.pause_len * 2, _MAX_PAUSE)
        elif kept:
            self.pause_len = 1
        elif self.pause:
            self.pause -= 1
        self.last_counts, self.counts = self.counts, {}
        self.last_backwards, self.backwards = self.backwards, 0
        return kept

    def _valid(self, a: Ahead) -> bool:
        p = a.p
        if p.grad is not a.g or a.g._version != a.gv or p._version != a.pv:
            return False
        st = self.opt.state.get(p)
        if st is not a.st or int(st["step"].item()) != a.step - 1:
            return False
        for k, t, v in zip(_STATE_KEYS, a.ins, a.vers):
            if st.get(k) is not t or t._version != v:
                return False
        group = self._group_of.get(id(p))
        return group is not None and _train.adam_hparams(group) == a.hp and bool(group["amsgrad"]) == (len(a.ins) == 3)

    def commit(self, aheads: List[Ahead], pool: Any = None) -> None:
        """Make each kept update the parameter's value (a copy into its unit's pack), once
        computed; one that failed is computed now, in place, from the inputs it kept aside."""
        for a in aheads:
            self.wait(a)
            with torch.no_grad():
                if a.failed:  # from the moments it read into those opt's state now holds, the parameter in place
                    _compute(a, pool)
                else:
                    a.p.detach().copy_(a.outs[0])


def _compute(a: Ahead, pool: Any, **param_out: Any) -> None:
    """a's update from the state tensors it read (a.ins) into its shadow moments (a.outs[1:]); the
    parameter goes to param_out's params_out when given, else in place."""
    kw = dict(max_exp_avg_sqs=[a.ins[2]], max_exp_avg_sqs_out=[a.outs[3]]) if len(a.ins) == 3 else {}
    a.kernel([a.p], [a.g], [a.ins[0]], [a.ins[1]], a.step, pool=pool, exp_avgs_out=[a.outs[1]],
             exp_avg_sqs_out=[a.outs[2]], **param_out, **kw, **a.hp)
