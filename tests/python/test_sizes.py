"""One size grammar: the rows of tests/data/sizes.txt through the Python package give what
tests/test_sizes.c gets through the CLI, SPILLWAY_CONF and the interposer (same table)."""
from __future__ import annotations

from pathlib import Path
from typing import List, Tuple, Union

import pytest

import spillway
from spillway.core import parse_budget
from spillway.torch import _budget

TABLE = Path(__file__).resolve().parents[1] / "data" / "sizes.txt"


def _rows() -> List[Tuple[int, str, str]]:
    rows = []
    for n, line in enumerate(TABLE.read_text().splitlines(), 1):
        if not line.startswith('"'):
            continue
        close = line.index('"', 1)
        rows.append((n, line[1:close], line[close + 1:].strip()))
    assert len(rows) >= 40
    return rows


ROWS = _rows()


def _expect(text: str, result: str) -> Union[int, float, str]:
    """bytes (int), a percentage (float), or the message every surface's error contains."""
    if result.startswith("error "):
        return f"bad size '{text.strip(' ' + chr(9))}': {result[6:]}"
    if result.endswith("%"):
        return float(result[:-1])
    return int(result)


def _answer(fn) -> Union[int, float, str]:
    """What a surface gave: bytes (int), a percentage (float), or "error: MESSAGE". Texts in
    the library's form ("6442450944", "50%", "0:50%") are read as the library reads them."""
    try:
        v = fn()
    except spillway.Error as e:
        return "error: " + str(e)
    if isinstance(v, str):
        v = v.split(":", 1)[-1]  # a per-device list of one device
        return float(v[:-1]) if v.endswith("%") else int(v)
    return v


def _agrees(want, got) -> bool:
    if isinstance(want, str):
        return isinstance(got, str) and want in got
    return type(got) is type(want) and got == want


def _conf_budget() -> str:
    with spillway.Config(from_env=True) as cfg:
        return cfg.get("budget")


@pytest.mark.parametrize("line,text,result", ROWS, ids=[f"line{r[0]}" for r in ROWS])
def test_one_grammar(line, text, result, monkeypatch):
    want = _expect(text, result)
    got = {
        "spillway.core.parse_budget (offload, Context)": _answer(lambda: parse_budget(text, "test")),
        "use_allocator(budget=TEXT)": _answer(lambda: _budget._budget_text(text)),
        "use_allocator(budget={0: TEXT})": _answer(lambda: _budget._budget_text({0: text})),
        "use_allocator(budget='0:TEXT')": _answer(lambda: _budget._budget_text("0:" + text)),
    }
    monkeypatch.setenv("SPILLWAY_CONF", f"budget={text}")
    got["SPILLWAY_CONF (spillway.Config)"] = _answer(_conf_budget)
    monkeypatch.delenv("SPILLWAY_CONF")
    if isinstance(want, int):
        got["spillway.parse_size"] = _answer(lambda: spillway.parse_size(text))
    bad = {k: v for k, v in got.items() if not _agrees(want, v)}
    assert not bad, f"{TABLE}:{line}: {text!r}: want {want!r}, got {bad}"


def test_printing_is_the_librarys():
    for n, text in [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB"), (3 << 29, "1.50 GiB"), (3 << 50, "3072.00 TiB"),
                    (-(2 << 20), "-2.00 MiB")]:
        assert spillway.format_size(n) == text
        if n >= 0:
            assert spillway.parse_size(text) == n  # printed text parses back


def test_offload_budget_rounded_to_pages_warns():
    import torch

    from spillway import torch as spt

    m = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]).requires_grad_(False)
    with pytest.warns(UserWarning, match=r"budget 3\.00 MiB they can use only 2\.00 MiB \(33\.3% lost\)") as w:
        o = spt.offload(m, budget="3MiB", backend="emu")
    assert w[0].filename == __file__
    try:
        s = o.context.stats()
        assert (s["budget"], s["budget_usable"]) == (3 << 20, 2 << 20)
        assert "rounded down to 2.00 MiB" in o.context.summary()
    finally:
        o.remove()
