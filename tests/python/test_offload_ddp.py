"""Data-parallel training through spillway.torch.offload(model, budget, optimizer=opt): two
ranks (processes, gloo, the emu backend), each offloading its own copy, against the same
training resident under DistributedDataParallel. Without accumulation the parameters are
bitwise those of DistributedDataParallel (each rank's gradient times 1/2, summed, as its
reducer does); with accumulation and clipping the losses are within 1e-5 relative and the
weights within 1e-5 of their largest (DDP averages the accumulated gradient, the offload each
backward's: the same sum, rounded in another order). Also: the weights move every step, the
ranks start from rank 0's weights and buffers, wrapping the offloaded model in DistributedDataParallel is
a clear error, and bad process_group values are refused before anything moves. Adapters on an
offloaded frozen base (no optimizer=) train under DistributedDataParallel itself, bitwise."""
from __future__ import annotations

import contextlib
import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import spillway.errors
import spillway.torch as spt
from models import moved, step_pair

WORLD = 2
STEPS = 5


class Shift(nn.Module):
    """Adds a buffer (a non-trained tensor DistributedDataParallel broadcasts from rank 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.randn(512) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


def stack(seed: int) -> nn.Sequential:
    """8 Linear(512, 512)+Tanh layers, 8 MiB: twice the 4 MiB budget, after a Shift whose
    buffer differs by seed."""
    torch.manual_seed(seed)
    layers: list = [Shift()]
    for _ in range(8):
        layers += [nn.Linear(512, 512), nn.Tanh()]
    return nn.Sequential(*layers)


def batches(rank: int, step: int, micro: int):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return [torch.randn(4, 512, generator=g) for _ in range(micro)]


def adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)


def train_pair(rank: int, micro: int, clip: float, budget: str, no_sync: bool = False, **offload_args):
    """STEPS steps of the offloaded model and of a DDP-wrapped resident one, each rank starting
    from weights of its own (seeded by rank: the broadcast must make them rank 0's). no_sync:
    every micro-batch but the last of a step inside off.no_sync() / ddp.no_sync()."""
    m, ref = stack(rank), stack(rank)
    ddp = nn.parallel.DistributedDataParallel(ref)
    opt, opt_ref = adamw(m), adamw(ref)
    with torch.no_grad():  # as a setup under no_grad would: the device-trained parameters are still watched
        off = spt.offload(m, budget=budget, optimizer=opt, backend="emu", **offload_args)
    first = [p.detach().clone() for p in m.parameters()]
    out = dict(shift=m[0].shift.clone())
    losses = []
    for step in range(STEPS):
        for i, x in enumerate(batches(rank, step, micro)):
            last = i == micro - 1
            with contextlib.ExitStack() as scope:
                if no_sync and not last:
                    scope.enter_context(off.no_sync())
                    scope.enter_context(ddp.no_sync())
                loss = moved(off, lambda: m(x).square().mean())
                want = ddp(x).square().mean()
                losses.append((loss.item(), want.item()))
                loss.backward()
                want.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=clip)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=clip)
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    off.synchronize()
    out.update(first=first, params=[p.detach().clone() for p in m.parameters()],
               ref=[p.detach().clone() for p in ref.parameters()], losses=losses,
               stats=off.stats()["offload"], summary=off.summary())
    off.remove()
    return out


def wrapped(rank: int):
    """The offloaded model inside DistributedDataParallel: its forward raises ConfigError."""
    m = stack(0)
    off = spt.offload(m, budget="4MiB", optimizer=adamw(m), backend="emu")
    ddp = nn.parallel.DistributedDataParallel(m)
    try:
        ddp(batches(rank, 0, 1)[0])
        return None
    except spillway.errors.ConfigError as e:
        return str(e)
    finally:
        off.remove()


def not_averaged(rank: int):
    m = stack(rank)
    off = spt.offload(m, budget="4MiB", optimizer=adamw(m), backend="emu", process_group=None)
    m(batches(rank, 0, 1)[0]).square().mean().backward()
    out = dict(grad=m[1].weight.grad.clone(), stats=off.stats()["offload"])
    off.remove()
    return out


class Adapted(nn.Module):
    """A frozen Linear(512, 512) with a trainable low-rank adapter beside it (LoRA's shape)."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(512, 512).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(512, 8) * 0.05)
        self.b = nn.Parameter(torch.randn(8, 512) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + x @ self.a @ self.b)


def adapters(rank: int):
    """Adapters on an offloaded frozen base, under DistributedDataParallel (the adapters stay
    resident: DDP averages their gradients; the offload hides the base from DDP), against the
    same model resident under DDP."""
    torch.manual_seed(0)
    m = nn.Sequential(*[Adapted() for _ in range(8)])
    torch.manual_seed(rank)  # the adapters differ by rank: DDP's broadcast makes them rank 0's
    with torch.no_grad():
        for mod in m:
            mod.a.normal_(0, 0.05)
            mod.b.normal_(0, 0.05)
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="4MiB", backend="emu")
    ddp, ddp_ref = nn.parallel.DistributedDataParallel(m), nn.parallel.DistributedDataParallel(ref)
    hidden = sorted(ddp.parameters_to_ignore)
    opt, opt_ref = (torch.optim.AdamW([p for p in mod.parameters() if p.requires_grad], lr=1e-3) for mod in (m, ref))
    losses = []
    for step in range(STEPS):
        x = batches(rank, step, 1)[0]
        loss = moved(off, lambda: ddp(x).square().mean())
        want = ddp_ref(x).square().mean()
        losses.append((loss.item(), want.item()))
        step_pair(loss, want, opt, opt_ref)
    out = dict(hidden=hidden, losses=losses, params=[p.detach().clone() for p in m.parameters()],
               ref=[p.detach().clone() for p in ref.parameters()])
    off.remove()
    out["after_remove"] = hasattr(m, "_ddp_params_and_buffers_to_ignore")
    return out


def worker(rank: int, init: str, out_dir: str) -> None:
    result = {}
    try:
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
        result["exact"] = train_pair(rank, 1, 0.0, "10MiB", train_on_device=0.15)
        result["accumulate"] = train_pair(rank, 2, 1.0, "4MiB", train_on_device=0)
        result["no_sync"] = train_pair(rank, 2, 0.0, "10MiB", no_sync=True, train_on_device=0.15)
        result["synced"] = train_pair(rank, 2, 0.0, "10MiB", train_on_device=0.15)
        result["wrapped"] = wrapped(rank)
        result["none"] = not_averaged(rank)
        result["adapters"] = adapters(rank)
        dist.destroy_process_group()
    except BaseException:
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("ddp")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, f"file://{d}/store", str(d))) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0, p.exitcode
    out = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]
    for r, res in enumerate(out):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return out


def assert_as_ddp(run, rank0) -> None:
    """A rank's run bitwise equal to DDP's over the resident copy (every loss, the parameters
    after the last step) and to rank 0's parameters."""
    for loss, want in run["losses"]:
        assert loss == want
    for a, b in zip(run["params"], run["ref"]):
        assert torch.equal(a, b)
    for a, b in zip(run["params"], rank0["params"]):
        assert torch.equal(a, b)


def test_bitwise_equal_to_ddp(ranks):
    for r, res in enumerate(ranks):
        e = res["exact"]
        for a, b in zip(e["first"], ranks[0]["exact"]["first"]):  # rank 0's weights everywhere
            assert torch.equal(a, b)
        assert torch.equal(e["shift"], ranks[0]["exact"]["shift"])  # and rank 0's buffers
        assert stack(1)[1].weight.ne(stack(0)[1].weight).any()  # they were not to begin with
        assert stack(1)[0].shift.ne(stack(0)[0].shift).any()
        assert_as_ddp(e, ranks[0]["exact"])
        for a, b in zip(e["params"], e["first"]):
            assert not torch.equal(a, b)
        s = e["stats"]
        assert s["data_parallel_ranks"] == WORLD
        assert s["resident_trainable_bytes"] > 0  # both paths: offloaded and trained on the device
        # one collective per offloaded gradient, one per backward for those trained on the device
        assert s["gradient_reductions"] > STEPS
        assert "gradients averaged over 2 ranks (gloo" in e["summary"]


def test_accumulation_and_clipping_within_tolerance(ranks):
    for res in ranks:
        e = res["accumulate"]
        for loss, want in e["losses"]:
            assert abs(loss - want) <= 1e-5 * abs(want)
        for a, b in zip(e["params"], e["ref"]):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        for a, b in zip(e["params"], ranks[0]["accumulate"]["params"]):
            assert torch.equal(a, b)


def test_no_sync_accumulates_as_ddp(ranks):
    """off.no_sync() beside ddp.no_sync() over two micro-batches a step: the parameters trained on
    the device get DDP's arithmetic (their accumulated gradient averaged once, by the last
    backward), the offloaded ones the same numbers to rounding (averaged every backward), so
    the losses and weights stay within the accumulation's tolerance; fewer collectives than
    the same run without no_sync()."""
    for res in ranks:
        e, d = res["no_sync"], res["synced"]
        for loss, want in e["losses"]:
            assert abs(loss - want) <= 1e-5 * abs(want)
        on_device = e["stats"]["resident_trainable_bytes"] > 0
        assert on_device
        for a, b in zip(e["params"], e["ref"]):
            assert (a - b).abs().max() <= 1e-5 * b.abs().max()
        for a, b in zip(e["params"], ranks[0]["no_sync"]["params"]):
            assert torch.equal(a, b)
        # one collective a step for the device-trained gradients instead of one a backward
        assert d["stats"]["gradient_reductions"] - e["stats"]["gradient_reductions"] == STEPS


def test_no_sync_without_ranks_changes_nothing():
    m, ref = stack(0), stack(0)
    opt = adamw(m)
    off = spt.offload(m, budget="4MiB", optimizer=opt, backend="emu")
    x = batches(0, 0, 1)[0]
    with off.no_sync():
        m(x).square().mean().backward()
    ref(x).square().mean().backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(m.parameters(), ref.parameters()))
    off.remove()
    with pytest.raises(spillway.errors.StateError, match="removed"):
        with off.no_sync():
            pass


def test_wrapping_in_ddp_is_an_error(ranks):
    for res in ranks:
        assert res["wrapped"] is not None and "DistributedDataParallel" in res["wrapped"]
        assert "call the offloaded model directly" in res["wrapped"]


def test_process_group_none_averages_nothing(ranks):
    assert ranks[0]["none"]["stats"]["data_parallel_ranks"] == 1
    assert not torch.equal(ranks[0]["none"]["grad"], ranks[1]["none"]["grad"])


@pytest.mark.parametrize("bad", ["world", 3, object()])
def test_bad_process_group_changes_nothing(bad):
    m = stack(0)
    before = [(p, p.data_ptr()) for p in m.parameters()]
    with pytest.raises(spillway.errors.ConfigError, match="process_group"):
        spt.offload(m, budget="4MiB", optimizer=adamw(m), backend="emu", process_group=bad)
    assert all(p.data_ptr() == ptr and p.device.type == "cpu" for p, ptr in before)
    assert "forward" not in m.__dict__


def test_ddp_wraps_adapters_on_an_offloaded_base(ranks):
    for res in ranks:
        a = res["adapters"]
        assert a["hidden"] == sorted(f"{i}.base.{w}" for i in range(8) for w in ("weight", "bias"))
        assert_as_ddp(a, ranks[0]["adapters"])
        assert not a["after_remove"]
