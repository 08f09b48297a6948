"""torch.compile over an offloaded model: spillway's own Python is run, never traced.

The offload's hooks swap device tensors into the modules' parameter slots and call the library
through ctypes; a graph can hold neither, and Dynamo tracing them fails outright (a parameter's
`.data` set across devices has no fake-tensor rule) instead of breaking the graph. So every
code object of the package (functions, methods, properties, the closures inside them) is marked
for Dynamo to skip its frame, as `torch.compiler.disable(recursive=False)` does for one
function: the frames they call (the modules' own forwards) are still compiled, each hooked
module's forward a graph of its own, with a graph break where a hooked module is called.
The mark is on the code objects, so the eager path pays nothing for it. It must be made before a
compiled call reaches the hooks, and Dynamo traces the first frames of such a call before any of
ours runs; importing Dynamo only for this would cost an offload() seconds. So offload() marks at
once where Dynamo is loaded, and otherwise right after Dynamo's import, which torch.compile (in
either order with offload()) makes first: a finder ahead of the import system's, for that one
module, that lets the normal import run and marks when it is done. Torch without Dynamo (before
2.0) is left alone."""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading
import types
from typing import Any, Callable, Iterator, Optional, Sequence, Set

_lock = threading.RLock()  # re-entered where a mark imports Dynamo's modules under it
_marked: Set[str] = set()  # the package's modules whose code is marked
_DYNAMO = "torch._dynamo"
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the package's directory


def _skip_code() -> "Callable[[types.CodeType], None] | None":
    try:
        import torch._dynamo.eval_frame as ef  # torch 2.0 and later
    except Exception:  # no Dynamo: nothing traces
        return None
    return getattr(ef, "skip_code", None)


def _codes_of(obj: Any, ours: Callable[[Any], bool], seen: Set[int]) -> Iterator[types.CodeType]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (staticmethod, classmethod)):
        yield from _codes_of(obj.__func__, ours, seen)
    elif isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                yield from _codes_of(f, ours, seen)
    elif isinstance(obj, types.FunctionType) and ours(obj):
        # a decorator's wrapper (contextlib's) is not ours to mark: what it wraps is
        if os.path.abspath(obj.__code__.co_filename).startswith(_ROOT):
            yield from _nested(obj.__code__)
        inner = getattr(obj, "__wrapped__", None)
        if inner is not None:
            yield from _codes_of(inner, ours, seen)
    elif isinstance(obj, type) and ours(obj):
        for v in list(vars(obj).values()):
            yield from _codes_of(v, ours, seen)
    elif callable(obj) and ours(obj) and getattr(obj, "__wrapped__", None) is not None:
        yield from _codes_of(obj.__wrapped__, ours, seen)  # functools.lru_cache and the like


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    """code and the code objects defined inside it (closures, generator expressions)."""
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _nested(c)


def keep_out_of_graphs() -> None:
    """Mark every code object of the spillway package's loaded modules for Dynamo to skip (each
    module once a process)."""
    with _lock:
        mods = [(n, m) for n, m in list(sys.modules.items())
                if m is not None and n.split(".")[0] == "spillway" and n not in _marked]
        if not mods:
            return
        skip = _skip_code()
        ours = lambda o: (getattr(o, "__module__", None) or "").split(".")[0] == "spillway"  # noqa: E731
        seen: Set[int] = set()
        for name, mod in mods:
            if skip is not None:
                for v in list(vars(mod).values()):
                    for code in _codes_of(v, ours, seen):
                        skip(code)
            _marked.add(name)


class _AfterDynamo(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the import of torch._dynamo it takes itself off sys.meta_path,
    asks the other finders for the module, and has its loader mark the package's code after the
    module is executed."""

    def find_spec(self, name: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        if name != _DYNAMO:
            return None
        _remove_finder()
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader

        class _Marking(importlib.abc.Loader):
            def create_module(self, s: Any) -> Any:
                return loader.create_module(s)

            def exec_module(self, module: types.ModuleType) -> None:
                loader.exec_module(module)
                keep_out_of_graphs()

            def __getattr__(self, attr: str) -> Any:  # get_source, resource readers: the real loader's
                return getattr(loader, attr)

        spec.loader = _Marking()
        return spec


_finder: Optional[_AfterDynamo] = None


def _remove_finder() -> None:
    global _finder
    with _lock:
        if _finder is not None and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
        _finder = None


def prepare() -> None:
    """At offload(): mark now where Dynamo is loaded, else once it is imported; nothing where this
    torch has no Dynamo."""
    global _finder
    if _DYNAMO in sys.modules:
        keep_out_of_graphs()
        return
    import torch
    if not hasattr(torch, "compile"):
        return
    with _lock:
        if _finder is None:
            _finder = _AfterDynamo()
            sys.meta_path.insert(0, _finder)
