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
