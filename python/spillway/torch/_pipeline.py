"""Several models under one budget: a diffusers pipeline's text encoders, denoiser and VAE, or
any list of modules. Each module is offloaded as offload() does it (its own units, its own
steps: one per call of its forward) into one shared context, so the budget is the pipeline's:
while the denoiser runs step after step, the units of the text encoder, used once per image,
are the first the policy evicts.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

from ..core import Context, format_size
from ..errors import InvalidArgument
from . import _alloc, _report
from ._budget import resolve_budget
from ._device import _resolve_device
from ._offload import Offload


def modules_of(obj: Any) -> List[Tuple[str, nn.Module]]:
    """(name, module) for every model obj holds: a list, tuple or dict of modules, or an object
    with nn.Module attributes (a diffusers pipeline: its components)."""
    if isinstance(obj, torch.Tensor) or obj is None or isinstance(obj, (str, bytes, int, float)):
        raise InvalidArgument(f"offload: expected a torch.nn.Module, a list of them or an object holding them "
                              f"(a pipeline), got {type(obj).__name__}")
    if isinstance(obj, dict):
        items = list(obj.items())
    elif isinstance(obj, (list, tuple)):
        items = [(f"{i}", m) for i, m in enumerate(obj)]
    else:
        comps = getattr(obj, "components", None)
        source = comps if isinstance(comps, dict) else getattr(obj, "__dict__", {})
        items = [(k, v) for k, v in source.items() if isinstance(v, nn.Module)]
    out = []
    for name, m in items:
        if not isinstance(m, nn.Module):
            if m is None:
                continue  # an optional component left out (a safety checker)
            raise InvalidArgument(f"offload: {name!r} is a {type(m).__name__}, not a torch.nn.Module")
        if any(p.numel() for p in m.parameters()) or any(b.numel() for b in m.buffers()):
            out.append((str(name), m))
    if not out:
        raise InvalidArgument(f"offload: {type(obj).__name__} holds no torch.nn.Module with weights")
    for i, (n, m) in enumerate(out):
        for n2, m2 in out[i + 1:]:
            if m is m2:
                raise InvalidArgument(f"offload: the module {n!r} is given twice (also as {n2!r})")
            if any(s is m2 for s in m.modules()) or any(s is m for s in m2.modules()):
                inner, outer = (n2, n) if any(s is m2 for s in m.modules()) else (n, n2)
                raise InvalidArgument(f"offload: {inner!r} is a submodule of {outer!r}: give each module once")
    return out


class Offloads:
    """Handle returned by offload() for several modules: one Offload each, one context."""

    def __init__(self, names: List[str], offloads: List[Offload], context: Context, budget_source: str,
                 reserve: int, owns: bool) -> None:
        self.names = names
        self.offloads = offloads
        self.context = context
        self.budget_source = budget_source
        self.reserve = reserve
        self._owns = owns

    def __iter__(self) -> Iterator[Offload]:
        return iter(self.offloads)

    def __len__(self) -> int:
        return len(self.offloads)

    def __getitem__(self, key: Any) -> Offload:
        if isinstance(key, str):
            return self.offloads[self.names.index(key)]
        return self.offloads[key]

    def stats(self) -> Dict[str, Any]:
        """The shared context's counters plus "offload": each module's hook_stats by name."""
        out = self.context.stats()
        out["offload"] = {n: o.hook_stats() for n, o in zip(self.names, self.offloads)}
        return out

    def summary(self) -> str:
        """One line per module (units, bytes, hook time), then the shared context's table."""
        s = self.context.stats()
        src = {"default": f"the device's free memory less {format_size(self.reserve)} for activations",
               "shared": "use_allocator's", "given": "given"}[self.budget_source]
        lines = [f"spillway.torch offload of {len(self.offloads)} modules under one budget, "
                 f"{format_size(s['budget'])} ({src})"]
        for n, o in zip(self.names, self.offloads):
            total = sum(u.nbytes for u in o.units)
            lines.append(f"  {n:16} {format_size(total):>11} in {len(o.units)} unit{'s' if len(o.units) != 1 else ''}, "
                         f"{o.steps} steps, {o.hook_stats()['hook_us_median']:.1f} us host time per acquire (median)")
        line = _report.host_copies_line(s, sum(o.steps for o in self.offloads))
        lines += ([line] if line else []) + ["", self.context.summary()]
        return "\n".join(lines)

    def refresh_weights(self) -> None:
        """Offload.refresh_weights() of every module: after an edit of the weights that no
        version counter sees (an in-place op on .data; peft's merge(), and so a pipeline's
        fuse_lora(), is seen without it), the next forwards upload the host copies."""
        for o in self.offloads:
            o.refresh_weights()

    def remove(self) -> None:
        """Put every module back as it was (Offload.remove), then close the shared context."""
        for o in reversed(self.offloads):
            if not o._closed:
                o.remove()
        if self._owns and not self.context.closed:
            self.context.close()

    def __repr__(self) -> str:
        return f"<spillway.torch.Offloads of {', '.join(self.names)}>"


def offload_all(obj: Any, budget: Any = None, policy: str = "plan", device: Any = None, trace: Optional[str] = None,
                offload_trainable: Optional[bool] = None, **options: Any) -> Offloads:
    """offload() of every module obj holds (modules_of), in one context under one budget (given,
    use_allocator's, or the device's free memory less the reserve offload() takes). Returns an
    Offloads handle; on any error nothing is offloaded."""
    mods = modules_of(obj)
    backend, dev = _resolve_device(options.pop("backend", "auto"), device)
    ctx_opts = dict(options)
    if trace:
        ctx_opts["trace"] = str(trace)
    shared = _alloc.shared_context(dev, backend)
    b = resolve_budget(budget, backend, dev, (t for _, m in mods for t in list(m.parameters()) + list(m.buffers())),
                       ctx_opts, shared)
    if shared is not None:
        ctx = shared
    else:
        ctx_opts.setdefault("frag_slack", 10)  # weights only: cached memory within the budget is kept (_offload.py)
        ctx = Context(budget=b.bytes, policy=policy, backend=backend, **ctx_opts)
    done: List[Offload] = []
    try:
        for _, m in mods:
            done.append(Offload._build(m, None, policy, device, None, None, offload_trainable,
                                       {"backend": backend}, context=ctx))
    except BaseException:
        for o in reversed(done):
            o.remove()
        if shared is None:
            ctx.close()
        raise
    return Offloads([n for n, _ in mods], done, ctx, b.source, b.reserve, shared is None)
