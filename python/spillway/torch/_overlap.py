"""offload(optimizer=opt, overlap_update=True): opt.step() starts spillway's C AdamW update on a
background thread and returns; the update runs unit by unit in the order of the forward, and the
next forward waits for each unit's update only when it reaches that unit, so the host update and
the forward's work overlap instead of following each other.

Contracts:
- Each unit whose parameters the step updates has its host copy open for writes
  (spw_buf_host_begin) from opt.step() until its update is done: its device copy is dropped at
  once, and nothing uploads the host copy meanwhile (the plan's prefetches of it move nothing);
  the end makes the updated host copy the contents.
- The work (which tensors, the step counts, the hyper-parameters) is taken in opt.step() on the
  caller's thread (_train.step_work); only the C kernels run on the background thread, with the
  interpreter lock released, on a pool that leaves two of the process's CPUs to the caller.
- The update is finished (waited for, and its error raised, as a StateError naming it) by the
  end of the next top-level forward, the next opt.step(), opt.zero_grad(set_to_none=False),
  opt.state_dict(), the module's state_dict() (those wrapped by _train.wrap_sync_points),
  Offload.synchronize() and remove(). Anything
  else that reads the host Parameters or the optimizer's state before those (a reference kept
  to a parameter, an average of the weights taken right after the step) must call
  Offload.synchronize() first: until then the values are being written.
- A failure in the update ends every open host copy (so nothing is left refused) and is raised
  at the next of those points; parameters not reached keep their old values.
"""
from __future__ import annotations

import os
import threading
from typing import Any, Dict, List, Optional, Set, Tuple

from .. import _lib
from .. import optim as spw_optim
from ..errors import error_for
from ._units import _Unit

_lib_c = _lib.lib


def pool_threads() -> int:
    """Threads for an update that runs beside the caller's forward: the process's CPUs but two
    (the caller's thread and the device driver's), at least one."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 2
    return max(1, n - 2)


def new_pool() -> Any:
    """The threads an offload's overlapped updates run on (pool_threads of them)."""
    return spw_optim.Pool(pool_threads())


class Update:
    """One optimizer step's host update, running on its own thread (see the module docstring)."""

    __slots__ = ("work", "pool", "stream", "thread", "error", "cond", "done", "finished", "open")

    def __init__(self, work: List[Tuple[Optional[_Unit], List[Dict[str, Any]]]], pool: Any,
                 stream: Optional[int]) -> None:
        self.work = work
        self.pool = pool
        self.stream = stream  # the caller's stream at the step: each updated unit's upload is ordered on it
        self.error: Optional[BaseException] = None
        self.cond = threading.Condition()
        self.done: Set[int] = set()  # indices of the units whose update ended
        self.finished = False
        self.open: List[_Unit] = []  # units whose host copy this update opened and has not ended
        self.thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Open the host copy of every unit the step updates (their device copies are dropped),
        then start the thread. On a failure to open, what was opened is ended and it raises."""
        try:
            for unit, _ in self.work:
                if unit is not None:
                    st = _lib_c.spw_buf_host_begin(unit.handle)
                    if st:
                        raise error_for(st)
                    self.open.append(unit)
        except BaseException:
            self._end_open()
            raise
        self.thread = threading.Thread(target=self._run, name="spillway-optimizer-update", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for unit, calls in self.work:
                for kernel, kw in calls:
                    kernel(pool=self.pool, **kw)
                if unit is not None:
                    self.open.remove(unit)
                    st = _lib_c.spw_buf_host_end(unit.handle)
                    if st:
                        raise error_for(st)
                    # start its upload now, into free room, as the step without the overlap does
                    # (_train._renew): the forward that waits for this unit then waits less (a
                    # hint: a declined or failed one changes nothing but the wait)
                    _lib_c.spw_prefetch_free(unit.handle, self.stream)
                    with self.cond:
                        self.done.add(unit.index)
                        self.cond.notify_all()
        except BaseException as e:  # raised to the caller at the next point that finishes the update
            self.error = e
        finally:
            self._end_open()
            with self.cond:
                self.finished = True
                self.cond.notify_all()

    def _end_open(self) -> None:
        while self.open:
            _lib_c.spw_buf_host_end(self.open.pop().handle)

    def wait_for(self, unit: _Unit) -> None:
        """Return once unit's update ended (or the whole update did, also by failing)."""
        with self.cond:
            while unit.index not in self.done and not self.finished:
                self.cond.wait()

    def finish(self) -> Optional[BaseException]:
        """Wait for the whole update; its error, if it failed."""
        if self.thread is not None:
            self.thread.join()
        return self.error
