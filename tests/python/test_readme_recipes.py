"""The README's recipe "My model does not fit my GPU", first block, run as written on a small
model (emu backend, CPU torch): the offloaded model's output equals the resident one's and the
summary it prints reports what moved."""
import contextlib
import copy
import io
import os
import re

import torch
from torch import nn

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def recipe_block(title: str) -> str:
    text = open(README, encoding="utf-8").read()
    start = text.index(f"### {title}\n")
    m = re.search(r"```python\n(.*?)\n```", text[start:], re.S)
    assert m, f"no python block under {title!r}"
    return m.group(1)


def test_offload_recipe_runs_as_written():
    code = recipe_block("My model does not fit my GPU")
    assert "spillway.torch.offload(model" in code
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).eval()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 512)
    out = io.StringIO()
    scope = {"model": model}
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), scope)
    off = scope["off"]
    try:
        with torch.no_grad():
            assert torch.equal(model(x), ref(x))
        assert "moved per step" in out.getvalue(), out.getvalue()
        assert off.stats()["bytes_h2d"]["total"] > 0
    finally:
        off.remove()


def test_training_recipe_runs_as_written():
    """The recipe "Train a model that does not fit", first block, run as written but for its
    budget (scaled with the test model, so that the weights cannot all stay): three steps of
    the user's own loop equal, bitwise, to the same loop on a resident copy (AdamW's single-tensor
    step, which spillway's C step matches on torch 1.13), the weights trained on the host
    uploaded again by every forward."""
    code = recipe_block("Train a model that does not fit: weights, gradients, optimizer state")
    assert "optimizer=opt" in code and '"5GiB"' in code
    code = code.replace('"5GiB"', '"4MiB"')  # the budget scaled with the model: 8 MiB of weights
    import spillway.torch

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])
    ref = copy.deepcopy(model)
    scope = {"model": model, "torch": torch, "spillway": spillway}
    exec(compile(code, "README.md", "exec"), scope)
    off, opt = scope["off"], scope["opt"]
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=2e-5)
    try:
        h2d = lambda: off.context.stats()["bytes_h2d"]["total"]  # noqa: E731
        trained = sum(u.nbytes for u in off.units if u.trains)
        assert trained > 0
        for step in range(3):
            x = torch.randn(4, 512, generator=torch.Generator().manual_seed(step))
            before = h2d()
            loss, want = model(x).square().mean(), ref(x).square().mean()
            assert torch.equal(loss, want)
            for lo, o in ((loss, opt), (want, opt_ref)):
                lo.backward()
                o.step()
                o.zero_grad()
            assert h2d() - before >= trained  # the step's new weights went up to the device
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
        assert off.stats()["offload"]["optimizer_steps"] == 3
    finally:
        off.remove()
