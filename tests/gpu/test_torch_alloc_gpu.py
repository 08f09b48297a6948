"""spillway.torch.use_allocator on a real GPU, both modes against PyTorch's default allocator;
each scenario runs in its own process (tests/gpu/torch_alloc_cases.py: the routing is per process).

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \
        python -m pytest -q -s tests/gpu/test_torch_alloc_gpu.py
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
MODES = ("global", "pool")


def run(case: str, alloc: str, budget: str = "8GiB", timeout: int = 240) -> dict:
    p = subprocess.run([sys.executable, os.path.join(HERE, "torch_alloc_cases.py"), case, alloc, budget],
                       capture_output=True, text=True, timeout=timeout)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"{case} {alloc}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    out = json.loads(lines[-1][7:])
    print(f"\n{case} {alloc} {budget}: " + json.dumps({k: v for k, v in out.items() if k != "tokens"})[:1500])
    return out


@pytest.fixture(scope="module")
def default_train():
    return run("train", "default")


@pytest.mark.parametrize("mode", MODES)
def test_training_loss_equals_default(default_train, mode):
    got = run("train", mode, "4GiB")
    assert got["losses"] == default_train["losses"]
    assert got["spw_held_peak"] <= got["spw_budget"]
    if mode == "global":  # everything (backward too) came from spillway
        assert got["spw_held_peak"] > 0


@pytest.mark.parametrize("mode", MODES)
def test_oom_is_torch_out_of_memory_with_spillways_message(mode):
    got = run("oom", mode, "1GiB")
    assert got["is_torch_oom"] and got["is_spillway"], got
    for want in ("budget 1.00 GiB", "held", "live", "cached", "What would help", "PyTorch asked for 3.00 GiB"):
        assert want in got["message"], got["message"]
    assert got["after_sum"] == 2 * 64 * MiB / 4 + 1
    if mode == "global":
        assert got["backward_is_torch_oom"] and got["backward_has_message"], got
    assert got["spw_held_peak"] <= 1 << 30


@pytest.mark.parametrize("mode", MODES)
def test_record_stream(mode):
    assert run("record_stream", mode)["correct"]


def test_empty_cache():
    got = run("empty_cache", "global")
    assert got["before"] >= 1 << 30 and got["after"] < 64 * MiB


def test_stats_functions():
    got = run("stats", "global")
    assert got["alloc1"] >= 512 * MiB and got["peak1"] >= 512 * MiB
    assert got["peak2"] < 512 * MiB  # reset_peak_memory_stats
    assert got["held_peak"] <= got["budget"]
    assert got["torch_stats_ok"] and got["torch_summary_ok"] and got["summary_has"]


@pytest.mark.parametrize("mode", MODES)
def test_cudnn_benchmark(mode):
    ref = run("cudnn", "default")
    got = run("cudnn", mode, "8GiB")
    assert got["ok"], got.get("error")
    assert got["loss"] == ref["loss"]


@pytest.mark.parametrize("mode", MODES)
def test_torch_compile(mode):
    got = run("compile", mode, "8GiB", timeout=400)
    assert got["ok"], got.get("error")
    assert got["max_diff"] < 1e-4


def test_cuda_graphs():
    got = run("graph", "global")
    assert not got["captured"] and "mode='pool'" in got["error"] and got["seconds"] < 5
    got = run("graph", "pool")
    assert got["captured"] and got["value"] == 2.0  # outside the region: PyTorch's own
    assert "outside the `with` block" in got["inside"]


def test_shared_budget_with_offload_kv_cache_growth():
    pytest.importorskip("transformers")
    ref = run("offload_kv", "default")
    budget = 512  # MiB: the weights are ~318 MiB; the KV cache grows to ~264 MiB
    got = run("offload_kv", "global", f"{budget}MiB", timeout=400)
    assert "error" not in got, got.get("error")
    assert got["weights"] > 300 * MiB and got["budget"] == budget * MiB
    assert got["tokens"] == ref["tokens"]
    assert got["evictions"] > 0
    assert got["held_peak"] <= budget * MiB
