"""torch.compile and an offloaded model, on a real GPU: the three ways users combine them
(`torch.compile(model)` after `offload(model)`, `offload()` of a module torch.compile returned,
`model.compile()` in place after `offload(model)`), each against the same compiled model fully
resident: outputs equal over several forwards, the weights moving in each, no recompilation
after the first forwards (the offload points the modules at other device tensors every forward,
which must not be a new guard each time). And training under compile: adapters through an
offloaded frozen base, and a model trained through offload(..., optimizer=opt) with torch's
AdamW and with the C one on the host. Skipped without CUDA or torch.compile.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \\
        python -m pytest -q -s tests/gpu/test_compile_gpu.py
"""
from __future__ import annotations

import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if not hasattr(torch, "compile"):
    pytest.skip("needs torch.compile (torch 2.0 or later)", allow_module_level=True)

import spillway.torch as spt  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from models import frozen, make_decoder, moved, rel, sync_reference  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
FORWARDS = 6


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pair():
    """A decoder (about 19 MiB of fp32 weights in 6 layers) and a resident copy of it."""
    m = frozen(make_decoder(dim=256, heads=4, layers=6, vocab=512)).eval()
    return m, copy.deepcopy(m).to(DEV)


def _ids(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 512, (2, 16), generator=g).to(DEV)


def _frames() -> int:
    from torch._dynamo.utils import counters
    return counters["stats"].get("unique_graphs", 0)


def _check(run, ref_run, off) -> None:
    with torch.no_grad():
        for i in range(2):  # the first forwards compile
            moved(off, lambda i=i: run(_ids(i)))
        graphs = _frames()
        for i in range(FORWARDS):
            x = _ids(10 + i)
            out = moved(off, lambda x=x: run(x))
            ref = ref_run(x)
            torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
        assert _frames() == graphs, f"recompiled in the steady state: {graphs} graphs, then {_frames()}"


def test_compile_after_offload():
    m, ref = _pair()
    off = spt.offload(m, budget="8MiB", backend="cuda")
    try:
        _check(torch.compile(m), torch.compile(ref), off)
    finally:
        off.remove()


def test_offload_of_a_compiled_module():
    m, ref = _pair()
    cm = torch.compile(m)
    off = spt.offload(cm, budget="8MiB", backend="cuda")
    try:
        _check(cm, torch.compile(ref), off)
    finally:
        off.remove()


def test_compile_in_place_after_offload():
    m, ref = _pair()
    if not hasattr(m, "compile"):
        pytest.skip("nn.Module.compile needs torch 2.2 or later")
    off = spt.offload(m, budget="8MiB", backend="cuda")
    try:
        m.compile()
        ref.compile()
        _check(m, ref, off)
    finally:
        off.remove()


_FRESH = r"""
import copy, sys, torch
sys.path.insert(0, sys.argv[1])
from models import frozen, make_decoder, moved
import spillway.torch as spt
from spillway.torch import _compile
dev = torch.device("cuda")
loaded = "torch._dynamo" in sys.modules
m = frozen(make_decoder(dim=256, heads=4, layers=6, vocab=512)).eval()
ref = copy.deepcopy(m).to(dev)
off = spt.offload(m, budget="8MiB", backend="cuda")
waiting = _compile._finder is not None
cm, cref = torch.compile(m), torch.compile(ref)  # compiled against compiled: eager rounds otherwise
with torch.no_grad():
    for i in range(4):
        x = torch.randint(0, 512, (2, 16), device=dev)
        out = moved(off, lambda: cm(x))
        torch.testing.assert_close(out[0], cref(x)[0], rtol=1e-5, atol=1e-5)
off.remove()
print("RESULT", loaded, waiting, _compile._finder is None)
"""


def test_compile_in_a_process_that_had_not_loaded_dynamo():
    """offload() before anything imported Dynamo: the mark waits for torch.compile's import of
    it (no Dynamo import by offload() itself), and the compiled forwards run and match."""
    import subprocess
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python")
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", _FRESH, here], capture_output=True, text=True,
                       timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT"))
    loaded, waiting, removed = line.split()[1:]
    print(f"\n  Dynamo loaded before offload(): {loaded}; the finder waited: {waiting}; then left: {removed}")
    assert removed == "True" and (loaded == "True" or waiting == "True")


class _AdaptedBlock(torch.nn.Module):
    """A frozen Linear(1024, 1024) (4 MiB) with a trainable rank-8 adapter beside it: the
    adapters of earlier blocks get their gradients through the frozen weights of later ones."""

    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Linear(1024, 1024).requires_grad_(False)
        self.a = torch.nn.Linear(1024, 8, bias=False)
        self.b = torch.nn.Linear(8, 1024, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.b(self.a(x)))


class _Adapted(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(_AdaptedBlock() for _ in range(8))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_compiled_training_of_adapters_on_an_offloaded_base():
    """Gradients through offloaded frozen weights under torch.compile: adapters trained beside
    a base offloaded at 10 MiB of 32, compiled, against the same compiled model resident, over
    three steps (gradients and adapters within compile's tolerance, the base moving each step)."""
    m = _Adapted().to(DEV)
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="10MiB", offload_trainable=False, backend="cuda")
    try:
        cm, cref = torch.compile(m), torch.compile(ref)
        trained = [p for p in m.parameters() if p.requires_grad]
        ref_trained = [p for p in ref.parameters() if p.requires_grad]
        assert len(trained) == 16
        for step in range(3):
            x = torch.randn(32, 1024, device=DEV, generator=torch.Generator(DEV).manual_seed(step))
            moved(off, lambda: cm(x).square().mean().backward())
            cref(x).square().mean().backward()
            for p, q in zip(trained, ref_trained):
                torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6)
            with torch.no_grad():
                for p, q in zip(trained, ref_trained):
                    p -= 0.1 * p.grad
                    q -= 0.1 * q.grad
                    p.grad = q.grad = None
    finally:
        off.remove()


@pytest.mark.parametrize("host_update", ["torch", "spillway"])
def test_compiled_training_through_the_offload(host_update):
    """offload(model, budget, optimizer=opt) under torch.compile: a 14 MiB decoder (tied
    embedding and head) trained at an 8 MiB budget (its first parameters trained on the device,
    the rest on the host), compiled, four AdamW steps, against the same compiled model resident
    whose AdamW runs on a host master copy (as the offload's does): losses within 1e-4 of the
    reference's, the first step's gradients too and its update element by element nearly
    everywhere (the two compile different graphs: the offload's hooks are graph boundaries),
    later steps' within what those roundings make of them; the weights moving in every step,
    no graph compiled after the second."""
    m = make_decoder(vocab=1024, dim=256, heads=4, layers=4).train()
    ref = copy.deepcopy(m).to(DEV)
    master = copy.deepcopy(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    opt_ref = torch.optim.AdamW(master.parameters(), lr=1e-3, weight_decay=0.1, foreach=False)
    off = spt.offload(m, budget="8MiB", optimizer=opt, host_update=host_update, backend="cuda")
    kept = {id(p) for _, p in off._trainable}  # trained on the device (train_on_device's default)
    try:
        cm, cref = torch.compile(m), torch.compile(ref)

        def loss_of(model, step):
            g = torch.Generator().manual_seed(1000 + step)
            ids, target = (torch.randint(0, 1024, (16, 64), generator=g).to(DEV) for _ in range(2))
            logits, _ = model(ids)
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), target.flatten())

        graphs = None
        for step in range(4):
            loss = moved(off, lambda: loss_of(cm, step))
            want = loss_of(cref, step)
            assert rel(loss, want) <= 1e-4, (step, float(loss), float(want))
            loss.backward()
            want.backward()
            for (n, p), (_, q), (_, h) in zip(m.named_parameters(), ref.named_parameters(),
                                              master.named_parameters()):
                assert p.grad is not None and p.grad.device.type == ("cuda" if id(p) in kept else "cpu"), n
                # from the second step on, the parameters differ by the first step's roundings
                assert rel(p.grad, q.grad) <= (1e-4 if step == 0 else 1e-3), (step, n, rel(p.grad, q.grad))
                h.grad = q.grad.cpu()
            before = [p.detach().cpu().clone() for p in m.parameters()]
            before_ref = [q.detach().cpu().clone() for q in ref.parameters()]
            opt.step()
            opt_ref.step()
            sync_reference(ref, master, opt, opt_ref)
            torch.cuda.synchronize()
            off.synchronize()
            # The updates, not the parameters: the gradients differ at rounding level, and AdamW's
            # first steps turn a gradient near zero into a whole step of lr of either sign; the
            # updates agree as a whole and element by element nearly everywhere.
            for (n, p), (_, q), a, b in zip(m.named_parameters(), ref.named_parameters(), before, before_ref):
                du, dr = p.detach().cpu() - a, q.detach().cpu() - b
                assert float((du - dr).norm() / dr.norm()) <= 0.05, (step, n)
                assert step or float(((du - dr).abs() > 1e-5).float().mean()) <= 0.01, n
            if step == 1:
                graphs = _frames()
        assert _frames() == graphs, "a graph compiled after the first two steps"
        assert off.stats()["offload"]["optimizer_steps"] == 4
    finally:
        off.remove()
    assert all(p.device.type == "cpu" for p in m.parameters())
