"""torchrun --nproc_per_node 2 tests/gpu/ddp_alloc.py: DDP training with spillway.torch.use_allocator
in each rank and a different budget per device (SPW_DDP_BUDGETS, default "0:6GiB;1:3GiB"). Each rank
prints one RESULT line: its budget, peak held, the final loss, a parameter checksum (equal across
ranks), whether an allocation past its own budget raised torch.OutOfMemoryError, and the bytes of
blocks NCCL's streams used that spillway.torch.collect() brought back after each step (0 when NCCL
records no stream) with what still awaited at the end (0)."""
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import spillway.torch as spt

rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(rank)
budgets = os.environ.get("SPW_DDP_BUDGETS", "0:6GiB;1:3GiB")
alloc = spt.use_allocator(budget=budgets, mode="global")
dist.init_process_group("nccl")
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(2048, 8192), nn.GELU(), nn.Linear(8192, 2048)).cuda()
ddp = nn.parallel.DistributedDataParallel(m, device_ids=[rank])
opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
g = torch.Generator(device="cuda").manual_seed(100 + rank)
collected = 0
for step in range(20):
    x = torch.randn(512, 2048, device="cuda", generator=g)
    loss = ddp(x).pow(2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    collected += spt.collect()
st = torch.cuda.memory_stats()
awaiting_end = st["active_bytes.all.current"] - st["allocated_bytes.all.current"]
checksum = float(sum(p.double().sum().item() for p in m.parameters()))
s = spt.memory_stats()
try:
    torch.empty(s["budget"] + (1 << 30), dtype=torch.uint8, device="cuda")
    refused = None
except torch.OutOfMemoryError as e:
    refused = "budget" in str(e) and isinstance(e, spt.OutOfMemoryError)
dist.barrier()
print("RESULT " + json.dumps(dict(rank=rank, budget=s["budget"], held_peak=s["held.peak"], loss=loss.item(),
                                  checksum=checksum, refused_past_budget=refused, collected=collected,
                                  awaiting_end=awaiting_end)), flush=True)
dist.destroy_process_group()
