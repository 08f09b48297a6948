"""torchrun --nproc_per_node 2 tests/gpu/ddp_train.py [case]: data-parallel training through
spillway.torch.offload(model, budget, optimizer=opt) on CUDA, one offload and one budget per
rank, against the same model resident under DistributedDataParallel whose optimizer runs on a
host master copy (as tests/gpu/test_torch_train_gpu.py's reference). NCCL when each rank has a
GPU of its own, else gloo (two ranks sharing one GPU; SPW_DDP_BACKEND overrides). Each rank's
batches differ; the ranks start from different weights, which the offload, as DDP, sets to
rank 0's.

Cases: "adamw" (torch's AdamW on the host for both; the head untied from the embedding): every
loss, averaged gradient and parameter bitwise equal to the reference at every step;
"c-adamw-on-device" (the tied decoder): spillway's C AdamW, a quarter of the trained bytes (the
tied embedding among them) trained on the device, within the tolerances of
test_torch_train_gpu.py; "adapters-ddp": low-rank adapters on the decoder's frozen, offloaded
weights, offloaded without optimizer= (the adapters stay on the device) and wrapped in
DistributedDataParallel itself (the offload hides its host copies from DDP), against the same
model resident under DDP: every loss and parameter bitwise equal. Each rank prints one line:
RESULT {json}."""
from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

import spillway.torch as spt

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from models import make_decoder, moved, offloaded_bytes, rel, step_pair, sync_reference  # noqa: E402

STEPS = 5


class Adapter(nn.Module):
    """x -> base(x) + x @ a @ b: a frozen Linear with a trainable low-rank adapter."""

    def __init__(self, base: nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(base.in_features, rank) * 0.05)
        self.b = nn.Parameter(torch.randn(rank, base.out_features) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.to(x.dtype) @ self.b.to(x.dtype)


def adapters(rank: int, world: int, backend: str, dev: torch.device) -> dict:
    m = make_decoder(seed=0, vocab=1024, dim=256, heads=4, layers=4).train().requires_grad_(False)
    torch.manual_seed(rank)  # adapters of their own per rank: DDP makes them rank 0's
    for parent in list(m.layers.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Adapter(child))
    assert any(p.requires_grad for p in m.parameters())
    ref = copy.deepcopy(m).to(dev)
    off = spt.offload(m, budget="4MiB", backend="cuda")
    ids = dict(device_ids=[dev.index]) if backend == "nccl" else {}
    ddp, ddp_ref = nn.parallel.DistributedDataParallel(m, **ids), nn.parallel.DistributedDataParallel(ref, **ids)
    opt, opt_ref = (torch.optim.AdamW([p for p in x.parameters() if p.requires_grad], lr=1e-3) for x in (m, ref))
    assert all(p.device == dev for p in m.parameters() if p.requires_grad)
    assert offloaded_bytes(off) > off.context.budget
    g = torch.Generator().manual_seed(1000 * rank)
    for step in range(STEPS):
        ids_ = torch.randint(0, 1024, (16, 64), generator=g).to(dev)
        target = torch.randint(0, 1024, (16, 64), generator=g).to(dev)
        loss = moved(off, lambda: nn.functional.cross_entropy(ddp(ids_)[0].float().flatten(0, 1), target.flatten()))
        want = nn.functional.cross_entropy(ddp_ref(ids_)[0].float().flatten(0, 1), target.flatten())
        assert torch.equal(loss, want), (step, loss, want)
        step_pair(loss, want, opt, opt_ref)
        for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            if p.requires_grad:
                assert torch.equal(p, q), (step, n)
    flat = torch.cat([p.detach().reshape(-1) for p in m.parameters() if p.requires_grad])
    first = flat.clone()
    dist.broadcast(first, 0)
    out = dict(same_as_rank0=bool(torch.equal(flat, first)), ranks=world,
               hidden=len(ddp.parameters_to_ignore),
               moved_per_step=int(off.context.stats()["bytes_h2d"]["total"] / max(off.steps, 1)),
               budget=off.context.budget)
    off.remove()
    return out


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "adamw"
    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    ndev = torch.cuda.device_count()
    backend = os.environ.get("SPW_DDP_BACKEND") or ("nccl" if ndev >= world else "gloo")
    dev = torch.device("cuda", rank % ndev)
    torch.cuda.set_device(dev)
    torch.backends.cuda.matmul.allow_tf32 = False
    dist.init_process_group(backend)
    if case == "adapters-ddp":
        res = adapters(rank, world, backend, dev)
        print("RESULT " + json.dumps(dict(case=case, rank=rank, backend=backend, device=str(dev), **res)), flush=True)
        assert res["same_as_rank0"]
        dist.destroy_process_group()
        return

    m = make_decoder(seed=rank, vocab=1024, dim=256, heads=4, layers=4).train()
    c_step = case.startswith("c-adamw")
    if not c_step:  # a weight used twice is averaged use by use, DDP averages its sum: equal to rounding
        m.lm_head.weight = nn.Parameter(m.embed.weight.detach().clone())
    ref = copy.deepcopy(m).to(dev)
    ddp = nn.parallel.DistributedDataParallel(ref, device_ids=[dev.index] if backend == "nccl" else None)
    master = copy.deepcopy(m)  # the reference's host copy, set to rank 0's weights below
    with torch.no_grad():
        for h, q in zip(master.parameters(), ref.parameters()):
            h.copy_(q)
    tol = 1e-4 if c_step else 0.0

    def make_opt(mod):
        return torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)

    opt, opt_ref = make_opt(m), make_opt(master)
    on_device = 0.25 if case == "c-adamw-on-device" else 0
    off = spt.offload(m, budget="26MiB" if on_device else "8MiB", optimizer=opt,
                      host_update="spillway" if c_step else "torch", train_on_device=on_device, backend="cuda")
    kept = {id(p) for _, p in off._trainable}
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.detach().cpu(), q.detach().cpu())  # both rank 0's
    assert offloaded_bytes(off) > off.context.budget
    g = torch.Generator().manual_seed(1000 * rank)
    worst = dict(loss=0.0, grad=0.0, param=0.0)
    for step in range(STEPS):
        ids = torch.randint(0, 1024, (16, 64), generator=g).to(dev)
        target = torch.randint(0, 1024, (16, 64), generator=g).to(dev)
        loss = moved(off, lambda: nn.functional.cross_entropy(m(ids)[0].float().flatten(0, 1), target.flatten()))
        want = nn.functional.cross_entropy(ddp(ids)[0].float().flatten(0, 1), target.flatten())
        if tol == 0 or step == 0:
            assert torch.equal(loss.cpu(), want.cpu()), (step, loss, want)
        worst["loss"] = max(worst["loss"], rel(loss, want))
        loss.backward()
        want.backward()
        for (n, p), (_, q), (_, h) in zip(m.named_parameters(), ref.named_parameters(), master.named_parameters()):
            r = rel(p.grad, q.grad)
            worst["grad"] = max(worst["grad"], r)
            if id(p) in kept:  # autograd's own accumulation on the device, in its own order
                assert r <= 1e-5, (step, n, r)
            elif tol == 0 or step == 0:
                assert torch.equal(p.grad.cpu(), q.grad.cpu()), (step, n, r)
            h.grad = q.grad.cpu()
        opt.step()
        opt_ref.step()
        sync_reference(ref, master, opt, opt_ref)
        off.synchronize()
        for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
            r = rel(p, q)
            worst["param"] = max(worst["param"], r)
            if tol == 0:
                assert torch.equal(p.detach().cpu(), q.detach().cpu()), (step, n, r)
            else:  # CUDA's AdamW against the reference's on the host: AdamW's first steps scale roundings up
                assert r <= (1e-3 if id(p) in kept else tol), (step, n, r)
    # every rank ends with the same weights
    flat = torch.cat([p.detach().reshape(-1).cpu() for p in m.parameters()]).to(dev)
    first = flat.clone()
    dist.broadcast(first, 0)
    same = bool(torch.equal(flat, first))
    s = off.stats()["offload"]
    moved_step = off.context.stats()["bytes_h2d"]["total"] / max(off.steps, 1)
    print("RESULT " + json.dumps(dict(case=case, rank=rank, backend=backend, device=str(dev), same_as_rank0=same,
                                      ranks=s["data_parallel_ranks"], reductions=s["gradient_reductions"],
                                      moved_per_step=int(moved_step), budget=off.context.budget,
                                      worst={k: float(f"{v:.3e}") for k, v in worst.items()})), flush=True)
    assert same and s["data_parallel_ranks"] == world
    off.remove()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
