"""bench/peers/torch_alloc.py --smoke: the script's child processes, the default allocator's repeat
and the markdown table, on the CPU with tiny models (the H200 run is the measurement)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_smoke_runs_resnet_twice_from_one_seed_and_prints_the_table(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers", "torch_alloc.py"), "--smoke",
                        "--workloads", "resnet", "--json", str(out)], capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    (row,) = r["rows"]
    assert row["ok"] and row["equal"] and row["repeat_equal"] is True and row["repeat_steps"] == 3, row
    assert row["step_s"] > 0
    assert "| ResNet-50 training, batch 128 | default | repeats True over 3 steps |" in p.stdout, p.stdout


def _bench_module():
    sys.path.insert(0, os.path.join(ROOT, "bench", "peers"))
    try:
        import torch_alloc
    finally:
        sys.path.pop(0)
    return torch_alloc


def test_step_times_compare_step_by_step_and_over_rounds():
    t = _bench_module()
    ref = {"ok": True, "losses": [1.0], "step_s": 2.0, "step_ms": [9.0, 1.0, 2.0, 3.0], "warmup_steps": 1}
    # slower on the short steps, faster on the long one: median step ratio 1.0, paired 1.5, total 1.0
    got = {"ok": True, "losses": [1.0], "step_s": 2.0, "step_ms": [50.0, 1.5, 3.0, 1.5], "warmup_steps": 1}
    p = t.paired(got, ref)
    assert p["paired_ratio"] == 1.5 and p["total_ratio"] == 1.0
    assert t.paired(ref, ref) == {}  # the default against itself: nothing to compare
    assert t.paired(dict(got, step_ms=[1.0, 2.0]), ref) == {}  # runs of other lengths do not pair
    slow = dict(got, step_s=3.0, step_ms=[50.0, 3.0, 6.0, 9.0])
    rounds = [{"default": ref, "global": got}, {"default": ref, "global": slow}, {"default": ref, "global": got}]
    r = t.over_rounds(rounds, "global")
    assert [x["median"] for x in r["rounds"]] == [1.0, 1.5, 1.0]
    assert r["rounds_median"] == 1.0 and r["paired_ratio"] == 1.5 and r["equal"] is True
    rounds[1]["global"] = dict(slow, losses=[2.0])  # one round that differs makes the row unequal
    assert t.over_rounds(rounds, "global")["equal"] is False


def test_interleave_alternates_allocators_in_one_process_and_compares_with_its_own_default_steps(tmp_path):
    out = tmp_path / "r.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "peers", "torch_alloc.py"), "--smoke",
                        "--workloads", "resnet", "--allocators", "default,interleave", "--json", str(out)],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = {r["allocator"]: r for r in json.loads(out.read_text())["rows"]}
    x = rows["interleave"]
    assert x["ok"] and x["equal"], x  # the same losses as the default process's, step for step
    assert x["inter_pairs"] == 2 and x["inter_ratio"] > 0 and x["inter_paired"] > 0
    assert x["default_step_s"] == x["inter_default_step_s"]  # its own default steps are the reference


def test_interleaved_figures_pair_neighbouring_steps():
    t = _bench_module()
    # steps: default, spillway, spillway, default: pairs (1, 2) and (4, 3) -> ratios 2.0 and 0.75
    got = t.interleaved([1.0, 2.0, 3.0, 4.0], [False, True, True, False], 1)
    assert got["inter_pairs"] == 2 and got["inter_paired"] == (2.0 + 0.75) / 2
    assert got["step_s"] == 2.5 and got["inter_default_step_s"] == 2.5 and got["inter_ratio"] == 1.0
