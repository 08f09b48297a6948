"""What offload() decides before anything moves: the module and its arguments checked, which
tensors are offloaded and which stay resident, the units, the options of an offload's own
context, and the room a forward needs. Nothing here moves a tensor or calls the library."""
from __future__ import annotations

import weakref
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import nn

from ..core import format_size, parse_size
from ..errors import ConfigError, InvalidArgument, StateError
from . import _experts, _partition, _train
from ._device import _ARENA_PAGE, _SMALL_LIMIT, _arena_page, _large_page, conf_option
from ._units import _Unit, _align, _held_together, _module_names, _nbytes, _plan_units

# Module -> its Offload, both weakly: a module is offloaded at most once, and this table keeps
# neither alive (the module's hooks keep its Offload alive; dropping the module frees both).
ACTIVE: "weakref.WeakKeyDictionary[nn.Module, weakref.ref]" = weakref.WeakKeyDictionary()


def active(module: nn.Module) -> bool:
    """Whether module is offloaded now."""
    ref = ACTIVE.get(module)
    off = ref() if ref is not None else None
    return off is not None and not off._closed


def check_new(module: Any) -> None:
    """A module that neither it nor any submodule is offloaded already."""
    if not isinstance(module, nn.Module):
        raise InvalidArgument(f"offload: expected a torch.nn.Module, got {type(module).__name__}")
    if active(module):
        raise StateError("offload: this module is already offloaded; call .remove() on its Offload first")
    for m in module.modules():
        if m is not module and active(m):
            raise StateError(f"offload: submodule {type(m).__name__} is already offloaded")


def check_module(module: nn.Module, blocks: Optional[Sequence[nn.Module]]) -> Tuple[List[torch.Tensor], Dict[int, str]]:
    """(its parameters, id(submodule) -> name) of a module with loaded weights, after checking
    that blocks, if given, are distinct submodules of it."""
    params = list(module.parameters())
    if not params:
        raise InvalidArgument(f"offload: {type(module).__name__} has no parameters")
    for t in params + list(module.buffers()):
        if t.device.type == "meta":
            if any(hasattr(m, "_hf_hook") for m in module.modules()):
                raise InvalidArgument(
                    "offload: the module's weights are on the 'meta' device, loaded on demand by accelerate's hooks "
                    "(from_pretrained(..., device_map=...) or an accelerate offload); load it without device_map, "
                    "its weights in host memory, and offload that: spillway places them on the device")
            raise InvalidArgument("offload: the module has tensors on the 'meta' device; load its weights first")
    other = _other_offloader(module)
    if other:
        raise InvalidArgument(f"offload: {other}; both would move the same weights. Remove it first, or load the "
                              "model without it: spillway places the weights itself")
    names = _module_names(module)
    if blocks is not None:
        for b in blocks:
            if not isinstance(b, nn.Module):
                raise InvalidArgument(f"offload: blocks must be modules, got {type(b).__name__}")
            if id(b) not in names:
                raise InvalidArgument(f"offload: block {type(b).__name__} is not a submodule of the module")
        if len({id(b) for b in blocks}) != len(blocks):
            raise InvalidArgument("offload: blocks names a module twice")
    return params, names


# What already moves a module's weights (_other_offloader): accelerate's AlignDevicesHook with
# offload set (cpu_offload, a device_map that offloads; also inside a SequentialHook) and its
# CpuOffload (enable_model_cpu_offload), where an AlignDevicesHook without offload only moves
# the inputs; diffusers' group offloading hooks, where its casting and caching hooks move nothing.
_DIFFUSERS_PLACING = frozenset(("group_offloading", "lazy_prefetch_group_offloading"))


def _other_offloader(module: nn.Module) -> str:
    """What already moves module's weights between host and device, said for an error, or ""."""
    for name, m in module.named_modules():
        hook = getattr(m, "_hf_hook", None)
        if hook is not None:
            placing = [type(h).__name__ for h in getattr(hook, "hooks", None) or (hook,)
                       if type(h).__name__ == "CpuOffload" or (type(h).__name__ == "AlignDevicesHook"
                                                               and getattr(h, "offload", False))]
            if placing:
                return (f"{name or type(m).__name__} has accelerate's {placing[0]} hook (cpu_offload, a device_map, "
                        "enable_model_cpu_offload or enable_sequential_cpu_offload: pipe.remove_all_hooks() or "
                        "accelerate.hooks.remove_hook_from_module(module, recurse=True) removes it)")
        registry = getattr(m, "_diffusers_hook", None)
        found = sorted(_DIFFUSERS_PLACING & set(getattr(registry, "hooks", None) or ()))
        if found:
            return (f"{name or type(m).__name__} has diffusers' {found[0]} hook (enable_group_offload, which "
                    "diffusers cannot undo: load the model again without it)")
    return ""


def trainable(module: nn.Module, params: List[torch.Tensor], optimizer: Any,
              offload_trainable: Optional[bool]) -> Tuple[Dict[int, Tuple[str, torch.Tensor]],
                                                           Dict[int, Tuple[str, torch.Tensor]]]:
    """(every parameter that requires grad, those of them that stay resident), each by id as
    (name, parameter). A model none of whose weights is frozen (what from_pretrained returns) is
    offloaded whole, for inference; one with frozen weights keeps its trainable ones (adapters)
    resident; with an optimizer the trainable ones are offloaded and trained on the host."""
    grads: Dict[int, Tuple[str, torch.Tensor]] = {}
    for pname, p in module.named_parameters():
        if p.requires_grad:
            grads[id(p)] = (pname, p)
    if optimizer is not None:
        _train.check_optimizer(module, optimizer, grads, offload_trainable)
        offload_trainable = True
    elif offload_trainable is None:
        offload_trainable = len(grads) == len({id(p) for p in params})
    return grads, ({} if offload_trainable else grads)


def state_factor(optimizer: Any) -> int:
    """Device bytes one byte of a parameter trained on the device takes: itself, its gradient,
    the optimizer's state of it (Adam and AdamW: two moments, three with amsgrad; SGD: a
    momentum buffer when it has momentum; any other optimizer is counted as Adam) and one more
    for what the step allocates while it runs (torch's multi-tensor step on a GPU makes
    temporaries the size of the gradients)."""
    groups = optimizer.param_groups
    # torch's fused and single-tensor steps make no temporaries the size of the gradients
    temps = 0 if all(g.get("fused") or g.get("foreach") is False for g in groups) else 1
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return 4 + temps + any(g.get("amsgrad", False) for g in groups)
    if isinstance(optimizer, torch.optim.SGD):
        return 2 + temps + any(g.get("momentum", 0) for g in groups)
    return 5


def _nbytes_of(params: Dict[int, Tuple[str, torch.Tensor]]) -> int:
    return sum(_nbytes(p) for _, p in params.values())


def trained_on_device(grads: Dict[int, Tuple[str, torch.Tensor]], optimizer: Any, share: Any,
                      budget: int, recompute: Any = False) -> Dict[int, Tuple[str, torch.Tensor]]:
    """The trainable parameters offload(optimizer=) keeps on the device, with their gradients and
    the optimizer's state, updated there by the optimizer's own step: the first ones in the
    module's order (the forward's, as a rule: its first blocks are then ready first after a
    step; leading ones too large for the share, such as a large vocabulary's embedding, are
    passed over), up to `share` of the trained bytes (a float in [0, 1]) or, for "auto", as many as
    take at most AUTO_SHARE of the budget with their gradients and state. With recompute on,
    "auto" keeps every one of them when they take at most RECOMPUTE_SHARE of the budget so
    (nothing is then offloaded: the offload recomputes and keeps the step under the budget)."""
    if isinstance(share, bool) or not (share == "auto" or isinstance(share, (int, float))):
        raise ConfigError(f"offload: train_on_device must be 'auto' or a fraction in [0, 1], got {share!r}")
    if share != "auto" and not 0 <= share <= 1:
        raise ConfigError(f"offload: train_on_device = {share!r} is not a fraction in [0, 1]")
    factor = state_factor(optimizer)
    if share == "auto" and recompute and _nbytes_of(grads) * factor <= budget * RECOMPUTE_SHARE:
        return dict(grads)
    cap = _nbytes_of(grads) * share if share != "auto" else budget * AUTO_SHARE / factor
    kept: Dict[int, Tuple[str, torch.Tensor]] = {}
    used = 0
    for k, (name, p) in grads.items():
        nb = _nbytes(p)
        if used + nb > cap:  # one run of them: only those before the run (a large vocabulary's
            if kept:           # embedding) are passed over
                break
            continue
        kept[k] = (name, p)
        used += nb
    if share == "auto" and used * factor < _ARENA_PAGE:
        return {}  # less than the page of the budget they would take (the budget gives up whole pages)
    return kept


# Of an offload's budget, what parameters trained on the device may take with their gradients and
# state when train_on_device="auto": the rest holds the streamed units and the activations saved
# for backward. Also with recomputed activations (gradient checkpointing) the streamed units need
# that room: each is used in the forward and again in the recomputation (bench/RESULTS.md).
AUTO_SHARE = 0.7
# With the blocks recomputed, what is left beside the training state is the blocks' inputs, the
# head's activations and one block's recomputation: the state may take this share and stay whole
# on the device (bench/RESULTS.md: the 1.1B model's step at 18 GiB).
RECOMPUTE_SHARE = 0.92


class Layout(NamedTuple):
    """What offload() places where, decided before anything moves (layout)."""
    kept: Dict[int, Tuple[str, torch.Tensor]]  # trainable parameters that stay resident
    units: List[_Unit]
    needs: Dict[int, List[_Unit]]  # id(module) -> the units its hook acquires
    hooked: List[nn.Module]
    min_budget: int  # the least budget a forward runs in (check_room)
    budget: int  # the offload context's: what the parameters trained on the device leave
    ctx_opts: Dict[str, Any]  # the context's options, its defaults filled in
    device_trained: int  # bytes the parameters trained on the device take with gradients and state
    stack: bool = False  # plain segments chosen for the context: the units are a stack's (_partition.a_stack)
    fused: Tuple[_experts.Fused, ...] = ()  # modules whose fused experts move expert by expert


def in_segments(ctx_opts: Dict[str, Any]) -> bool:
    """Whether an offload's own context, made with ctx_opts after SPILLWAY_CONF, keeps its
    device memory in plain segments (option vmm off)."""
    return str(conf_option(ctx_opts, "vmm")).strip().lower() == "off"


def layout(module: nn.Module, blocks: Optional[Sequence[nn.Module]], names: Dict[int, str],
           grads: Dict[int, Tuple[str, torch.Tensor]], kept: Dict[int, Tuple[str, torch.Tensor]],
           optimizer: Any, train_on_device: Any, budget: int, shared: bool, ctx_opts: Dict[str, Any],
           activations: bool, recompute: Any = False, split_experts: bool = True) -> Layout:
    """The units and the room they need for a budget; with optimizer=, first which trainable
    parameters are trained on the device (trained_on_device), whose bytes, gradients and state
    the budget then gives up in whole arena pages (under a shared context they are its
    allocations already). Where "auto" keeps so many that the units have no room, it keeps half
    as many bytes, and so on; an explicit share that leaves no room is a ConfigError."""
    if optimizer is not None:
        kept = trained_on_device(grads, optimizer, train_on_device, budget, recompute)
    while True:
        cost = _nbytes_of(kept) * state_factor(optimizer) if optimizer is not None else 0
        paged = -(-cost // _ARENA_PAGE) * _ARENA_PAGE
        ctx_budget = budget if shared else budget - paged
        try:
            if ctx_budget <= 0:
                raise ConfigError(
                    f"offload: train_on_device={train_on_device!r} keeps {format_size(_nbytes_of(kept))} of "
                    f"parameters on the device, {format_size(cost)} with their gradients and optimizer state "
                    f"({format_size(paged)} in whole pages): the whole budget ({format_size(budget)}) or more; "
                    "lower it")
            streamed = _nbytes_of(grads) - _nbytes_of(kept) if optimizer is not None else 0

            def arrange(split: bool) -> Layout:
                opts = dict(ctx_opts)
                made, needs, hooked, fused = units(module, blocks, kept, grads, names, ctx_budget, streamed,
                                                   training=optimizer is not None,
                                                   segments=not shared and in_segments(ctx_opts),
                                                   split_experts=split)
                # An offload's own context for inference keeps a stack's units in plain segments
                # where they stream (the budget cannot hold them all), unless the options name the
                # arena's mode or its pages (_partition.a_stack).
                stack = (not shared and optimizer is None and not activations
                         and all(conf_option(ctx_opts, k) is None for k in ("vmm", "vmm_large_page"))
                         and sum(u.nbytes for u in made) > ctx_budget and _partition.a_stack(u.nbytes for u in made))
                if stack:
                    opts["vmm"] = "off"
                    made, needs, hooked, fused = units(module, blocks, kept, grads, names, ctx_budget, streamed,
                                                       segments=True, split_experts=split)
                if not made:  # every parameter trained on the device: nothing streams
                    return Layout(kept, made, needs, hooked, 0, ctx_budget, opts, cost)
                page = _ARENA_PAGE if shared else own_context_options(opts, made, activations)
                try:
                    need = check_room(module, made, needs, names, page, ctx_budget, fused)
                except ConfigError:
                    if not fused:
                        raise
                    # a layer's experts in slices can need more room than the layer whole (each
                    # slice is whole arena pages, and a prefill holds them all): whole, then
                    return arrange(False)
                return Layout(kept, made, needs, hooked, need, ctx_budget, opts, cost, stack, fused)

            return arrange(split_experts)
        except (ConfigError, InvalidArgument):
            if optimizer is None or train_on_device != "auto" or not kept:
                raise
            half, acc, fewer = _nbytes_of(kept) // 2, 0, {}
            for k, (name, p) in kept.items():
                acc += _nbytes(p)
                if acc > half:
                    break
                fewer[k] = (name, p)
            kept = fewer


def units(module: nn.Module, blocks: Optional[Sequence[nn.Module]], kept: Dict[int, Any],
          grads: Dict[int, Any], names: Dict[int, str], budget: int, streamed: int,
          training: bool = False, segments: bool = False,
          split_experts: bool = True) -> Tuple[List[_Unit], Dict[int, List[_Unit]], List[nn.Module],
                                           Tuple[_experts.Fused, ...]]:
    """(units, id(module) -> the units its hook acquires, the hooked modules, the modules whose
    fused experts move expert by expert): blocks=[...] as given, else the partition of the
    module tree for the budget (_partition.py), of which `streamed` bytes of trained weights
    cross the link every step, in a context of plain segments or not. Training (optimizer=)
    may leave nothing to offload: every parameter trained on the device; the parameters it
    trains are never split by expert, nor any without split_experts (offload's experts="whole")."""
    fused: Dict[int, _experts.Fused] = {}
    if blocks is not None:
        groups = [[b] for b in blocks]
    else:
        lo, hi = _partition.bounds(budget, streamed, segments)
        groups = _partition.partition(module, set(kept), lo, hi)
        if split_experts:
            # a module inside a unit that cannot be split (a wrapper re-parametrizing its
            # tensors: peft's LoRA on a Parameter) moves whole with it
            inside = {id(x) for g in groups for b in g for x in b.modules() if x is not b}
            fused = {k: f for k, f in _experts.find(module, set(grads) if training else set(kept), hi,
                                                    names).items() if k not in inside}
    made, needs, hooked = _plan_units(module, groups, set(kept), names, fused)
    if not made and not (training and len(kept) == len(grads)):
        raise InvalidArgument(
            f"offload: nothing to offload: all {len(grads)} parameters of {type(module).__name__} require "
            "grad, and trainable parameters stay resident. Freeze the weights first "
            "(module.requires_grad_(False)), keeping only adapters trainable")
    return made, needs, hooked, tuple(fused.values())


def own_context_options(ctx_opts: Dict[str, Any], units: Sequence[_Unit], activations: bool) -> int:
    """Fill in the defaults of an offload's own context (the caller's options win); returns the
    page its large-block arena maps units in."""
    # Large units are mapped in large pages: a copy is split at every physical allocation under
    # it, and each piece costs the enqueuing host time. A page is never larger than the largest
    # unit.
    ctx_opts.setdefault("vmm_large_page", _large_page(u.nbytes for u in units))
    # The context holds weights only: cached device memory within the budget is kept, not
    # returned on growth (returning it waits for the device; the budget is the user's).
    ctx_opts.setdefault("frag_slack", 10)
    # Activations of many sizes beside the units: a prefetch that would wait on a trim for its
    # room is declined (the trims stalled every training step).
    if activations:
        ctx_opts.setdefault("prefetch_trim", "off")
    return _arena_page(parse_size(str(ctx_opts["vmm_large_page"])))


def check_room(module: nn.Module, units: Sequence[_Unit], needs: Dict[int, List[_Unit]], names: Dict[int, str],
               page: int, budget: int, fused: Sequence[_experts.Fused] = ()) -> int:
    """The least budget a forward can run in (returned), checked against budget: the device
    arena maps memory in pages, so a unit occupies at least its size rounded up, and a forward
    holds a module's units with those of the hooked modules around it, each in whole arena
    pages (units up to the small-block limit share the small arena's pages). A module of fused
    experts may hold every expert's units at once (a prefill picks them all), with its own
    and the top level's."""
    def footprint(held: Sequence[_Unit]) -> int:
        small = sum(u.nbytes for u in held if u.nbytes <= _SMALL_LIMIT)
        return sum(_align(u.nbytes, page) for u in held if u.nbytes > _SMALL_LIMIT) + _align(small, _ARENA_PAGE)

    largest = max(units, key=lambda u: u.nbytes)
    need, holder, held = _held_together(module, needs, names, footprint)
    need = max(need, footprint([largest]))
    for f in fused:
        with_it = (needs.get(id(f.module), []) + (needs.get(id(module), []) if f.module is not module else [])
                   + f.all_units())
        n = footprint(with_it)
        if n > need:
            need, holder, held = n, f.label, with_it
    if budget < need:
        what = (f"the largest unit, {largest.name} ({format_size(largest.nbytes)}" if len(held) <= 1 else
                f"what {holder} holds at once, {len(held)} units ("
                + ", ".join(u.name for u in held[:4]) + (", ..." if len(held) > 4 else "")
                + f": {format_size(sum(u.nbytes for u in held))}")
        big = max(held or [largest], key=lambda u: u.nbytes)
        leaf = _leaf_module(module, big.name)
        advice = (f" ({big.name} is one {type(leaf).__name__}, which is not split)" if leaf is not None else
                  " or pass smaller blocks=[...]")
        raise ConfigError(
            f"offload: budget {format_size(budget)} is below {what}, {format_size(need)} in the device "
            f"arena's {format_size(page)} pages); raise the budget to at least {format_size(need)}{advice}")
    return need


def _leaf_module(module: nn.Module, name: str) -> "nn.Module | None":
    """The submodule called name if it has no submodules (a unit that cannot be made smaller)."""
    try:
        m = module.get_submodule(name)
    except (AttributeError, ValueError):
        return None
    return m if next(m.children(), None) is None else None
