"""spillway.torch.use_allocator on the emu backend (CPU torch cannot route CUDA allocations, so
allocations go through the library's PyTorch entry points by ctypes, as PyTorch would call them):
configuration, per-device contexts and budgets, the statistics functions, the OOM error PyTorch's
observer raises, and one budget shared with offload()."""
from __future__ import annotations

import contextlib
import copy
import gc
import threading
import weakref

import pytest
import torch

import spillway
import spillway.torch as spt
from spillway import _lib
from spillway.torch import _alloc, _budget
from models import make_stack

MiB = 1 << 20
lib = _lib.lib
EMU = dict(backend="emu", emu_capacity="256MiB")


@pytest.fixture(autouse=True)
def fresh():
    _alloc._shutdown()
    yield
    a = spt.current()
    if a is not None:
        a.close()
    _alloc._shutdown()


def talloc(nbytes: int, device: int = 0) -> int:
    return lib.spw_torch_alloc(nbytes, device, None) or 0


def tfree(ptr: int, nbytes: int, device: int = 0) -> None:
    lib.spw_torch_free(ptr, nbytes, device, None)


# ---- configuration ----

def test_budget_forms_become_the_librarys_list():
    assert _budget._conf_text({1: "8GiB", 0: 4 * MiB}, {}) == "budget=0:4194304;1:8589934592"
    assert _budget._conf_text("0:4GiB;1:8GiB", {"policy": "lru"}) == "policy=lru,budget=0:4294967296;1:8589934592"
    assert _budget._conf_text(" 1: 50 %;0:6 GB", {}) == "budget=0:6442450944;1:50%"
    assert _budget._conf_text("50%", {"prefetch": True}) == "prefetch=on,budget=50%"
    assert _budget._conf_text(None, {}) == ""
    for bad in ({"0": "1GiB"}, {0: "lots"}, 0, -5, 1.5, {}, "many", "0:1GiB;0:2GiB", "0:1GiB;x:2GiB", "0:1GiB;",
                "0:lots"):
        with pytest.raises(spillway.ConfigError):
            _budget._conf_text(bad, {})
    with pytest.raises(spillway.ConfigError, match="chosen per allocation by PyTorch"):
        _budget._conf_text("1GiB", {"device": 1})
    with pytest.raises(spillway.ConfigError, match="mode must be"):
        spt.use_allocator("1GiB", mode="everything", **EMU)


def test_bad_options_change_nothing():
    with pytest.raises(spillway.ConfigError, match="no_such_option"):
        spt.use_allocator("8MiB", no_such_option=1, **EMU)
    with pytest.raises(spillway.ConfigError, match="device 0 is given twice"):
        spt.use_allocator("0:8MiB;0:9MiB", **EMU)
    assert spt.current() is None
    a = spt.use_allocator({0: "8MiB"}, **EMU)  # still possible: nothing was configured
    assert spt.context(0).budget == 8 * MiB
    a.close()


def test_per_device_contexts_and_budgets():
    a = spt.use_allocator({0: "8MiB", 1: "16MiB"}, **EMU)
    assert a.mode == "global" and not a.routed  # emu: contexts only
    p0, p1 = talloc(MiB, 0), talloc(MiB, 1)
    assert p0 and p1
    c0, c1 = spt.context(0), spt.context(1)
    assert c0.budget == 8 * MiB and c1.budget == 16 * MiB
    assert c0.backend == "emu"
    assert spt.context(0) is c0  # one Python object per device
    assert talloc(12 * MiB, 0) == 0  # over device 0's budget
    p = talloc(12 * MiB, 1)  # within device 1's
    assert p
    tfree(p, 12 * MiB, 1)
    tfree(p0, MiB, 0)
    tfree(p1, MiB, 1)
    c0.close()  # shared: closing the Python object destroys nothing
    assert spt.memory_reserved(0) > 0


def test_one_configuration_per_process():
    a = spt.use_allocator("8MiB", **EMU)
    with pytest.raises(spillway.StateError, match="already active"):
        spt.use_allocator("8MiB", **EMU)
    p = talloc(MiB)
    a.close()
    with pytest.raises(spillway.StateError, match="one configuration per process"):
        spt.use_allocator("16MiB", **EMU)
    b = spt.use_allocator("8MiB", **EMU)  # the same options: fine, same contexts
    assert spt.context(0).budget == 8 * MiB
    tfree(p, MiB)
    b.close()


# ---- statistics ----

def test_stats_functions():
    spt.use_allocator("32MiB", **EMU)
    p = talloc(6 * MiB)
    q = talloc(4 * MiB)
    assert spt.memory_allocated(0) == 10 * MiB
    assert spt.max_memory_allocated(0) == 10 * MiB
    assert spt.memory_reserved(0) >= 10 * MiB
    tfree(q, 4 * MiB)
    assert spt.memory_allocated(0) == 6 * MiB
    assert spt.max_memory_allocated(0) == 10 * MiB
    spt.reset_peak_memory_stats(0)
    assert spt.max_memory_allocated(0) == 6 * MiB
    st = spt.memory_stats(0)
    assert st["live.current"] == 6 * MiB and st["budget"] == 32 * MiB
    assert st["tensors.current"] == 6 * MiB and st["weights.current"] == 0
    assert st["held.peak"] <= 32 * MiB
    text = spt.memory_summary(0)
    for want in ("budget            32.00 MiB", "tensors           6.00 MiB", "offloaded weights 0 B",
                 "spillway memory summary"):
        assert want in text, text
    tfree(p, 6 * MiB)
    assert spt.memory_reserved(0) > 0
    spt.empty_cache()
    assert spt.memory_reserved(0) == 0
    assert spt.max_memory_reserved(0) >= 10 * MiB


def test_call_stats_count_pytorchs_segment_calls_and_their_time():
    spt.use_allocator("32MiB", **EMU)
    before = spt.memory_stats(0)
    p = talloc(6 * MiB)
    assert talloc(64 * MiB) == 0  # refused: counted as well
    tfree(p, 6 * MiB)
    st = spt.memory_stats(0)
    assert st["torch_alloc_calls"] - before["torch_alloc_calls"] == 2
    assert st["torch_free_calls"] - before["torch_free_calls"] == 1
    assert st["torch_alloc_ns"] > before["torch_alloc_ns"] and st["torch_free_ns"] > before["torch_free_ns"]
    _alloc._shutdown()
    out = (_lib.ctypes.c_uint64 * 4)()
    lib.spw_torch_call_stats(0, out)
    assert list(out) == [0, 0, 0, 0]  # shutdown starts them again
    lib.spw_torch_call_stats(-1, out)
    assert list(out) == [0, 0, 0, 0]


# ---- out of memory ----

def test_refusal_becomes_torch_out_of_memory_with_spillways_message():
    spt.use_allocator({0: "8MiB"}, **EMU)
    p = talloc(6 * MiB)
    assert _alloc._oom_observer(0, 6 * MiB, 0, 0) is None  # nothing refused: not ours
    assert talloc(6 * MiB) == 0
    with pytest.raises(spt.OutOfMemoryError) as info:
        _alloc._oom_observer(0, 5 * MiB, 0, 0)
    e = info.value
    assert isinstance(e, spillway.OutOfMemoryError)
    assert isinstance(e, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))
    msg = str(e)
    for want in ("PyTorch asked for 5.00 MiB", "device 0", "requested 6.00 MiB", "budget 8.00 MiB", "held",
                 "live 6.00 MiB", "cached", "What would help", "use_allocator(budget=...)"):
        assert want in msg, msg
    assert "refusals 1" in spt.memory_summary(0)
    # another device's OOM is not spillway's
    assert _alloc._oom_observer(1, MiB, 0, 0) is None
    tfree(p, 6 * MiB)
    q = talloc(6 * MiB)  # a success clears the refusal: a later OOM elsewhere keeps PyTorch's message
    assert q and _alloc._oom_observer(0, MiB, 0, 0) is None
    tfree(q, 6 * MiB)


# ---- one budget with offload ----

def test_offload_shares_the_budget_and_is_evicted_before_a_refusal():
    spt.use_allocator("24MiB", policy="lru", **EMU)
    m = make_stack(dim=1000, depth=4).requires_grad_(False)  # four ~3.8 MiB units
    ref = copy.deepcopy(m)
    x = torch.randn(3, 1000)
    off = spt.offload(m, budget="24MiB", backend="emu")
    assert off.context is spt.context(0)
    assert torch.equal(m(x), ref(x))
    st = spt.memory_stats(0)
    assert st["weights.current"] >= 15 * MiB  # every unit stayed resident: room enough
    kv = talloc(14 * MiB)  # a growing KV cache: does not fit beside the weights
    assert kv, _lib.last_error()
    st = spt.memory_stats(0)
    assert st["evictions_clean.total"] >= 2
    assert st["tensors.current"] == 14 * MiB
    assert st["held.peak"] <= 24 * MiB
    before = off.context.stats()["bytes_h2d"]["total"]
    assert torch.equal(m(x), ref(x))  # weights come back one unit at a time within the budget
    moved = off.context.stats()["bytes_h2d"]["total"] - before
    weights = sum(u.nbytes for u in off.units)
    assert moved >= weights - (24 - 14) * MiB  # the room beside the KV cache holds two units at most
    text = spt.memory_summary(0)
    assert "tensors           14.00 MiB" in text and "offloaded weights" in text
    # a torch allocation that cannot fit even with every weight evicted is refused
    assert talloc(12 * MiB) == 0
    assert spt.memory_stats(0)["weights.current"] == 0
    off.remove()
    assert not spt.context(0).closed  # remove() leaves the shared context alone
    tfree(kv, 14 * MiB)


def test_offload_without_allocator_keeps_its_own_context():
    m = make_stack(dim=64, depth=2).requires_grad_(False)
    off = spt.offload(m, budget="4MiB", backend="emu")
    assert off.context.budget == 4 * MiB
    off.remove()
    assert off.context.closed


# ---- PyTorch's cache of the routed pools (the calls into torch._C are recorded, not made) ----

class _Pool:
    def __init__(self, n: int) -> None:
        self.id = (0, n)


class _Anchor:
    """What the fake torch.empty returns: weak-referenceable, to see when an anchor is let go."""


@pytest.fixture
def routed(monkeypatch):
    """An emu allocator that believes it routes: pools for devices 0 and 1, and the torch calls
    that make pools freeable, route, make pools and empty the cache recorded in order.
    awaiting[device]: the bytes PyTorch's counters show awaiting other streams (0 unless set)."""
    calls = []
    refuse = {"anchor": False}
    awaiting = {}
    made = {"n": 100}

    def empty(n, dtype=None, device=None):
        calls.append(("anchor", device.index))
        if refuse["anchor"]:
            raise _alloc._TORCH_OOM("refused")
        return _Anchor()

    class MemPool:
        def __init__(self, allocator=None):
            made["n"] += 1
            self.id = (0, made["n"])
            calls.append(("pool", self.id))

    def empty_cache():
        calls.append(("empty_cache",))
        awaiting.clear()  # no capture underway any more: PyTorch recycles them

    def memory_stats(device=None):
        return {"active_bytes.all.current": 5 * MiB + awaiting.get(device, 0), "allocated_bytes.all.current": 5 * MiB}

    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda d, pid: calls.append(("release", d, pid)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda d, pid: calls.append(("end", d, pid)), raising=False)
    monkeypatch.setattr(torch._C, "_cuda_beginAllocateToPool", lambda d, pid: calls.append(("begin", d, pid)),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "MemPool", MemPool, raising=False)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "memory_stats", memory_stats)
    monkeypatch.setattr(_alloc.torch, "empty", empty)
    a = spt.use_allocator({0: "8MiB", 1: "8MiB"}, **EMU)
    a.routed, a._pools = True, {0: _Pool(1), 1: _Pool(2)}
    yield a, calls, refuse, awaiting
    a.routed = False


def test_global_mode_makes_a_pool_freeable_once_with_an_anchor_then_empties_the_cache(routed):
    a, calls, refuse, _ = routed
    p = talloc(MiB, 0)  # device 0 has a context; device 1 none
    spt.empty_cache()
    assert calls == [("anchor", 0), ("release", 0, (0, 1)), ("release", 0, (0, 1)), ("empty_cache",)]
    del calls[:]
    spt.empty_cache()  # freeable already: the cache is emptied, nothing released twice
    assert calls == [("empty_cache",)]
    del calls[:]
    refuse["anchor"] = True  # an anchor that cannot be allocated leaves the pool as it was
    q = talloc(MiB, 1)
    spt.empty_cache()
    assert calls == [("anchor", 1), ("empty_cache",)] and a._freeable == {0}
    tfree(p, MiB, 0)
    tfree(q, MiB, 1)


def test_oom_observer_empties_pytorchs_cache_before_raising(routed):
    a, calls, _, _ = routed
    p = talloc(6 * MiB, 0)
    assert talloc(6 * MiB, 0) == 0
    with pytest.raises(spt.OutOfMemoryError, match="budget 8.00 MiB"):
        _alloc._oom_observer(0, 6 * MiB, 0, 0)
    assert calls[-1] == ("empty_cache",) and ("anchor", 0) in calls
    del calls[:]
    assert _alloc._oom_observer(1, MiB, 0, 0) is None and calls == []  # not spillway's: nothing done
    tfree(p, 6 * MiB, 0)


def test_pool_mode_retires_only_pools_no_with_routes_to(routed):
    a, calls, _, _ = routed
    a.mode, a._entered = "pool", {0: 1}
    spt.empty_cache()
    assert calls == [("release", 1, (0, 2)), ("empty_cache",)]
    assert list(a._pools) == [0]  # device 1 gets a new pool at its next `with`


def test_a_refused_segment_reclaims_pytorchs_cache_and_is_retried(routed, monkeypatch):
    """spw_torch_set_reclaim: the segment that hits the budget calls back into Python, which
    empties PyTorch's cache (here: segments this test holds as "cached"), and is then allocated;
    with nothing to give back, or a pool that is not freeable, it is refused as before."""
    a, calls, _, _ = routed
    cached = [talloc(2 * MiB, 0) for _ in range(3)]
    assert all(cached)

    def empty_cache():
        calls.append(("empty_cache",))
        while cached:
            tfree(cached.pop(), 2 * MiB, 0)

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: 2 * MiB * len(cached), raising=False)
    _lib.lib.spw_torch_set_reclaim(_alloc._reclaim_cb)
    try:
        a._freeable = set()
        assert talloc(6 * MiB, 0) == 0  # the pool is not freeable yet: PyTorch would keep its cache
        assert len(cached) == 3 and ("empty_cache",) not in calls
        a._freeable = {0}
        p = talloc(6 * MiB, 0)
        assert p and cached == [] and calls[-1] == ("empty_cache",)
        assert _lib.lib.spw_torch_oom_pending(0) == 0
        assert talloc(4 * MiB, 0) == 0  # nothing cached any more: refused
    finally:
        _lib.lib.spw_torch_set_reclaim(_lib.RECLAIM_FN(0))
    tfree(p, 6 * MiB, 0)


def test_collect_cycles_the_routing_of_devices_whose_blocks_await_other_streams(routed):
    """Global mode: a device whose PyTorch counters show blocks awaiting other streams gets a fresh,
    anchored pool; its routing ends before PyTorch empties its cache (no capture underway then),
    and no device is left unrouted. Nothing happens when nothing awaits."""
    a, calls, _, awaiting = routed
    p, q = talloc(MiB, 0), talloc(MiB, 1)
    assert spt.collect() == 0 and calls == []
    spt.empty_cache()  # both pools anchored and freeable: (0, 1) and (0, 2)
    first = a._anchors[0]
    del calls[:]
    awaiting[0] = 64 * MiB
    assert spt.collect() == 64 * MiB
    assert calls == [("pool", (0, 101)), ("end", 0, (0, 1)), ("empty_cache",), ("begin", 0, (0, 101)),
                     ("anchor", 0), ("release", 0, (0, 101)), ("release", 0, (0, 101))]
    assert a._pools[0].id == (0, 101) and a._pools[1].id == (0, 2) and a._freeable == {0, 1}
    assert a._retired_anchors[0] is first  # the retired pool keeps its anchor until the next cycle
    assert "64.00 MiB of blocks used on other streams brought back by 1 routing cycles" in spt.memory_summary(0)
    gone = weakref.ref(first)
    del first, calls[:]
    awaiting[0] = MiB
    assert a.collect() == MiB
    gc.collect()
    assert gone() is None  # let go by the second cycle, before PyTorch empties its cache
    assert calls[:3] == [("pool", (0, 102)), ("end", 0, (0, 101)), ("empty_cache",)]
    tfree(p, MiB, 0)
    tfree(q, MiB, 1)


def test_a_cycle_releases_a_pool_that_had_no_anchor_and_routes_again_when_anchoring_fails(routed):
    a, calls, refuse, awaiting = routed
    p = talloc(MiB, 0)
    refuse["anchor"] = True
    awaiting[0] = 8 * MiB
    spt.empty_cache()  # the cycle empties PyTorch's cache once; no second call
    assert calls == [("pool", (0, 101)), ("end", 0, (0, 1)), ("release", 0, (0, 1)), ("release", 0, (0, 1)),
                     ("empty_cache",), ("begin", 0, (0, 101)), ("anchor", 0), ("anchor", 0)]
    assert a._freeable == set() and a._pools[0].id == (0, 101)  # routed, anchored at a later empty_cache
    tfree(p, MiB, 0)


def test_torch_cuda_empty_cache_is_spillways_while_global_mode_routes(routed, monkeypatch):
    a, calls, _, awaiting = routed
    monkeypatch.setattr(_alloc, "_empty_cache_hooked", False)
    monkeypatch.setattr(torch.cuda.memory, "empty_cache", torch.cuda.empty_cache)
    _alloc._install_empty_cache_hook()
    assert torch.cuda.memory.empty_cache is torch.cuda.empty_cache
    p = talloc(MiB, 0)
    awaiting[0] = 4 * MiB
    torch.cuda.empty_cache()
    assert ("end", 0, (0, 1)) in calls and calls.count(("empty_cache",)) == 1
    del calls[:]
    a.routed = False  # not routing: PyTorch's own
    torch.cuda.empty_cache()
    assert calls == [("empty_cache",)]
    tfree(p, MiB, 0)


def test_the_reclaim_hook_cycles_only_when_blocks_await_and_never_waits_for_the_lock(routed, monkeypatch):
    a, calls, _, awaiting = routed
    reserved = {"v": 64 * MiB}
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d=None: reserved["v"], raising=False)
    p = talloc(MiB, 0)
    spt.empty_cache()
    del calls[:]
    awaiting[0] = 32 * MiB
    held = threading.Event()
    done = threading.Event()

    def holder():
        with _alloc._lock:
            held.set()
            done.wait(5)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(5)
    assert _alloc._reclaim(0) == 0  # _lock is busy: PyTorch's empty_cache only, no cycle
    assert calls == [("empty_cache",)]
    done.set()
    t.join()
    del calls[:]
    awaiting[0] = 32 * MiB
    calls_before = _alloc._cycles["count"]
    _alloc._reclaim(0)
    assert _alloc._cycles["count"] == calls_before + 1 and ("end", 0, (0, 1)) in calls
    tfree(p, MiB, 0)


def test_without_cuda_auto_says_it_caps_nothing_and_weights_use_plan():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto picks it")
    with pytest.warns(RuntimeWarning, match="no CUDA device.*nothing they allocate is capped"):
        spt.use_allocator("24MiB", emu_capacity="256MiB")
    m = make_stack(dim=1000, depth=4).requires_grad_(False)
    off = spt.offload(m, backend="emu")  # no budget: the allocator's
    assert off.context is spt.context(0) and off.context.budget == 24 * MiB
    assert off.budget_source == "shared"
    assert "policy plan" in spt.memory_summary(0)
    off.remove()
