"""What keeps torch.compile from tracing the offload's own Python (spillway.torch._compile), on
any torch: every code object of the package reaches Dynamo's skip, the hooks' closures included;
and where Dynamo is not loaded yet, the mark waits for its import without making it. Torch 1.13
has no Dynamo, so a recording skip and a stand-in module name take their places; the compiled
runs themselves are tests/gpu/test_compile_gpu.py."""
from __future__ import annotations

import sys
import types

import pytest
import torch

import spillway.torch as spt
from spillway.torch import _compile, _offload, _prehooks

from models import frozen, make_stack


@pytest.fixture
def recorded(monkeypatch):
    codes = []
    monkeypatch.setattr(_compile, "_skip_code", lambda: codes.append)
    monkeypatch.setattr(_compile, "_marked", set())
    return codes


def _code_names(codes):
    return {c.co_qualname if hasattr(c, "co_qualname") else c.co_name for c in codes}


def test_every_code_object_of_the_package_is_marked(recorded):
    _compile.keep_out_of_graphs()
    marked = {id(c) for c in recorded}
    # a method, a closure made inside a method (each hooked module's forward wrapper), a
    # pre-hook wrapper's __call__, a module-level function
    forward_closure = next(c for c in _offload.Offload._block_forward.__code__.co_consts
                           if isinstance(c, types.CodeType) and c.co_name == "forward")
    for code in (_offload.Offload._block_forward.__code__, forward_closure,
                 _prehooks._Acquiring.__call__.__code__, spt.offload.__code__):
        assert id(code) in marked, code
    # a decorated method's own code (a context manager's generator), and nothing outside the
    # package (not contextlib's wrapper, which every context manager anywhere shares)
    import spillway.core
    from spillway.torch import _partition
    assert id(spillway.core.Context.step.__wrapped__.__code__) in marked
    cached = next(v for v in vars(_partition).values() if hasattr(v, "cache_info") and hasattr(v, "__wrapped__"))
    assert id(cached.__wrapped__.__code__) in marked  # under functools.lru_cache
    assert all(c.co_filename.startswith(_compile.__file__.rsplit("/torch/", 1)[0]) for c in recorded)
    n = len(recorded)
    _compile.keep_out_of_graphs()  # each module once
    assert len(recorded) == n


def test_offload_marks_at_once_where_dynamo_is_loaded(recorded, monkeypatch):
    monkeypatch.setattr(_compile, "_DYNAMO", "spw_test_loaded_dynamo")
    monkeypatch.setitem(sys.modules, "spw_test_loaded_dynamo", types.ModuleType("spw_test_loaded_dynamo"))
    off = spt.offload(frozen(make_stack(dim=1024)), budget="10MiB")
    try:
        assert len(recorded) > 100
        assert _compile._finder is None
    finally:
        off.remove()


def test_the_mark_waits_for_dynamo_to_be_imported(recorded, monkeypatch, tmp_path):
    """Where Dynamo is not loaded, offload() imports nothing: a finder marks the package right
    after the module's own import has run, and then leaves the import system."""
    name = "spw_test_later_dynamo"
    (tmp_path / f"{name}.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_compile, "_DYNAMO", name)
    monkeypatch.setattr(torch, "compile", lambda m: m, raising=False)  # a torch with torch.compile
    monkeypatch.delitem(sys.modules, name, raising=False)
    off = spt.offload(frozen(make_stack(dim=1024)), budget="10MiB")
    try:
        assert name not in sys.modules and not recorded
        assert _compile._finder in sys.meta_path
        mod = __import__(name)
        assert mod.LOADED and mod.__loader__.get_source(name) == "LOADED = True\n"
        assert len(recorded) > 100
        assert _compile._finder is None and not any(isinstance(f, _compile._AfterDynamo) for f in sys.meta_path)
    finally:
        off.remove()
        _compile._remove_finder()
        sys.modules.pop(name, None)


def test_no_dynamo_no_mark(monkeypatch):
    """A torch without torch.compile (1.x): nothing marked, no finder."""
    monkeypatch.delattr(torch, "compile", raising=False)
    monkeypatch.setattr(_compile, "_DYNAMO", "spw_test_absent_dynamo")
    _compile.prepare()
    assert _compile._finder is None
