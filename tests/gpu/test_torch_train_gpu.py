"""Training through spillway.torch.offload(model, budget, optimizer=opt) on a real GPU
(backend="cuda"). The reference is the same model resident on the device with the same
optimizer there (single-tensor path): forward and backward run the same kernels, so the first
step's loss and gradients are bitwise equal; the update runs on the host CPU against the
device's, so parameters are compared within 1e-5 of each tensor's largest element after each
step, and losses within 1e-4 relative. Skipped without CUDA.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \
        python -m pytest -q -s tests/gpu/test_torch_train_gpu.py
"""
from __future__ import annotations

import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from torch import nn  # noqa: E402

import spillway.torch as spt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from models import make_decoder, moved, offloaded_bytes  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
CUDA = dict(backend="cuda")
STEPS = 5


@pytest.fixture(autouse=True)
def _deterministic():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield


def batches(step: int, micro: int):
    g = torch.Generator().manual_seed(1000 + step)
    return [(torch.randint(0, 1024, (16, 64), generator=g).to(DEV),
             torch.randint(0, 1024, (16, 64), generator=g).to(DEV)) for _ in range(micro)]


def loss_of(model: nn.Module, batch, autocast: bool) -> torch.Tensor:
    ids, target = batch
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        logits, _ = model(ids)
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float(((a - b).abs() / b.abs().clamp_min(1e-30)).max())


def close_params(m: nn.Module, ref: nn.Module, tol: float) -> float:
    """The largest difference of each parameter from ref's, relative to ref's largest element
    (the host's and the device's AdamW round differently, and an element near zero would make
    an elementwise ratio of that rounding arbitrarily large)."""
    worst = 0.0
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        a, b = p.detach().double(), q.detach().double().cpu()
        r = float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
        worst = max(worst, r)
        assert r <= tol, (n, r)
    return worst


@pytest.mark.parametrize("case", ["adamw", "accum-clip-autocast", "c-adamw", "sgd"])
def test_train_offloaded_decoder_on_the_device(case):
    """A 14 MiB decoder (tied embedding and head) trained under an 8 MiB budget: weights,
    gradients' host copies, saved activations; every step moves the weights."""
    m = make_decoder(vocab=1024, dim=256, heads=4, layers=4).train()
    ref = copy.deepcopy(m).to(DEV)
    micro, clip, autocast = (4, 1.0, True) if case == "accum-clip-autocast" else (1, 0.0, False)

    def make_opt(mod):
        if case == "sgd":
            return torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9, foreach=False)
        return torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)

    opt, opt_ref = make_opt(m), make_opt(ref)
    off = spt.offload(m, budget="8MiB", optimizer=opt, host_update="spillway" if case == "c-adamw" else "torch",
                      **CUDA)
    assert off.context.backend == "cuda" and offloaded_bytes(off) > off.context.budget
    worst_loss = worst_param = 0.0
    for step in range(STEPS):
        for x in batches(step, micro):
            loss = moved(off, lambda: loss_of(m, x, autocast))
            want = loss_of(ref, x, autocast)
            if step == 0:  # same kernels, same weights: bitwise
                assert torch.equal(loss.cpu(), want.cpu()), (loss, want)
            worst_loss = max(worst_loss, rel(loss, want))
            loss.backward()
            want.backward()
        if step == 0:
            for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
                assert p.grad is not None and p.grad.device.type == "cpu", n
                assert torch.equal(p.grad, q.grad.cpu()), n
        if clip:
            n1 = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=clip)
            n2 = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=clip)
            assert rel(n1, n2) < 1e-5
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=True)
        opt_ref.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        worst_param = max(worst_param, close_params(m, ref, 1e-5))
    assert worst_loss < 1e-4
    h = off.stats()["offload"]
    assert h["optimizer_steps"] == STEPS
    if case == "c-adamw":
        assert off.c_steps == STEPS
    if case == "accum-clip-autocast" or case == "adamw":
        assert h["activations_stashed"] > 0
    print(f"\n{case}: worst loss rel {worst_loss:.2e}, worst param rel {worst_param:.2e}, "
          f"hook us median {off.hook_stats().get('hook_us_median')}")
    with torch.no_grad():
        ids = batches(9, 1)[0][0]
        a, b = m(ids)[0], ref(ids)[0]
        assert rel(a.float(), b.float()) < 1e-3
    off.remove()
    assert all(p.device.type == "cpu" for p in m.parameters())

