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
