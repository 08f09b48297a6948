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
no device limit can be read (the emulated backend), every block is recomputed.

Under use_allocator the offloaded weights share that limit. Where they stream (a learning step
after the first uploads more than a 64th of the limit), every block is recomputed from then
on: a kept activation takes room from the weights, each byte of which then crosses the link
every step, where recomputing costs the block's forward on the device; and the bytes in use,
which the weights and their cached room fill and trims empty, say nothing of what the rest of
the step will need (kept activations accumulated until the forward's end found no room)."""
from __future__ import annotations

import functools
from typing import Any, Callable, List, Optional

import torch
from torch import nn

from .. import _lib
from ..errors import ConfigError, check
from . import _alloc, _patch

# Steps over which recompute="auto" moves its limit; it holds still after them (the peak
# statistics it resets are the user's again).
LEARN_STEPS = 4
# Of the device limit, what recompute="auto" leaves free at the step's peak: the caching
# allocator's rounding and the variation from step to step.
MARGIN = 0.05
# Under use_allocator, a learning step that uploads more than this fraction of the limit (after
# the first step) finds the offloaded weights streaming: keeping activations turns off.
STREAM_FRACTION = 64


def _checkpoint_function() -> Callable[..., Any]:
    """torch.utils.checkpoint, non-reentrant, without its check that the recomputation saved
    tensors of the same shapes as the forward (torch 2.1+: determinism_check): the blocks are
    the model's own, and the check costs host time per saved tensor on every step."""
    import inspect

    from torch.utils.checkpoint import checkpoint

    if "determinism_check" in inspect.signature(checkpoint).parameters:
        return functools.partial(checkpoint, use_reentrant=False, determinism_check="none")
    return functools.partial(checkpoint, use_reentrant=False)


_checkpoint = _checkpoint_function()


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

    def __init__(self, mode: Any, limit: Optional[int], reset_peak: Callable[[], None], read_peak: Callable[[], int],
                 used: Callable[[], int], uploaded: Optional[Callable[[], int]] = None) -> None:
        self.mode = mode
        self.limit = limit  # "auto"'s device limit; None: recompute every block
        # the step's peak and the bytes in use now that the forward's limit is compared with
        # (read only where there is a limit)
        self._reset_peak, self._read_peak, self._allocated = reset_peak, read_peak, used
        # the bytes uploaded into the limit's context so far, where offloaded weights share the
        # limit (use_allocator): a learning step after the first that uploads more than
        # limit / STREAM_FRACTION turns keeping off
        self._uploaded = uploaded
        self._uploaded_at = uploaded() if uploaded is not None else 0
        self.streams = False  # the weights were seen streaming: every block is recomputed
        self.forward_limit: Optional[float] = None  # F: none learnt yet
        self.activation = 0  # the largest block's activations seen, bytes
        self.forward_end = 0  # allocated bytes after the last block of the last forward
        self.in_forward = 0  # depth of recomputed blocks' first runs (their forward, not the recomputation)
        self.steps = 0
        self.recomputed = 0  # blocks run recomputed, over the offload's life
        self.kept = 0  # blocks run keeping their activations
        self.last_kept = 0  # in the last step
        self._began = False
        if self.limit is not None:
            self._reset_peak()

    def learning(self) -> bool:
        """Whether this step still measures (the steps of "auto" up to LEARN_STEPS)."""
        return self.limit is not None and self.steps < LEARN_STEPS

    def wrap(self, block: nn.Module, inner: Any) -> Any:
        measure = self.limit is not None

        def measured(*args: Any, **kwargs: Any) -> Any:
            if self.in_forward or not self.learning():
                return inner(*args, **kwargs)
            before = self._allocated()
            try:  # the recomputation stops early (an exception) once it has what backward needs
                return inner(*args, **kwargs)
            finally:
                self.activation = max(self.activation, self._allocated() - before)

        def forward(mod: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if mod is not block:
                return _patch.copied_forward(mod, args, kwargs)
            if not torch.is_grad_enabled():
                return inner(*args, **kwargs)
            if measure:
                used = self._allocated()
                f = self.forward_limit
                if f is not None and self.activation and used + self.activation <= f:
                    self.kept += 1
                    self.last_kept += 1
                    out = inner(*args, **kwargs)
                    if self.learning():
                        after = self._allocated()
                        self.activation = max(self.activation, after - used)
                        self.forward_end = after
                    return out
            self.recomputed += 1
            self.in_forward += 1
            try:
                out = _checkpoint(measured, *args, **kwargs)
            finally:
                self.in_forward -= 1
            if self.learning():
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
        """After an optimizer step: while learning, set F from where the step's forward ended and
        what its peak left of the limit, and start the next step's peak."""
        self.steps += 1
        if self.limit is None or self.steps > LEARN_STEPS:
            self.last_kept = 0
            return
        if self._uploaded is not None:
            now = self._uploaded()
            # the first step's uploads are the weights' first; a few small tensors pushed out
            # and brought back (a rotary table) are no stream
            if self.steps > 1 and now - self._uploaded_at > self.limit // STREAM_FRACTION:
                self.streams = True
                self.limit, self.forward_limit, self.last_kept = None, None, 0
                return
            self._uploaded_at = now
        peak = self._read_peak()
        # the step's peak stood peak - forward_end above where its forward ended: the next
        # forward may end that much below the limit less the margin
        self.forward_limit = self.forward_end + self.limit * (1 - MARGIN) - peak
        self.last_kept = 0
        if self.steps < LEARN_STEPS:
            self._reset_peak()


def install(off: Any, mode: Any, shared_budget: Optional[int]) -> Optional[Recompute]:
    """Wrap the forward of each block of off.module (blocks()) for recomputation, outside the
    offload's own wrapper (the recomputation acquires a block's units again). The device limit
    of "auto" on CUDA: shared_budget under use_allocator (its context's held bytes, PyTorch's
    cached blocks among them, are what it keeps under: activations kept in new sizes take new
    segments beside the cached ones); otherwise the device's free memory now with what PyTorch
    and the offload's context hold (the bytes in use and the peak read are both of theirs).
    None when there is no block to recompute."""
    found = blocks(off.module)
    if not found:
        return None
    dev, ctx = off.device, off.context
    index = dev.index if dev.index is not None else 0

    limit: Optional[int] = None
    reset: Callable[[], None] = lambda: None  # noqa: E731
    read: Callable[[], int] = lambda: 0  # noqa: E731
    used: Callable[[], int] = lambda: 0  # noqa: E731
    if mode == "auto" and dev.type == "cuda":
        if shared_budget is not None:
            limit = shared_budget
            reset = lambda: _alloc.reset_peak_memory_stats(dev)  # noqa: E731
            read = lambda: _alloc.max_memory_reserved(dev)  # noqa: E731
            used = lambda: _alloc.memory_reserved(dev)  # noqa: E731
        else:
            free = torch.cuda.mem_get_info(index)[0]
            limit = free + torch.cuda.memory_reserved(index) + ctx.memory_reserved()

            def reset() -> None:
                torch.cuda.reset_peak_memory_stats(index)
                check(_lib.lib.spw_stats_reset_peaks(ctx._live()))

            read = lambda: torch.cuda.max_memory_reserved(index) + ctx.max_memory_reserved()  # noqa: E731
            # what PyTorch and the context hold now: the limit less the device's free memory (one
            # driver call; torch.cuda.memory_reserved builds its whole table of statistics)
            used = lambda: limit - torch.cuda.mem_get_info(index)[0]  # noqa: E731
    uploaded: Optional[Callable[[], int]] = None
    if limit is not None and shared_budget is not None:
        uploaded = lambda: int(ctx._counter("bytes_h2d").total)  # noqa: E731
    rec = Recompute(mode, limit, reset, read, used, uploaded)
    for b in found:
        _patch.wrap_forward(off, b, rec.wrap(b, b.forward))
    return rec
