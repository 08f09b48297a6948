"""What an offload reports: the Python side's counters, the library's statistics with them, and
the readable summary. Reads an Offload's attributes; changes nothing."""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from ..core import format_size
from . import _train


def _median_us(hist: List[int]) -> float:
    """The median of a histogram of 1024-ns buckets, in us (a bucket's middle)."""
    n = sum(hist)
    if not n:
        return 0.0
    seen = 0
    for i, c in enumerate(hist):
        seen += c
        if 2 * seen >= n:
            return (i + 0.5) * 1.024
    return (len(hist) - 0.5) * 1.024


def host_copies_line(s: Dict[str, Any], steps: int) -> str:
    """The summary's line on host copies that are not page-locked ("" when there are none):
    how many bytes, how many a step were uploaded from them, how often the page-locked memory
    was moved to the weights that move (pin_rebalance)."""
    if not s["host_pageable"]["current"] and not s["h2d_pageable"]["total"]:
        return ""
    return (f"  host copies       {format_size(s['host_pageable']['current'])} not page-locked (refused by the "
            f"system or pin_limit); {format_size(s['h2d_pageable']['total'] // max(steps, 1))} a step uploaded "
            f"from them (slower, and waits on the host); page-locking moved to the weights that move "
            f"({_plural(s['repins']['total'], 'change')})")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def hook_stats(off: Any) -> Dict[str, Any]:
    """Counters of the Python side: hook_ns (host time in the hooks), hook_us_median (the
    median host time of one acquire, from 1-us buckets: what a hook costs, where the mean
    also counts the acquires that waited for room), acquires (spw_acquire calls by hooks and
    backward), view_hits/view_builds (the unit's device tensors found over its address / made
    or re-pointed there: an address it had not been at, or not among its latest sets),
    view_repairs (releases that pointed them back after a forward replaced what they held, as
    a module's own .to(dtype=) does in layerwise casting), steps,
    saved_packed/saved_reacquires (tensors saved for backward and their re-acquires),
    activations_stashed/activation_bytes (activations kept in buffers of the context),
    activations_refused (activations the budget had no room for, left in PyTorch's memory),
    buffer_writebacks (buffers modified in place), outputs_cloned (module outputs that
    aliased a unit being released, copied so they outlive it), optimizer_steps and
    step_evictions (with optimizer=: the optimizer's steps, and the device copies of units they
    made stale, dropped), host_heap_kept (with optimizer= where opt's own step runs on the host:
    the allocation size the process's heap keeps for its temporaries, 0 where the environment's
    malloc settings stand, None before such a step or where the C library has no such control),
    edit_evictions (device copies dropped before a forward because their
    host copies were edited since the last: load_state_dict, in-place ops, a .data replaced),
    updates_ahead_kept/updates_ahead_dropped (overlap_update="backward": the
    parameters' updates computed during the backward that the step kept / computed again)."""
    return {
        "hook_ns": off.hook_ns,
        "hook_us_median": _median_us(off._hook_hist),
        "acquires": off.acquires,
        "view_hits": off.acquires - off.view_builds,  # each acquire looks its views up once
        "view_builds": off.view_builds,
        "view_repairs": off.view_repairs,
        "steps": off.steps,
        "saved_packed": off.saved_packed,
        "saved_reacquires": off.saved_reacquires,
        "buffer_writebacks": off.buffer_writebacks,
        "outputs_cloned": off.outputs_cloned,
        "activations_stashed": off.activations_stashed,
        "activation_bytes": off.activation_bytes,
        "activations_refused": off.activations_refused,  # stashes the budget had no room for
        "optimizer_steps": off.optimizer_steps,
        "step_evictions": off.step_evictions,
        # opt's own host step: freed allocations up to this size kept in the heap (None: not set)
        "host_heap_kept": off.heap_kept,
        "edit_evictions": off.edit_evictions,  # device copies dropped: their host copies were edited
        "updates_ahead_kept": off._ahead.kept if off._ahead is not None else 0,
        "updates_ahead_dropped": off._ahead.dropped if off._ahead is not None else 0,
        # data parallel (_parallel): ranks the gradients are averaged over (1: none), collectives made
        "data_parallel_ranks": off._average.world if off._average is not None else 1,
        "gradient_reductions": off._average.reductions if off._average is not None else 0,
        # recompute=: blocks run recomputed in the backward / keeping their activations
        "blocks_recomputed": off._recompute.recomputed if off._recompute is not None else 0,
        "blocks_kept": off._recompute.kept if off._recompute is not None else 0,
    }


def _heap_line(off: Any) -> str:
    """The summary's words on the heap under opt's own host step (_train.keep_heap)."""
    what = f"{type(off.optimizer).__name__}'s own step on the host"
    if off.heap_kept:
        return (f"{what}; freed allocations up to {format_size(off.heap_kept)} stay in the process's heap "
                "(glibc's mmap and trim thresholds), so its temporaries are not faulted in every step")
    if off.heap_kept == 0:
        return f"{what}; the environment sets glibc's malloc thresholds, left as they are"
    return f"{what}; its temporaries may be faulted in every step ({off.heap_note or 'no parameter on the host'})"


def stats(off: Any) -> Dict[str, Any]:
    """The library's counters (Context.stats()) plus "offload": hook_stats(), unit counts."""
    out = off.context.stats()
    h = hook_stats(off)
    h["units"] = len(off.units)
    h["offloaded_bytes"] = sum(u.nbytes for u in off.units)
    h["resident_trainable_bytes"] = sum(p.numel() * p.element_size() for _, p in off._trainable)
    h["device_trained_bytes"] = off.device_trained_bytes  # train_on_device: with gradients and state
    out["offload"] = h
    return out


def _partition_text(off: Any, shown: int = 8) -> str:
    units = sorted(off.units, key=lambda u: u.index)
    head = ", ".join(f"'{u.name}' {format_size(u.nbytes)}" for u in units[:shown])
    more = f", ... {len(units) - shown} more" if len(units) > shown else ""
    how = "the given blocks" if off._given_blocks else "the module tree and the budget"
    return f"from {how}: {head}{more}"


def _arena_text(off: Any) -> str:
    """How the context keeps its device memory, and why."""
    vmm = str(off.context.options.get("vmm", "auto")).lower()
    mode = {"off": "plain segments", "on": "pages of one mapped range"}.get(
        vmm, "pages of one mapped range where the driver maps them (vmm auto)")
    if off.stack_segments:
        return f"{mode} (chosen: the units are a stack's and stream)"
    if off.in_pipeline:
        return f"{mode}: the context the pipeline's modules share"
    if not off._owns_context:
        return f"{mode}: use_allocator's context"
    return mode


def _budget_text(off: Any) -> str:
    if off.in_pipeline:
        return "the budget of the context the pipeline's modules share"
    if off.budget_source == "shared":
        return "use_allocator's budget, shared with PyTorch's tensors"
    what = ("device memory for offloaded weights and the activations saved for backward"
            if off._stash_min is not None else "device memory for offloaded weights only")
    if off.budget_source == "default":
        return (f"{what}: no budget given, so the device's free memory less {format_size(off.reserve)} "
                "kept for activations")
    return what


def _subclass_line(off: Any) -> str:
    """The offloaded weights of tensor subclasses (quantized checkpoints), by class: how many,
    their bytes, and for wrapper subclasses that they move as their leaves."""
    by: Dict[str, List[int]] = {}
    wrappers = set()
    for u in off.units:
        for e in u.entries:
            cls = type(e.tensor)
            if e.is_buffer or cls is torch.Tensor or cls is torch.nn.Parameter:
                continue
            n = by.setdefault(cls.__name__, [0, 0])
            n[0] += 1
            n[1] += e.nbytes
            if e.parts:
                wrappers.add(cls.__name__)
    if not by:
        return ""
    parts = [f"{n} {name} ({format_size(nb)}{', moved as their data and scales' if name in wrappers else ''})"
             for name, (n, nb) in sorted(by.items())]
    return "  subclasses        " + "; ".join(parts)


def summary(off: Any) -> str:
    """Readable report: units, what stayed resident, bytes moved per step, stalls, plan hits,
    hook time per acquire, then the library's table."""
    s = off.context.stats()
    steps = max(off.steps, 1)
    total = sum(u.nbytes for u in off.units)
    lines = [
        f"spillway.torch offload of {type(off.module).__name__} ({off.backend}, device {off.device}, "
        f"policy {off.context.options.get('policy')})",
        (f"  offloaded         {format_size(total)} in {_plural(len(off.units), 'unit')} "
         f"(largest '{max(off.units, key=lambda u: u.nbytes).name}', "
         f"{format_size(max(u.nbytes for u in off.units))})" if off.units else
         "  offloaded         nothing: every parameter is trained on the device"),
        f"  partition         {_partition_text(off)}",
        f"  device memory     {_arena_text(off)}",
        f"  budget            {format_size(s['budget'])}  ({_budget_text(off)})",
        f"  resident units    {s['buffers_resident']['current']} now, "
        f"{format_size(s['live']['current'])} on the device",
    ]
    line = host_copies_line(s, off.steps)
    if line:
        lines.append(line)
    line = _subclass_line(off)
    if line:
        lines.append(line)
    if off._fused:
        fs = list(off._fused.values())
        n = sum(len(f.all_units()) for f in fs)
        lines.append(f"  fused experts     {_plural(len(fs), 'module')} of {fs[0].experts} experts "
                     f"({fs[0].label}, ...) moved expert by expert: {_plural(n, 'unit')}, one an expert and "
                     "parameter; they run the eager experts function")
    if off.optimizer is not None:
        trained = _train.offloaded_trained(off)
        nb = sum(e.nbytes for e in trained)
        lines.append(f"  trained on host   {_plural(len(trained), 'trainable parameter')}, {format_size(nb)}, by "
                     f"{type(off.optimizer).__name__} (gradients and its state in host memory), "
                     f"{_plural(off.optimizer_steps, 'step')}, {off.step_evictions} stale device copies dropped")
        if off._heap_checked:
            lines.append("  host step         " + _heap_line(off))
        if off._average is not None:
            g = off._average
            lines.append(f"  data parallel     gradients averaged over {g.world} ranks ({g.backend}, as "
                         f"DistributedDataParallel), {_plural(g.reductions, 'collective')}; "
                         "parameters and buffers broadcast from the first rank at offload()")
        if off._ahead is not None:
            a = off._ahead
            lines.append(f"  updates ahead     {a.kept} parameter updates computed during the backward and kept, "
                         f"{a.dropped} computed again in the step")
    if off._recompute is not None:
        r = off._recompute
        how = ("every block (the offloaded weights stream through the shared budget)" if r.streams else
               "every block" if r.limit is None else
               f"as few blocks as keep the step under {format_size(r.limit)}, learnt over the first steps")
        lines.append(f"  recompute         {r.mode!r}: {how}; {r.recomputed} block forwards recomputed in the "
                     f"backward, {r.kept} kept their activations")
    if off._stash_min is not None:
        lines.append(f"  activations       {off.activations_stashed} saved for backward kept in the budget, "
                     f"{format_size(off.activation_bytes)} in all (tensors of {format_size(off._stash_min)} or more)"
                     + (f"; {off.activations_refused} without room there, left in PyTorch's memory"
                        if off.activations_refused else ""))
    if off._trainable:
        nb = sum(p.numel() * p.element_size() for _, p in off._trainable)
        shown = ", ".join(n for n, _ in off._trainable[:6]) + (" ..." if len(off._trainable) > 6 else "")
        if off.optimizer is not None:
            lines.append(f"  trained on device {_plural(len(off._trainable), 'trainable parameter')}, "
                         f"{format_size(nb)} "
                         f"({format_size(off.device_trained_bytes)} of the budget with their gradients and state), "
                         f"by {type(off.optimizer).__name__}'s own step: {shown}")
        else:
            lines.append(f"  kept resident     {len(off._trainable)} trainable parameters, {format_size(nb)}: {shown}")
    lines += [
        f"  steps             {off.steps}",
        f"  moved per step    {format_size(s['bytes_h2d']['total'] // steps)} host to device "
        f"({s['bytes_h2d']['total'] / steps / total if total else 0:.2f} of the offloaded bytes; "
        f"{format_size(s['bytes_h2d']['total'])} in all), {format_size(s['bytes_d2h']['total'])} device to host",
        f"  stalls            {s['stalls']['total']}"
        + (f" ({s['stall_ns']['total'] / 1e6:.2f} ms waited)" if s['stall_ns']['total'] else
           " (their time is measured with trace=FILE)"),
        f"  plan hits         {s['plan_hits']['total']}, divergences {s['plan_divergences']['total']}, "
        f"prefetched {format_size(s['plan_prefetch_bytes']['total'])} "
        f"(wasted {format_size(s['plan_prefetch_wasted']['total'])})",
        f"  hooks             {off.acquires} acquires, host time per acquire {_median_us(off._hook_hist):.1f} us "
        f"median, {off.hook_ns / max(off.acquires, 1) / 1000:.1f} us mean; "
        f"device tensors reused {off.acquires - off.view_builds} / re-pointed "
        f"{off.view_builds}",
        "",
        off.context.summary(),
    ]
    return "\n".join(lines)
