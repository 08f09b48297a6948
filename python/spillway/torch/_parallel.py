"""Data-parallel training through an offload (offload(..., optimizer=opt) under torchrun): the
gradients of the trained parameters averaged over the ranks of a process group, as
DistributedDataParallel averages them, and the module's parameters and buffers broadcast from
rank 0 when the offload starts, as DistributedDataParallel's constructor does.

DistributedDataParallel itself cannot wrap an offloaded model: its reducer hooks the
parameters' gradient accumulators, which an offloaded parameter's gradient never passes (it
lands in host memory, _train.GradLanding), and with NCCL its constructor refuses the host
Parameters. So the offload averages them itself, on the device and before they cross the link:
each gradient of an offloaded parameter as backward produces it (GradLanding.take), the
gradients of the parameters trained on the device at the end of the backward, in one
collective. The arithmetic is DistributedDataParallel's: each rank's gradient multiplied by
1 / world size, then summed."""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..errors import ConfigError

try:
    import torch.distributed as dist
except ImportError:  # a torch built without distributed support
    dist = None  # type: ignore[assignment]


def _ddp_class() -> Any:
    if dist is None or not dist.is_available():
        return None
    return torch.nn.parallel.DistributedDataParallel


def resolve(process_group: Any, training: bool) -> Optional["GradAverage"]:
    """The averaging offload(process_group=...) asks for: "auto" (the default): over the default
    group when torch.distributed is initialized with more than one rank and the offload trains
    (optimizer=); None: none; a ProcessGroup: over it (one rank: none). ConfigError otherwise."""
    if process_group is None:
        return None
    if isinstance(process_group, str):
        if process_group != "auto":
            raise ConfigError(f"offload: process_group must be 'auto', None or a torch.distributed process group, "
                              f"got {process_group!r}")
        if not training or dist is None or not dist.is_available() or not dist.is_initialized():
            return None
        group = dist.group.WORLD
    else:
        if dist is None or not dist.is_available() or not isinstance(process_group, dist.ProcessGroup):
            raise ConfigError(f"offload: process_group must be 'auto', None or a torch.distributed process group, "
                              f"got {type(process_group).__name__}")
        if not training:
            raise ConfigError("offload: process_group= averages the gradients of training (optimizer=); "
                              "no optimizer= was given")
        group = process_group
    if dist.get_world_size(group) < 2:
        return None
    return GradAverage(group)


class GradAverage:
    """Averages the trained parameters' gradients over a process group's ranks. average() for
    each gradient of an offloaded parameter (it returns an averaged copy, on the device);
    watch() the parameters trained on the device, whose accumulated gradients are averaged at
    the end of each backward that gave them one. Every rank must run the same backward, as
    under DistributedDataParallel: the collectives are matched in the order they are made."""

    __slots__ = ("group", "world", "scale", "backend", "accumulators", "hooks", "fired", "queued", "reductions",
                 "paused")

    def __init__(self, group: Any) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.scale = 1.0 / self.world
        self.backend = str(dist.get_backend(group))
        self.accumulators: List[Any] = []  # the device-trained parameters' AccumulateGrad nodes
        self.hooks: List[Any] = []
        self.fired: List[torch.Tensor] = []  # device-trained parameters given a gradient in this backward
        self.queued = False
        self.reductions = 0  # collectives made
        # inside Offload.no_sync(): the device-trained gradients accumulate (fired keeps them)
        # and the next backward outside it averages them
        self.paused = 0

    def average(self, grad: torch.Tensor) -> torch.Tensor:
        """grad averaged over the ranks, a new tensor (grad is autograd's: left as it is). With
        NCCL the caller's stream waits for the collective and the host does not."""
        g = torch.mul(grad, self.scale).contiguous()
        dist.all_reduce(g, group=self.group, async_op=True).wait()
        self.reductions += 1
        return g

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        """Average the gradients of params (trained on the device) at the end of every backward
        that accumulates into them."""
        for p in params:
            if not p.requires_grad:
                continue
            with torch.enable_grad():  # offload() may be called under no_grad
                acc = p.expand_as(p).grad_fn.next_functions[0][0]  # p's AccumulateGrad, kept alive here
            self.accumulators.append(acc)
            self.hooks.append(acc.register_hook(self._hook_for(p)))

    def _hook_for(self, p: torch.Tensor) -> Any:
        def fired(*_: Any) -> None:
            self.fired.append(p)
            if not self.queued and not self.paused:
                self.queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        return fired

    def finish(self) -> None:
        """The device-trained gradients of this backward averaged: one collective per dtype over
        their concatenation, each parameter once, in the order backward reached them."""
        self.queued = False
        if self.paused:  # a backward begun outside no_sync() that ended inside it
            return
        seen: set = set()
        by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
        for p in self.fired:
            if p.grad is not None and id(p) not in seen:
                seen.add(id(p))
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        self.fired = []
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads]).mul_(self.scale)
            dist.all_reduce(flat, group=self.group, async_op=True).wait()
            self.reductions += 1
            with torch.no_grad():
                at = 0
                for g in grads:
                    n = g.numel()
                    g.copy_(flat[at:at + n].view_as(g))
                    at += n

    def broadcast(self, tensors: Iterable[torch.Tensor], device: torch.device) -> None:
        """Each tensor set to the group's first rank's values, in place. NCCL moves device
        memory only: a host tensor goes through a copy on device."""
        root = 0 if self.group is dist.group.WORLD else dist.get_global_rank(self.group, 0)
        staged = self.backend == "nccl"
        with torch.no_grad():
            for t in tensors:
                if staged and t.device.type != "cuda":
                    d = t.to(device)
                    dist.broadcast(d, root, group=self.group)
                    t.copy_(d)
                else:
                    dist.broadcast(t, root, group=self.group)

    def close(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks, self.accumulators, self.fired = [], [], []


def module_state(module: torch.nn.Module, trained: Iterable[torch.Tensor]) -> List[torch.Tensor]:
    """What DistributedDataParallel's constructor broadcasts from the first rank: every
    parameter and buffer of module, each once, the trained ones first (the offloaded ones as
    their host Parameters, whose values the packs hold), then the rest in the module's order.
    Every rank builds the same list from the same model."""
    out: List[torch.Tensor] = []
    seen: set = set()
    for t in (*trained, *module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def check_not_wrapped(module: torch.nn.Module) -> None:
    """ConfigError when module, trained through an offload, runs inside a
    DistributedDataParallel's forward, which would average nothing (see this module's
    docstring)."""
    ddp = _ddp_class()
    active = getattr(ddp, "_active_ddp_module", None) if ddp is not None else None
    if active is not None and any(m is module for m in active.module.modules()):
        raise ConfigError("offload: the model trained through offload(optimizer=) runs inside "
                          "DistributedDataParallel, whose reducer never sees an offloaded parameter's gradient; "
                          "the offload averages the gradients over the ranks itself (process_group='auto'): "
                          "call the offloaded model directly, not through DistributedDataParallel")


_IGNORE = "_ddp_params_and_buffers_to_ignore"  # read by DistributedDataParallel's constructor


def hide_offloaded(module: torch.nn.Module, tensors: Iterable[torch.Tensor]) -> Tuple[bool, Any]:
    """Add the names of tensors (the offloaded weights and buffers that the offload does not
    train) to the names DistributedDataParallel leaves out, so that it can wrap a model whose
    trained parameters are on the device (adapters on an offloaded base): it neither
    broadcasts nor checks the devices of the host copies. (Hiding the parameters trained
    through the offload as well can leave DDP none, which torch 1.13's DDP does not survive.)
    Returns what to put back (show_offloaded)."""
    ids = {id(t) for t in tensors}
    names = [f"{mn}.{n}" if mn else n
             for mn, m in module.named_modules(remove_duplicate=False)
             for n, t in list(m._parameters.items()) + list(m._buffers.items())
             if t is not None and id(t) in ids]
    had = _IGNORE in module.__dict__
    before = module.__dict__.get(_IGNORE)
    old = list(before or ())
    known = set(old)
    setattr(module, _IGNORE, old + [n for n in names if n not in known])
    return had, before


def show_offloaded(module: torch.nn.Module, saved: Tuple[bool, Any]) -> None:
    had, before = saved
    if had:
        setattr(module, _IGNORE, before)
    else:
        module.__dict__.pop(_IGNORE, None)
