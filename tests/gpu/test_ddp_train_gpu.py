"""Data-parallel training through spillway.torch.offload on CUDA: tests/gpu/ddp_train.py under
torchrun with two ranks (NCCL on two GPUs, gloo when they share one), each case checked rank by
rank against DistributedDataParallel there (and, for adapters on an offloaded base, under it);
here, that both ranks finished, averaged over two ranks, moved their weights every step and
ended with the same weights. Skipped without CUDA.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \
        python -m pytest -q -s tests/gpu/test_ddp_train_gpu.py
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

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_train.py")


@pytest.mark.parametrize("case", ["adamw", "c-adamw-on-device", "adapters-ddp"])
def test_ddp_train(case):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        SCRIPT, case], capture_output=True, text=True, timeout=600)
    results = [json.loads(line.split("RESULT ", 1)[1]) for line in r.stdout.splitlines() if "RESULT " in line]
    assert r.returncode == 0 and len(results) == 2, r.stdout[-4000:] + r.stderr[-4000:]
    for res in results:
        print(f"\n{case}: {res}")
        assert res["same_as_rank0"] and res["ranks"] == 2
        # averaged by the offload, or (adapters) by DDP with the offloaded host copies hidden from it
        assert res["reductions"] > 0 if case != "adapters-ddp" else res["hidden"] > 0
        assert res["moved_per_step"] > 0
