"""spillway.torch.use_allocator on a real GPU, both modes against PyTorch's default allocator.
The routing is per process: tests/gpu/torch_alloc_cases.py runs several scenarios in one process
per (allocator, budget), and the processes run at the same time (each holds at most its budget,
the default one a few GiB), so the file takes about as long as its slowest process.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \
        python -m pytest -q -s tests/gpu/test_torch_alloc_gpu.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
GiB = 1 << 30
MODES = ("global", "pool")
KV_BUDGET_MIB = 512  # the weights are ~318 MiB; the KV cache grows to ~264 MiB
HAVE_TRANSFORMERS = True
try:
    import transformers  # noqa: F401
except ImportError:
    HAVE_TRANSFORMERS = False

# (allocator, budget, cases): one process each; the order of the cases is the order they run in
# (oom late: a failure there leaves the earlier results intact). In global mode record_stream runs
# early: the blocks it used on a side stream must be back (collect's routing cycle) for the cases
# after it, which each start from the whole budget.
PROCESSES = {
    "default": ("default", "0", ["train", "cudnn"] + (["offload_kv"] if HAVE_TRANSFORMERS else [])),
    "global": ("global", "1GiB", ["train", "record_stream", "stats", "empty_cache", "cudnn", "compile", "oom",
                                  "graph"]),
    "pool": ("pool", "1GiB", ["train", "record_stream", "empty_cache", "cudnn", "compile", "oom", "graph"]),
}
if HAVE_TRANSFORMERS:
    PROCESSES["kv"] = ("global", f"{KV_BUDGET_MIB}MiB", ["offload_kv"])


@pytest.fixture(scope="module")
def results():
    """Start every process at once, wait for all; {name: {case: result}}."""
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    procs = {}
    t0 = time.perf_counter()
    for name, (alloc, budget, cases) in PROCESSES.items():
        procs[name] = subprocess.Popen([sys.executable, os.path.join(HERE, "torch_alloc_cases.py"), alloc, budget,
                                        ",".join(cases)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                       env=env)
    out = {}
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(1, 140 - (time.perf_counter() - t0)))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
            stderr += "\n(killed: over the time limit)"
        got = {}
        for ln in stdout.splitlines():
            if ln.startswith("RESULT "):
                r = json.loads(ln[7:])
                got[r.pop("case")] = r
        got["_rc"], got["_stderr"] = p.returncode, stderr[-3000:]
        print(f"\n{name}: rc {p.returncode}, {time.perf_counter() - t0:.0f} s; "
              + " | ".join(ln for ln in stderr.splitlines() if ln.startswith("case ")))
        for case, r in got.items():
            if not case.startswith("_"):
                print(f"  {case} {name}: " + json.dumps({k: v for k, v in r.items() if k != "tokens"})[:1200])
        out[name] = got
    return out


def case(results, name: str, which: str) -> dict:
    got = results[name]
    assert which in got, f"{name}/{which} did not report (rc {got['_rc']}):\n{got['_stderr']}"
    r = got[which]
    assert "crash" not in r, f"{name}/{which}: {r['crash']}"
    return r


@pytest.mark.parametrize("mode", MODES)
def test_training_loss_equals_default(results, mode):
    got, ref = case(results, mode, "train"), case(results, "default", "train")
    assert got["losses"] == ref["losses"]
    assert got["spw_held_peak"] <= got["spw_budget"] == GiB
    if mode == "global":  # everything (backward too) came from spillway
        assert got["spw_held_peak"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_oom_is_torch_out_of_memory_with_spillways_message_and_usable_after(results, mode):
    got = case(results, mode, "oom")
    assert got["is_torch_oom"] and got["is_spillway"], got
    for want in ("budget 1.00 GiB", "held", "live", "cached", "What would help", "PyTorch asked for 3.00 GiB"):
        assert want in got["message"], got["message"]
    assert got["after_sum"] == 2 * 64 * MiB / 4 + 1
    if mode == "global":
        assert got["backward_is_torch_oom"] and got["backward_has_message"], got
    assert got["spw_held_peak"] <= GiB


@pytest.mark.parametrize("mode", MODES)
def test_record_stream(results, mode):
    assert case(results, mode, "record_stream")["correct"]


def test_blocks_used_on_another_stream_come_back_in_global_mode(results):
    """Under global routing PyTorch defers the end of life of the blocks used on the side stream;
    collect() cycles the routing: they go back to spillway, PyTorch's counters and spillway's agree
    across the pools before and after, and a second round reuses the memory instead of adding to it."""
    got = case(results, "global", "record_stream")
    r1, a1, r2, a2 = got["round1"], got["after1"], got["round2"], got["after2"]
    assert got["correct"] and got["correct2"]
    assert r1["awaiting"] >= 5 * 64 * MiB, got  # the leak as it was: five x blocks deferred
    assert got["collected1"] == r1["awaiting"] and got["collected2"] == r2["awaiting"] >= 5 * 64 * MiB, got
    assert a1["awaiting"] == 0 and a2["awaiting"] == 0, got
    assert r1["torch_reserved"] - a1["torch_reserved"] >= 5 * 64 * MiB, got
    assert r1["spw_live"] - a1["spw_live"] >= 5 * 64 * MiB, got
    # PyTorch's reserved bytes are the segments spillway handed out, over every pool of the device
    for c in (r1, a1, r2, a2):
        assert c["torch_reserved"] - c["spw_requested"] == r1["torch_reserved"] - r1["spw_requested"], got
    # round 2 reused what round 1 gave back (another 5 x 64 MiB held would be the leak again)
    assert r2["spw_held"] <= r1["spw_held"] + 64 * MiB, got
    assert abs(a2["spw_live"] - a1["spw_live"]) <= 4 * MiB, got  # nothing accumulates cycle after cycle
    assert got["collect_idle"] == 0
    assert got["spw_held_peak"] <= GiB
    assert got["cycles"] == 2 and got["summary_line"] and "routing cycles" in got["summary_line"][0], got


@pytest.mark.parametrize("mode", MODES)
def test_empty_cache_gives_pytorchs_cached_blocks_back(results, mode):
    got = case(results, mode, "empty_cache")
    # the 512 MiB freed before empty_cache went back (segments earlier cases in this process left
    # partly in use stay, as they would with PyTorch's own allocator)
    assert got["before"] - got["after"] >= 512 * MiB, got
    assert got["torch_after"] < got["torch_before"], got


def test_stats_functions(results):
    got = case(results, "global", "stats")
    assert got["alloc1"] >= 512 * MiB and got["peak1"] >= 512 * MiB
    assert got["peak2"] < 512 * MiB  # reset_peak_memory_stats: only what was allocated since
    assert got["held_peak"] <= got["budget"]
    assert got["torch_stats_ok"] and got["torch_summary_ok"] and got["summary_has"]


@pytest.mark.parametrize("mode", MODES)
def test_cudnn_benchmark(results, mode):
    got, ref = case(results, mode, "cudnn"), case(results, "default", "cudnn")
    assert got["ok"], got.get("error")
    assert got["loss"] == ref["loss"]


@pytest.mark.parametrize("mode", MODES)
def test_torch_compile(results, mode):
    got = case(results, mode, "compile")
    assert got["ok"], got.get("error")
    assert got["max_diff"] < 1e-4


def test_cuda_graphs(results):
    got = case(results, "global", "graph")
    assert not got["captured"] and "mode='pool'" in got["error"] and got["seconds"] < 5
    got = case(results, "pool", "graph")
    assert got["captured"] and got["value"] == 2.0  # outside the region: PyTorch's own
    assert "outside the `with` block" in got["inside"]


@pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="needs transformers")
def test_shared_budget_with_offload_kv_cache_growth(results):
    ref, got = case(results, "default", "offload_kv"), case(results, "kv", "offload_kv")
    assert "error" not in got, got.get("error")
    assert got["weights"] > 300 * MiB and got["budget"] == KV_BUDGET_MIB * MiB
    assert got["tokens"] == ref["tokens"]
    assert got["evictions"] > 0
    assert got["held_peak"] <= KV_BUDGET_MIB * MiB
