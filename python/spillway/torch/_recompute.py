"""Recomputation in the backward (offload(recompute=...)): a block's forward under grad runs
inside torch.utils.checkpoint (non-reentrant), so that its activations are dropped after the
forward and computed again when the backward reaches the block. Recomputing a transformer
layer costs a fraction of its forward and frees everything it would save for backward; moving
the same bytes through the link costs them twice (out in the forward, in again in the backward),
so under a budget recomputing comes before streaming activations or training state.

recompute="auto" recomputes only as many blocks as the device limit needs. The first step
recomputes every block and measures (the largest block's activations, from its recomputation;
where its forward ended; the step's peak of held device memory). After each learning step the
forward's limit F is where that step's forward ended plus what its peak left of the device limit
(less a margin): the peak stands above the forward's end by what the backward and the optimizer
add, which keeping activations does not raise. A block keeps its activations when the bytes
allocated before it plus its activations stay under F. After LEARN_STEPS steps F holds. Where
no device limit can be read (the emulated backend), every block is recomputed."""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch
from torch import nn

from ..errors import ConfigError

# Steps over which recompute="auto" moves its limit; it holds still after them (the peak
# statistics it resets are the user's again).
LEARN_STEPS = 4
# Of the device limit, what recompute="auto" leaves free at the step's peak: the caching
# allocator's rounding and the variation from step to step.
MARGIN = 0.05


def blocks(module: nn.Module) -> List[nn.Module]:
    """The blocks whose activations can be recomputed: every child of a ModuleList in module
    that holds parameters, the outermost ones (a list inside a block is the block's own)."""
    out: List[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if isinstance(child, nn.ModuleList):
                for b in child:
                    if next(b.parameters(), None) is not None:
                        out.append(b)
                    else:
                        visit(b)
            else:
                visit(child)

    visit(module)
    return out


def resolve(mode: Any, module: nn.Module) -> Any:
    """recompute= as given, checked: False, True or "auto". A model that recomputes its own
    layers (transformers' gradient_checkpointing_enable) is left to it: "auto" turns off, True
    is a ConfigError."""
    if mode not in (False, True, "auto") or (mode != "auto" and not isinstance(mode, bool)):
        raise ConfigError(f"offload: recompute must be True, False or 'auto', got {mode!r}")
    if mode and getattr(module, "is_gradient_checkpointing", False):
        if mode is True:
            raise ConfigError("offload: recompute=True, but the model recomputes its layers itself "
                              "(gradient_checkpointing_enable): pass recompute=False, or disable the model's")
        return False
    return mode


class Recompute:
    """The recomputation of an offload's blocks. wrap(block, inner) gives the forward to
    install; step_done() after each optimizer step (the learning of "auto")."""

    def __init__(self, mode: Any, device: torch.device, limit: Optional[int], reset_peak: Callable[[], None],
                 read_peak: Callable[[], int], used: Optional[Callable[[], int]] = None) -> None:
        self.mode = mode
        self.device = device
        self.limit = limit if mode == "auto" and device.type == "cuda" else None  # None: recompute every block
        self._reset_peak, self._read_peak = reset_peak, read_peak
        if used is not None:
            self._allocated = used  # type: ignore[method-assign]
        self.forward_limit: Optional[float] = None  # F: none learnt yet
        self.activation = 0  # the largest block's activations seen, bytes
        self.forward_end = 0  # allocated bytes after the last block of the last forward
        self.in_forward = 0  # depth of recomputed blocks' first runs (their forward, not the recomputation)
        self.steps = 0
        self.recomputed = 0  # blocks run recomputed, over the offload's life
        self.kept = 0  # blocks run keeping their activations
        self.last_kept = 0  # in the last step
        self.last_peak = 0
        self._began = False
        if self.limit is not None:
            self._reset_peak()

    def _allocated(self) -> int:
        """The device bytes in use that the forward's limit is compared with."""
        return torch.cuda.memory_allocated(self.device)

    def wrap(self, block: nn.Module, inner: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        measure = self.limit is not None

        def measured(*args: Any, **kwargs: Any) -> Any:
            if self.in_forward or not measure:
                return inner(*args, **kwargs)
            before = self._allocated()
            try:  # the recomputation stops early (an exception) once it has what backward needs
                return inner(*args, **kwargs)
            finally:
                self.activation = max(self.activation, self._allocated() - before)

        def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if mod is not block or not torch.is_grad_enabled():
                return inner(*args, **kwargs) if mod is block else type(mod).forward(mod, *args, **kwargs)
            if measure:
                used = self._allocated()
                f = self.forward_limit
                if f is not None and self.activation and used + self.activation <= f:
                    self.kept += 1
                    self.last_kept += 1
                    out = inner(*args, **kwargs)
                    after = self._allocated()
                    self.activation = max(self.activation, after - used)
                    self.forward_end = after
                    return out
            self.recomputed += 1
            self.in_forward += 1
            try:
                out = checkpoint(measured, *args, use_reentrant=False, **kwargs)
            finally:
                self.in_forward -= 1
            if measure:
                self.forward_end = self._allocated()
            return out

        return forward

    def forward_began(self) -> None:
        """At a top-level forward under grad of an offload without optimizer=: the step before
        it (forward, backward, the user's step) is done."""
        if self._began:
            self.step_done()
        self._began = True

    def step_done(self) -> None:
        """After an optimizer step: while learning, move F by what the step's peak left of the
        limit, and start the next step's peak."""
        self.steps += 1
        if self.limit is None or self.steps > LEARN_STEPS:
            self.last_kept = 0
            return
        peak = self._read_peak()
        self.last_peak = peak
        # the step's peak stood peak - forward_end above where its forward ended: the next
        # forward may end that much below the limit less the margin
        self.forward_limit = self.forward_end + self.limit * (1 - MARGIN) - peak
        self.last_kept = 0
        if self.steps < LEARN_STEPS:
            self._reset_peak()

    def stats(self) -> dict:
        return {"mode": self.mode, "recomputed": self.recomputed, "kept": self.kept,
                "forward_limit": int(self.forward_limit) if self.forward_limit is not None else None,
                "limit": self.limit, "activation_bytes": self.activation}


def install(off: Any, mode: Any, shared_budget: Optional[int]) -> Optional[Recompute]:
    """Wrap the forward of each block of off.module (blocks()) for recomputation, outside the
    offload's own wrapper (the recomputation acquires a block's units again). The device limit
    of "auto": shared_budget under use_allocator (its context's held bytes, PyTorch's among
    them, are what it keeps under); otherwise the device's free memory now with what PyTorch
    and the offload's context hold (the peak read is both of theirs). None when there is no
    block to recompute."""
    from .. import _lib
    from ..errors import check
    from . import _alloc, _patch

    found = blocks(off.module)
    if not found:
        return None
    dev, ctx = off.device, off.context
    index = dev.index if dev.index is not None else 0

    def held_peak() -> int:
        return int(ctx.stats()["held"]["peak"])

    def reset_held() -> None:
        check(_lib.lib.spw_stats_reset_peaks(ctx._live()))

    used: Optional[Callable[[], int]] = None
    if dev.type != "cuda":
        limit, reset, read = None, (lambda: None), (lambda: 0)
    elif shared_budget is not None:
        # use_allocator: what counts is what the context holds, PyTorch's cached blocks among it
        # (keeping activations of new sizes takes new segments beside the cached ones)
        limit, reset, read = shared_budget, (lambda: _alloc.reset_peak_memory_stats(dev)), held_peak
        used = lambda: int(ctx.stats()["held"]["current"])  # noqa: E731
    else:
        free, _ = torch.cuda.mem_get_info(index)
        limit = free + torch.cuda.memory_reserved(index) + int(ctx.stats()["held"]["current"])

        def reset() -> None:
            torch.cuda.reset_peak_memory_stats(index)
            reset_held()

        def read() -> int:
            return torch.cuda.max_memory_reserved(index) + held_peak()

        def used() -> int:
            return torch.cuda.memory_reserved(index) + int(ctx.stats()["held"]["current"])
    rec = Recompute(mode, dev, limit, reset, read, used)
    for b in found:
        _patch.wrap_forward(off, b, rec.wrap(b, b.forward))
    return rec
