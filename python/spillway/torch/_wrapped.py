"""Tensors of a wrapper subclass: a tensor with no storage of its own whose data are plain tensors
it holds as attributes, named by its __tensor_flatten__ and put back together by its class's
__tensor_unflatten__ (torchao's quantized tensors, optimum-quanto's). The offload moves the plain
tensors (the leaves) and gives a module, while its unit is acquired, a tensor of the subclass
rebuilt over their device copies; the parameter itself holds host copies between forwards.

No spillway calls and no other module of the package here."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

# How a wrapper is put back together: (its class, the context __tensor_flatten__ gave, the names
# of its inner tensors, for each name a leaf index, a nested _Tree or None, its size and stride).
_Tree = Tuple[type, Any, Tuple[str, ...], Tuple[Any, ...], Tuple[int, ...], Tuple[int, ...]]

_swap = getattr(torch.utils, "swap_tensors", None)


def is_wrapper(t: torch.Tensor) -> bool:
    """Whether t is a tensor of a wrapper subclass that can be taken apart and rebuilt."""
    cls = type(t)
    return (cls is not torch.Tensor and cls is not torch.nn.Parameter and hasattr(cls, "__tensor_unflatten__")
            and hasattr(t, "__tensor_flatten__"))


def flatten(t: torch.Tensor) -> Tuple[_Tree, List[Tuple[str, torch.Tensor]]]:
    """t taken apart: (how to rebuild it, its leaves as (dotted path from t, plain tensor)), in
    the order rebuild() takes them."""
    leaves: List[Tuple[str, torch.Tensor]] = []

    def walk(x: torch.Tensor, prefix: str) -> _Tree:
        names, ctx = x.__tensor_flatten__()
        kids: List[Any] = []
        for n in names:
            inner = getattr(x, n)
            if inner is None:  # an optional tensor it does not have: rebuilt as None
                kids.append(None)
            elif is_wrapper(inner):
                kids.append(walk(inner, f"{prefix}{n}."))
            else:
                kids.append(len(leaves))
                leaves.append((prefix + n, inner))
        return (type(x), ctx, tuple(names), tuple(kids), tuple(x.size()), tuple(x.stride()))

    return walk(t, ""), leaves


def nbytes(t: torch.Tensor) -> int:
    """The bytes t's data take: its leaves' for a wrapper (a quantized weight's, not what its
    logical dtype would take)."""
    if is_wrapper(t):
        return sum(x.numel() * x.element_size() for _, x in flatten(t)[1])
    return t.numel() * t.element_size()


def rebuild(tree: _Tree, leaves: Sequence[torch.Tensor], like: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A tensor of tree's subclass over the given leaf tensors (not copied). like: a tensor
    whose other attributes (those its flatten does not name) the result takes too."""
    def build(node: _Tree) -> torch.Tensor:
        cls, ctx, names, kids, size, stride = node
        inner: Dict[str, Any] = {n: (leaves[k] if isinstance(k, int) else None if k is None else build(k))
                                 for n, k in zip(names, kids)}
        return cls.__tensor_unflatten__(inner, ctx, size, stride)

    out = build(tree)
    if like is not None:
        mine = out.__dict__
        for k, v in like.__dict__.items():
            if k not in mine:
                mine[k] = v
    return out


def set_leaves(t: torch.Tensor, tree: _Tree, leaves: Sequence[torch.Tensor]) -> None:
    """Make t hold the given leaf tensors in place of its own. When its device changes with them
    (a weight quantized on the device, now with host copies), t takes a rebuilt tensor's whole
    state (torch.utils.swap_tensors: same object, so modules and optimizers still hold it); where
    that cannot be done (a torch without it, a weak reference to t), the leaves are set in
    place and t's device attribute stays what it was."""
    if _swap is not None and leaves and t.device != leaves[0].device:
        fresh = rebuild(tree, leaves, like=t)
        try:
            _swap(t, fresh)
            return
        except RuntimeError:
            pass

    def walk(x: torch.Tensor, node: _Tree) -> None:
        for n, k in zip(node[2], node[3]):
            if isinstance(k, int):
                setattr(x, n, leaves[k])
            elif k is not None:
                walk(getattr(x, n), k)

    walk(t, tree)
