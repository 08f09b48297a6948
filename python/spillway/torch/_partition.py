"""How offload() divides a module into units, from the budget and the module tree.

A unit is acquired as a whole, so it must be small enough that the budget holds several of
them at once (the plan prefetches the next while one runs), and large enough that its hook
costs far less than its transfer. partition() walks the tree from the top: a module whose
tensors fit `hi` bytes is one unit with everything below it; a larger one is split into its
children, recursively (its own tensors form a unit of their own, held while it runs; a module
whose tensors are all its own is one unit whatever its size), and runs of neighbouring children
below `lo` bytes are grouped into one unit, which each of them acquires (the first acquire
uploads it, the others find it resident); a run that stays below `lo` joins the child after it,
or at the end the unit of children before it, where the sum fits `hi`. A container that is
never called (ModuleList, ModuleDict) is always split: the modules in it are what runs. The
children of lists their parent iterates together (`zip(self.resnets, self.attentions)` in a UNet
block) are called alternately, and those of a list it picks from by index (a mixture's
`self.experts[idx]`) or loops over skipping some (`continue`) only when picked, so a run of
them would be held across other modules, or brought whole for one member: there runs stay
below about what the link moves in a hook's host time. A child's hook runs
only when the child is called, so a module whose forward handles its children's weights itself
is never split: torch's MultiheadAttention and transformer layers, and any module whose forward,
or a method it calls on self, re-parametrizes a child's tensor for the call (peft's LoRA on a
Parameter: torch's register_parametrization), as its source says. A module whose forward reads
a tensor below it itself (`self.dt_proj.weight` in Mamba's mixer; a top level computing its
head as x @ self.embed.weight.T) is split as any other, and the tensors it reads are in its own
unit, held while it runs (_units.py). Whatever the shape: decoder stacks,
UNets whose up blocks are larger than the budget, DiTs with two block lists, encoder-decoders.
No spillway calls here, and nothing moves.
"""
from __future__ import annotations

import functools
import inspect
import re
import textwrap
from typing import Dict, FrozenSet, Iterable, List, Set, Tuple

from torch import nn

from . import _wrapped

Group = List[nn.Module]  # modules whose tensors form one unit

_LO_MAX = 64 << 20  # units of this size already make a hook's host time a small part of the upload
_SCATTERED_RUN = 1 << 20  # about what the link moves in a hook's host time: a run worth a hook of its own
# Modules whose forward reads their children's weights directly (torch's fused attention and
# transformer-layer paths take out_proj.weight, linear1.weight, ...): never split from them.
_ATOMIC = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.RNNBase)


def bounds(budget: int, streamed: int = 0, segments: bool = False) -> "tuple[int, int]":
    """(lo, hi) for a budget: units up to a quarter of it, runs grouped to half of that (at most
    _LO_MAX). streamed: bytes that cross the link every step whatever the budget (trained
    weights, whose device copies each optimizer step makes stale); units of them are kept to a
    sixteenth of it, so that the plan can upload the next while one computes (one unit of the
    whole model would upload before any work starts). segments: the context's device memory is
    plain segments (vmm off), where the plan's static split streams every unit through two
    blocks of its largest unit's size; units up to a sixteenth of the budget keep those two
    within an eighth of it, and the bytes each step moves close to the offloaded bytes less the
    budget."""
    hi = max(budget // 4, 1)
    if streamed:
        hi = min(hi, max(streamed // 16, 1))
    if segments:
        hi = min(hi, max(budget // 16, 1))
    return min(hi // 2, _LO_MAX), hi


# A stack: nearly all of the offloaded bytes in units of its two most common sizes (a DiT's blocks
# are 0.99 of them, a decoder's layers with its embedding and head all; an SDXL UNet's repeated
# attention blocks 0.85, and it stays in pages).
_STACK_SHARE = 0.9


def a_stack(sizes: Iterable[int]) -> bool:
    """Whether units of these byte sizes are a stack's (a decoder's layers, a DiT's two block
    lists): most of the bytes in units of at most two sizes. An offload's own context for
    inference keeps such units in plain segments (vmm off) where they stream, unless told
    otherwise: the plan's static split streams them through slots of one size with no trim, and
    every upload is one copy, where pages cost a driver call per page it spans. Units of many
    sizes (a UNet's) share pages, which any free run serves."""
    by_size: Dict[int, int] = {}
    for n in sizes:
        by_size[n] = by_size.get(n, 0) + n
    total = sum(by_size.values())
    return total > 0 and sum(sorted(by_size.values())[-2:]) >= _STACK_SHARE * total


def subtree_bytes(module: nn.Module, skip: Set[int]) -> Dict[int, int]:
    """id(m) -> bytes of the distinct tensors (parameters not in skip, buffers) of m's subtree."""
    out: Dict[int, int] = {}

    def visit(m: nn.Module) -> Set[int]:
        ids: Dict[int, int] = {}
        for t in m.parameters(recurse=True):
            if id(t) not in skip:
                ids[id(t)] = _wrapped.nbytes(t)
        for t in m.buffers(recurse=True):
            ids[id(t)] = _wrapped.nbytes(t)
        out[id(m)] = sum(ids.values())
        return set(ids)

    for m in module.modules():
        visit(m)
    return out


def partition(module: nn.Module, skip: Set[int], lo: int, hi: int) -> List[Group]:
    """The groups of module's subtree that become units (see the module docstring). skip: ids of
    parameters that are not offloaded."""
    size = subtree_bytes(module, skip)
    groups: List[Group] = []
    seen: Set[int] = set()

    def whole(m: nn.Module) -> bool:
        """Whether m is one unit, fitting or not: it cannot be split (its tensors are all its
        own, or it reads its children's)."""
        return _called(m) and (isinstance(m, _ATOMIC) or not any(size[id(c)] for c in m.children())
                               or (m is not module and _forward_reads(type(m))[1]))

    def visit(m: nn.Module, scattered: bool = False) -> None:
        # The top level is always split (unless it cannot be): its own methods other than forward
        # (a VAE's decode) call its children, whose hooks then bring their units.
        if whole(m) or (_called(m) and size[id(m)] <= hi and m is not module):
            groups.append([m])
            return
        # scattered: m is a list whose children are not called back to back (_scattered): a run
        # of them is held from its first call to its last, across other modules, and acquired
        # again for each, or brought whole for the one member a mixture's router picks; so runs
        # stay below what the link moves in a hook's host time, and each larger child is a unit
        # of its own
        run_hi = min(_SCATTERED_RUN, hi) if scattered else hi
        run_lo = min(lo, run_hi)
        apart = _scattered(type(m)) if _called(m) else frozenset()
        run: Group = []
        run_bytes = 0
        last = 0  # bytes of groups[-1] when it is a group of m's children made here, else 0

        def flush() -> None:
            nonlocal run, run_bytes, last
            if run:
                groups.append(run)
                last = run_bytes
            run, run_bytes = [], 0

        for c in _distinct(m.children(), seen):
            n = size[id(c)]
            if n == 0:
                continue
            if n > hi and run and run_bytes * 64 <= n and whole(c) and not scattered:
                # a run of modules tiny beside the child after it, which will be one unit anyway
                # (a batch norm before a convolution larger than a unit), joins its unit rather
                # than paying a hook of its own
                groups.append(run + [c])
                run, run_bytes, last = [], 0, 0
            elif n > run_hi or not _called(c):
                flush()
                visit(c, scattered=not _called(c) and any(m._modules.get(k) is c for k in apart))
                last = 0
            else:
                # c joins the run where both fit: a run of small modules before a child of lo or
                # more (a norm before its attention) is then part of its unit, not a unit too
                # small to pay for its hook
                if run_bytes + n > run_hi:
                    flush()
                run.append(c)
                run_bytes += n
                if run_bytes >= run_lo:
                    flush()
        if run and last and last + run_bytes <= run_hi:  # small modules at the end join the unit before
            groups[-1].extend(run)
            run = []
        flush()

    seen.add(id(module))
    visit(module)
    return groups


def _called(m: nn.Module) -> bool:
    """Whether m is run through its own forward: a ModuleList or ModuleDict only holds modules
    (its parent calls them one by one), so its units are its children's."""
    return not isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is not nn.Module.forward


def _distinct(mods: Iterable[nn.Module], seen: Set[int]) -> List[nn.Module]:
    """mods not met before in the walk (a module registered in two places is placed once)."""
    out = []
    for m in mods:
        if id(m) not in seen:
            seen.add(id(m))
            out.append(m)
    return out


_SELF_PATH = re.compile(r"\bself((?:\.[A-Za-z_]\w*)+)")  # self.a, self.a.b.c, ...
_SELF_CALL = re.compile(r"\bself\.([A-Za-z_]\w*)\s*\(")
# getattr(self, "a") and getattr(self.a.b, "c"), with a name written out: the path self.a.b.c
_SELF_GETATTR = re.compile(r"\bgetattr\(\s*self((?:\.[A-Za-z_]\w*)*)\s*,\s*[\"']([A-Za-z_]\w*)[\"']")
# a local name given to an attribute path of self on a line of its own (proj = self.dt_proj)
_SELF_ALIAS = re.compile(r"^[ \t]*([A-Za-z_]\w*)[ \t]*=[ \t]*self((?:\.[A-Za-z_]\w*)+)[ \t]*(?:#.*)?$", re.M)
# What a host copy answers as the device copy does: reading it is not a read of the tensor.
_META = frozenset(("dtype", "shape", "ndim", "requires_grad", "is_floating_point", "size", "dim", "numel",
                   "element_size"))


@functools.lru_cache(maxsize=None)
def _sources(cls: type) -> Tuple[str, ...]:
    """The source of cls.forward and of the methods of cls it calls as self.method(...),
    transitively. Nothing where the source cannot be read (a compiled or generated forward) or
    forward is torch.nn's own."""
    out: List[str] = []
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        fn = getattr(cls, name, None)
        if not inspect.isfunction(fn):
            continue
        fn = inspect.unwrap(fn)  # forwards under functools.wraps decorators (transformers' output handling)
        if (fn.__module__ or "").startswith("torch.nn."):  # None: a class made by exec() without __name__
            continue
        try:
            src = textwrap.dedent(inspect.getsource(fn))
        except (OSError, TypeError):
            continue
        out.append(src)
        todo.extend(_SELF_CALL.findall(src))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def _forward_reads(cls: type) -> Tuple[FrozenSet[Tuple[str, ...]], bool]:
    """(the attribute paths of every `self.a.b...`, `getattr(self.a, "b")` and `x.b` after
    `x = self.a` in _sources(cls); whether register_parametrization is called there)."""
    reads: Set[Tuple[str, ...]] = set()
    parametrizes = False
    for src in _sources(cls):
        reads.update(tuple(p.split(".")[1:]) for p in _SELF_PATH.findall(src))
        reads.update(tuple(p.split(".")[1:]) + (n,) for p, n in _SELF_GETATTR.findall(src))
        for alias, path in _SELF_ALIAS.findall(src):  # proj.weight after proj = self.dt_proj
            head = tuple(path.split(".")[1:])
            rest = re.findall(rf"\b{alias}((?:\.[A-Za-z_]\w*)+)", src)
            reads.update(head + tuple(r.split(".")[1:]) for r in rest)
        parametrizes = parametrizes or "register_parametrization(" in src
    return frozenset(reads), parametrizes


_ZIP = re.compile(r"\bzip\(([^()]*)\)")  # zip(self.resnets, self.attentions[1:])
_SELF_PICK = re.compile(r"\bself\.([A-Za-z_]\w*)\[\s*([A-Za-z_][\w.]*)\s*\]")  # self.experts[expert_idx]
_RANGE_LOOP = re.compile(r"\bfor\s+([A-Za-z_]\w*)\s+in\s+range\(")
# for e in self.experts:, for i, e in enumerate(self.experts):
_LIST_LOOP = re.compile(r"\bfor\s+[^:\n]*\bin\s+(?:enumerate\(\s*)?self\.([A-Za-z_]\w*)\s*\)?\s*:")
_CONTINUE = re.compile(r"\bcontinue\b")
_LOOP_HEAD = re.compile(r"\s*(?:async\s+)?(?:for|while)\b")


def _skips(src: str) -> bool:
    """Whether src skips an iteration with `continue` outside training: a `continue` under an
    `if` that tests self.training (LayerDrop) skips nothing at inference, where the list's
    modules run back to back."""
    lines = src.splitlines()
    for i, line in enumerate(lines):
        if not _CONTINUE.search(line.split("#", 1)[0]):
            continue
        depth = len(line) - len(line.lstrip())
        training = False
        for head in reversed(lines[:i]):
            text = head.split("#", 1)[0]
            indent = len(text) - len(text.lstrip())
            if not text.strip() or indent >= depth:
                continue
            depth = indent
            if _LOOP_HEAD.match(text):
                break
            training = training or "self.training" in text
        if not training:
            return True
    return False


@functools.lru_cache(maxsize=None)
def _scattered(cls: type) -> FrozenSet[str]:
    """The attributes of self whose children _sources(cls) does not call back to back: lists it
    iterates together with another one, as zip(self.a, self.b) or self.a[i] and self.b[i] in
    one loop do (a UNet block's resnets and attentions alternate), and lists it picks from by
    an index that is not a range() loop's, as self.experts[expert_idx] (a mixture calls the
    experts its router picks). self.layers[i] alone in a range() loop calls them in order,
    unless the method skips some with `continue` (a mixture looping over every expert and
    skipping those no token picked), as a loop over the list itself does; LayerDrop's skip,
    only in training, does not count (a skipped module of a run costs its bytes, not a
    wrong result)."""
    names: Set[str] = set()
    for src in _sources(cls):
        for args in _ZIP.findall(src):
            found = {p.split(".")[1] for p in _SELF_PATH.findall(args)}  # self.a.b: a
            if len(found) > 1:
                names |= found
        skips = _skips(src)
        ranged = set(_RANGE_LOOP.findall(src))
        lists_by_index: Dict[str, Set[str]] = {}
        for name, index in _SELF_PICK.findall(src):
            lists_by_index.setdefault(index, set()).add(name)
        for index, lists in lists_by_index.items():
            if index not in ranged or len(lists) > 1 or skips:
                names |= lists
        if skips:
            names.update(_LIST_LOOP.findall(src))
    return frozenset(names)


def children_read(m: nn.Module) -> List[nn.Module]:
    """The modules below m a tensor of which m's forward reads itself (self.proj.weight,
    self.block.attn.qkv.weight; _forward_reads), not through their own forward: in the order of
    m.modules()."""
    owners: Set[int] = set()
    for path in _forward_reads(type(m))[0]:
        cur = m
        for i, name in enumerate(path):
            child = cur._modules.get(name)
            if child is not None:
                cur = child
                continue
            if cur is not m and (i + 1 == len(path) or path[i + 1] not in _META):
                owner = _tensor_owner(cur, name)
                if owner is not None:
                    owners.add(id(owner))
            break
    return [c for c in m.modules() if id(c) in owners]


def _tensor_owner(mod: nn.Module, name: str) -> "nn.Module | None":
    """The module below mod (mod itself included) holding mod.name as a parameter or buffer:
    mod's own tensor, or one an attribute of mod returns from below it (peft's LoRA layers
    answer .weight with their base layer's)."""
    if mod._parameters.get(name) is not None or mod._buffers.get(name) is not None:
        return mod
    if name in mod.__dict__ or not isinstance(getattr(type(mod), name, None), property):
        return None
    try:
        t = getattr(mod, name)
    except Exception:  # a property that cannot answer here: not a read this can place
        return None
    for sub in mod.modules():
        if any(v is t for v in sub._parameters.values()) or any(v is t for v in sub._buffers.values()):
            return sub
    return None
