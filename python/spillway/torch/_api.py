"""spillway.torch.offload(): one module, or several under one budget."""
from __future__ import annotations

from typing import Any, Iterable, Optional, Union

from torch import nn

from ..errors import ConfigError, InvalidArgument
from . import _alloc, _recompute
from ._device import _resolve_device
from ._offload import Offload
from ._pipeline import offload_all


def offload(module: Any, budget: Union[int, str, None] = None, policy: str = "plan", device: Any = None,
            blocks: Optional[Iterable[nn.Module]] = None, trace: Optional[str] = None,
            offload_trainable: Optional[bool] = None, optimizer: Any = None, activations: Optional[bool] = None,
            host_update: str = "spillway", overlap_update: Union[bool, str] = False, train_on_device: Any = "auto",
            process_group: Any = "auto", recompute: Any = None, **options: Any) -> Any:
    """Offload a module's weights and buffers to pinned host memory; they come to the device
    unit by unit as each forward reaches them. Returns the Offload handle.

    module: an nn.Module, or several under one budget (see offload_all: a list of modules, or an
    object with nn.Module attributes such as a diffusers pipeline).
    budget: device bytes for the offloaded weights (int, "4GiB", or "50%" of the device). Without
    one: under use_allocator, its budget; otherwise the device's free memory less a reserve for
    activations (a quarter of the device, at least 1 GiB, or half of a device of 2 GiB or
    less; the summary prints both). It does not
    cover activations, resident trainable parameters or anything else PyTorch allocates. It must
    hold what a forward holds at once (Offload.min_budget: the largest unit with the units of
    the modules around it, in whole pages) and fit in the device's free memory (counting the
    module's own weights on that device, which leave it); otherwise ConfigError is raised before
    anything moves.
    policy: "plan" (learns the step, evicts by next use, prefetches ahead) or "lru".
    device: the CUDA device (default: the current one); CPU with backend="emu".
    blocks: the modules to pack as one unit each. Default: units from the module tree and the
    budget (a module whose tensors fit a quarter of the budget is one unit; a larger one is
    split into its children; runs of small neighbours are grouped).
    offload_trainable: None (default) offloads parameters that require grad when no weight of
    the model is frozen (from_pretrained output, for inference: a backward that needs their
    gradient raises a clear error), and keeps them resident otherwise (adapters on a frozen
    base); True and False force either.
    optimizer: a torch.optim.Optimizer over trainable parameters of module, to train them
    through the offload (the loop stays `loss.backward(); opt.step(); opt.zero_grad()`). The
    trainable parameters are offloaded too, and their host Parameters (the CPU views between
    forwards) are the master copy: backward copies each gradient to pinned host memory on a
    side stream without waiting, and at the end of the backward (one wait) adds it to the host
    Parameter's .grad (so accumulation over several backwards, zero_grad, clip_grad_norm_ over
    module.parameters() and parameter groups work as on a resident model; hooks registered on
    the Parameters do not run), and opt steps on the host, its state there too: gradients and
    optimizer state take no device memory. opt.step is wrapped (remove() unwraps it) so that
    each step ends by dropping the device copies of the units holding opt's parameters; the
    next forward uploads the new values. Refused before anything moves (InvalidArgument) when
    opt is not an Optimizer, holds a tensor that is not a parameter of module, or module has no
    trainable one (frozen parameters in opt are offloaded as frozen weights and skipped, as
    torch's optimizers skip a parameter without a gradient); with offload_trainable=False it is a ConfigError. One module only (not a
    list or a pipeline).
    host_update: "spillway" (default): a torch.optim.AdamW's, Adam's or SGD's step runs in
    spillway's C kernels (multi-threaded, vectorized; docs/host_optimizer.md) on opt's own
    state, where every
    parameter is a contiguous float32 CPU tensor and the group asks for nothing the C step
    lacks (foreach, fused, capturable, a closure); otherwise, and for every other optimizer,
    opt's own step runs. "torch": always opt's own step (on the host: torch's CPU kernels,
    bitwise what opt computes on a CPU model).
    overlap_update: with optimizer= and the C step (host_update="spillway"), opt.step() starts
    the update on a background thread and returns; it runs unit by unit in the order of the
    forward, and the next forward waits for each unit's update only when it reaches it, so the
    update overlaps the forward instead of preceding it. The update is finished by the end of
    the next forward, the next opt.step(), opt.zero_grad(set_to_none=False), opt.state_dict(),
    the module's state_dict(), Offload.synchronize() and remove(); anything else that reads the
    parameters or opt's state before those must call Offload.synchronize() first. "backward"
    also computes each Adam or AdamW update during the backward, as soon as the parameter's
    gradient is in host memory, into spare tensors (host memory: one more copy of the
    parameters and of the moments it updates), and opt.step() keeps it where nothing it read
    has changed since (no clipping, no unscale, one backward a step; otherwise it is computed
    again in the step). Where host memory's bandwidth bounds the step, as on the machine
    measured (bench/RESULTS.md), that is slower than True. Off by default. Results are bitwise
    those of overlap_update=False.
    train_on_device: with optimizer=, the trainable parameters kept on the device with their
    gradients and opt's state, updated there by opt's own step, the rest being offloaded and
    updated on the host as above: the first ones in the module's order (its first blocks, as
    a rule), their bytes, gradients and state taken from the budget. "auto" (default): as many
    as take at most 70% of the budget so, and fewer where the streamed units then have no
    room; a fraction in [0, 1]: that share of the trainable bytes (0: all on the host). The
    host update reads and writes every byte of state each step, bound by host memory; on the
    device the same update takes a small part of the step.
    process_group: with optimizer=, data-parallel training (torchrun, one offload per rank):
    "auto" (default) averages the trained parameters' gradients over every rank when
    torch.distributed is initialized with more than one, as DistributedDataParallel does (each
    rank's gradient times 1 / world size, summed, on the device before it crosses the link), and
    sets them to the first rank's values at offload(); a ProcessGroup: over its ranks; None:
    never. Do not wrap the offloaded model in DistributedDataParallel (its reducer never sees an
    offloaded parameter's gradient): a forward inside one raises ConfigError. Every rank must
    run the same forward and backward, as under DistributedDataParallel.
    recompute: recompute blocks' activations in the backward instead of keeping them (the
    children of the model's ModuleLists that hold parameters: a transformer's layers, a UNet's
    down and up blocks): a block's forward under grad runs inside torch.utils.checkpoint
    (non-reentrant), which costs about one more forward of it in the backward and keeps none of
    its activations. False: none. True: every block. "auto": as few as keep the step
    under the device limit (use_allocator's budget; else the device memory free at offload()
    with what PyTorch held then), learnt over the first steps: the first recomputes every block
    and measures, the next few keep the activations of as many blocks as the peak leaves room
    for (they reset the peak memory statistics at each step), then the choice holds. On the
    emulated backend "auto" recomputes every block. None (default): "auto" when optimizer=
    trains under use_allocator (its one budget holds PyTorch's activations too, and streaming
    them through it fragments that budget: several times slower than recomputing), else False.
    With recompute on, train_on_device="auto"
    keeps every trainable parameter on the device when they take at most 92% of the budget
    with their gradients and state. Results are those of no recomputation (PyTorch's
    checkpoint restores the random state). A model that recomputes its own layers
    (gradient_checkpointing_enable) is left to it: "auto" does nothing, True is a ConfigError.
    activations: keep the tensors autograd saves for backward (of 1 MiB or more, not parameters)
    in buffers of the offload's context, under its budget: on the device while they fit,
    written back to pinned host memory when the room is needed, uploaded again when backward
    reads them. Default: on with optimizer= unless recompute is on (recomputing is the other way
    to leave them off the device), off otherwise. Hooks pushed before the forward
    (torch.utils.checkpoint, save_on_cpu) keep the tensors they are given.
    trace: write a Chrome trace of copies and evictions to this file.
    options: other spillway options (backend="auto"|"cuda"|"emu", prefetch="on", ...); an
    unknown one is a ConfigError. experts="auto" (the default) moves a mixture's fused experts
    (one 3D tensor a projection, transformers 5's layout) expert by expert, running the eager
    experts function, where a layer's experts are more than a unit; "whole" keeps each layer's
    experts one unit (can be faster where nearly every expert runs every step). While
    spillway.torch.use_allocator is active, the weights use its context of the device (its
    budget; budget and the context options here are not used).
    A unit that cannot be made resident during a forward raises spillway.torch.OutOfMemoryError,
    which is also torch's out-of-memory error. On any error the module is unchanged.
    """
    if not isinstance(module, nn.Module):
        if optimizer is not None or (process_group is not None and process_group != "auto"):
            raise InvalidArgument("offload: optimizer= trains one nn.Module (so does process_group=); offload the "
                                  "trained module on its own")
        return offload_all(module, budget=budget, policy=policy, device=device, trace=trace,
                           offload_trainable=offload_trainable, **options)
    block_list = None if blocks is None else list(blocks)
    if host_update not in ("torch", "spillway"):
        raise ConfigError(f"offload: host_update must be 'torch' or 'spillway', got {host_update!r}")
    if overlap_update not in (False, True, "backward"):
        raise ConfigError(f"offload: overlap_update must be True, False or 'backward', got {overlap_update!r}")
    if overlap_update and (optimizer is None or host_update != "spillway"):
        raise ConfigError("offload: overlap_update overlaps spillway's host update (optimizer= with "
                          "host_update='spillway') with the next forward; "
                          + ("no optimizer= was given" if optimizer is None else "host_update is 'torch'"))
    if recompute is None:  # "auto" where the trained model shares use_allocator's budget
        recompute = False
        if optimizer is not None:
            backend, dev = _resolve_device(options.get("backend", "auto"), device)
            recompute = "auto" if _alloc.shared_context(dev, backend) is not None else False
    # "auto" on a model that recomputes its layers itself is off, and so leaves the stash's default
    recompute = _recompute.resolve(recompute, module)
    stash = activations if activations is not None else optimizer is not None and not recompute
    return Offload._build(module, budget, policy, device, block_list, trace, offload_trainable, dict(options),
                          optimizer=optimizer, activations=bool(stash), host_update=host_update,
                          overlap_update=overlap_update, train_on_device=train_on_device,
                          process_group=process_group, recompute=recompute)
