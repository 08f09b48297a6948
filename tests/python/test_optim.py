"""spillway.optim (the C host optimizer step) against torch.optim on CPU, step by step."""
from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

import spillway
import spillway.optim as so
from spillway import _lib

REPO = Path(__file__).resolve().parents[2]
HEADER = (REPO / "include" / "spillway_optim.h").read_text()
SIZES = (1, 17, 1000, 100003, 65536 * 3 + 5)  # vector bodies, tails, several threads' parts
STEPS = 6


# ---- the header and the ctypes declarations agree ----

def test_every_optim_function_declared():
    declared = set(re.findall(r"SPW_API\s+[\w\s\*]*?\b(spw_\w+)\s*\(", HEADER))
    assert len(declared) >= 7
    assert declared == set(_lib.OPTIM_FUNCTION_NAMES)
    for name in declared:
        assert getattr(_lib.lib, name).argtypes is not None, name


@pytest.mark.parametrize(
    "struct,cls",
    [("spw_adam_tensor", _lib.AdamTensor), ("spw_adam_hparams", _lib.AdamHparams),
     ("spw_sgd_tensor", _lib.SgdTensor), ("spw_sgd_hparams", _lib.SgdHparams)],
)
def test_struct_fields_match_header(struct, cls):
    body = re.search(r"typedef struct %s \{(.*?)\} %s;" % (struct, struct), HEADER, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    names = []
    for decl in body.split(";"):
        decl = decl.strip()
        if decl:
            names += [n.strip().lstrip("*") for n in decl.split(None, 1)[1].replace("*", " ").split(",")]
    names = [n.split()[-1] for n in names]
    assert names == [f[0] for f in cls._fields_]


def test_flag_values_match_header():
    for name in ("ADAM_MAXIMIZE", "ADAM_MOMENT_MUL_ADD", "SGD_MAXIMIZE", "SGD_NESTEROV", "SGD_FIRST_STEP"):
        shift = int(re.search(r"SPW_%s = 1u << (\d+)" % name, HEADER).group(1))
        assert getattr(_lib, name) == 1 << shift, name


def test_import_needs_no_torch():
    code = "import sys, spillway.optim; assert 'torch' not in sys.modules; print(spillway.optim.isa())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() in ("avx512", "avx2", "generic")


# ---- equal to torch.optim ----

def _params(seed: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) for n in SIZES], g


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| / |b| over the elements (exact zeros of b compare exactly)."""
    d = (a - b).abs()
    if torch.equal(a, b):
        return 0.0
    nz = b != 0
    if bool((d[~nz] != 0).any()):
        return float("inf")
    return float((d[nz] / b[nz].abs()).max())


def _adam_run(cls, ours, *, grad_dtype=torch.float32, pool=None, **kw):
    """Worst relative difference over all steps and tensors, and whether every one was equal."""
    init, gen = _params(1)
    ref = [p.clone().requires_grad_(True) for p in init]
    opt = cls(ref, foreach=False, **kw)
    amsgrad = kw.get("amsgrad", False)
    p = [t.clone() for t in init]
    m = [torch.zeros_like(t) for t in init]
    v = [torch.zeros_like(t) for t in init]
    x = [torch.zeros_like(t) for t in init] if amsgrad else None
    opts = {k: kw[k] for k in ("lr", "betas", "eps", "weight_decay", "maximize") if k in kw}
    worst, equal = 0.0, True
    for step in range(1, STEPS + 1):
        grads = [torch.randn(t.numel(), generator=gen).to(grad_dtype) for t in init]
        for r, g in zip(ref, grads):
            r.grad = g.float()
        opt.step()
        ours(p, grads, m, v, step, max_exp_avg_sqs=x, pool=pool, **opts)
        for i, r in enumerate(ref):
            st = opt.state[r]
            pairs = [(p[i], r.detach()), (m[i], st["exp_avg"]), (v[i], st["exp_avg_sq"])]
            if amsgrad:
                pairs.append((x[i], st["max_exp_avg_sq"]))
            for a, b in pairs:
                worst = max(worst, _max_rel(a, b))
                equal = equal and torch.equal(a, b)
    return worst, equal


ADAM_CASES = [
    ("adamw", {}),
    ("adamw", {"lr": 3e-2, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}),
    ("adamw", {"amsgrad": True}),
    ("adamw", {"maximize": True, "weight_decay": 0.0}),
    ("adamw", {"betas": (0.3, 0.99)}),
    ("adam", {}),
    ("adam", {"weight_decay": 0.05, "amsgrad": True}),
    ("adam", {"weight_decay": 0.01, "maximize": True}),
]


@pytest.mark.parametrize("which,kw", ADAM_CASES)
def test_adam_within_1e6_and_bitwise(which, kw):
    cls, ours = (torch.optim.AdamW, so.adamw_step) if which == "adamw" else (torch.optim.Adam, so.adam_step)
    worst, equal = _adam_run(cls, ours, **kw)
    assert worst <= 1e-6
    assert equal, f"not bitwise equal to torch {torch.__version__} (worst relative {worst:.3g})"


@pytest.mark.parametrize("amsgrad", [False, True])
def test_out_of_place_step_equals_in_place_and_leaves_the_inputs(amsgrad):
    p, g, m, v = _adam_arrays()
    x = v.clone() if amsgrad else None
    outs = [torch.empty_like(p) for _ in range(4)]
    before = [t.clone() for t in (p, g, m, v)]
    so.adamw_step(p, g, m, v, 3, max_exp_avg_sqs=x, params_out=outs[0], exp_avgs_out=outs[1],
                  exp_avg_sqs_out=outs[2], max_exp_avg_sqs_out=outs[3] if amsgrad else None)
    assert _unchanged(before, (p, g, m, v))
    so.adamw_step(p, g, m, v, 3, max_exp_avg_sqs=x)  # in place: what the outputs must hold
    for got, want in zip(outs, (p, m, v, x)):
        if want is not None:
            assert torch.equal(got, want)
    with pytest.raises(spillway.InvalidArgument, match="max_exp_avg_sqs_out given without"):
        so.adamw_step(p, g, m, v, 4, max_exp_avg_sqs_out=outs[3])
    with pytest.raises(spillway.InvalidArgument, match="exp_avg_out.*overlap"):
        so.adamw_step(p, g, m, v, 4, exp_avgs_out=g)


def test_half_gradients_match_torch_on_widened_gradients():
    for dt in (torch.bfloat16, torch.float16):
        worst, equal = _adam_run(torch.optim.AdamW, so.adamw_step, grad_dtype=dt)
        assert worst <= 1e-6 and equal, dt


def test_thread_counts_give_the_same_bits():
    results = []
    for threads in (1, 2, 5):
        with so.Pool(threads) as pool:
            assert pool.threads == threads
            results.append(_adam_run(torch.optim.AdamW, so.adamw_step, pool=pool))
    assert all(r == (0.0, True) for r in results)


SGD_CASES = [
    {"lr": 0.1},
    {"lr": 0.1, "weight_decay": 1e-2},
    {"lr": 0.05, "momentum": 0.9},
    {"lr": 0.05, "momentum": 0.9, "dampening": 0.1, "weight_decay": 1e-2},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True},
    {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-2, "maximize": True},
]


@pytest.mark.parametrize("kw", SGD_CASES)
def test_sgd_within_1e6_and_bitwise(kw):
    init, gen = _params(2)
    ref = [p.clone().requires_grad_(True) for p in init]
    opt = torch.optim.SGD(ref, foreach=False, **kw)
    p = [t.clone() for t in init]
    bufs = [torch.zeros_like(t) for t in init]
    worst, equal = 0.0, True
    for step in range(1, STEPS + 1):
        grads = [torch.randn(t.numel(), generator=gen) for t in init]
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        opt.step()
        so.sgd_step(p, grads, bufs, first_step=step == 1, **kw)
        for i, r in enumerate(ref):
            pairs = [(p[i], r.detach())]
            if kw.get("momentum"):
                pairs.append((bufs[i], opt.state[r]["momentum_buffer"]))
            for a, b in pairs:
                worst = max(worst, _max_rel(a, b))
                equal = equal and torch.equal(a, b)
    assert worst <= 1e-6
    assert equal


def test_numpy_arrays_and_single_tensors():
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal(4099).astype(np.float32)
    g = rng.standard_normal(4099).astype(np.float32)
    p, m, v = p0.copy(), np.zeros_like(p0), np.zeros_like(p0)
    so.adamw_step(p, g, m, v, 1, lr=1e-2)
    ref = torch.from_numpy(p0.copy()).requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=1e-2, foreach=False)
    ref.grad = torch.from_numpy(g)
    opt.step()
    assert torch.equal(torch.from_numpy(p), ref.detach())
    # fp16 gradients from numpy
    so.adamw_step(p, g.astype(np.float16), m, v, 2, lr=1e-2)
    assert np.isfinite(p).all()


def test_step_from_a_background_thread():
    p = torch.zeros(300000)
    g = torch.full((300000,), -1.0)
    t = threading.Thread(target=lambda: so.sgd_step(p, g, lr=0.5))
    t.start()
    t.join()
    assert bool((p == 0.5).all())


def test_moment_formula_follows_torch():
    major = int(torch.__version__.split(".")[0])
    assert so.torch_moment_formula() == ("mul_add" if major < 2 else "lerp")


# ---- bad input: a clear error, nothing written ----

def _adam_arrays(n=1000):
    return torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)


def _unchanged(before, after):
    return all(torch.equal(a, b) for a, b in zip(before, after))


def test_bad_hyperparameters_raise_the_library_message():
    arrays = _adam_arrays()
    before = [a.clone() for a in arrays]
    for kw, text in [
        ({"lr": -1e-3}, "lr = -0.001"),
        ({"betas": (1.0, 0.999)}, "beta1 = 1"),
        ({"betas": (0.9, -0.1)}, "beta2 = -0.1"),
        ({"eps": -1.0}, "eps = -1"),
        ({"weight_decay": -0.5}, "weight_decay = -0.5"),
    ]:
        with pytest.raises(spillway.InvalidArgument, match=re.escape(text)):
            so.adamw_step(*arrays, 1, **kw)
    with pytest.raises(spillway.InvalidArgument, match="step = 0"):
        so.adamw_step(*arrays, 0)
    with pytest.raises(spillway.InvalidArgument, match="nesterov needs momentum > 0"):
        so.sgd_step(arrays[0], arrays[1], arrays[2], lr=0.1, momentum=0.9, dampening=0.5, nesterov=True)
    assert _unchanged(before, arrays)


def test_bad_arrays_are_refused_before_anything_moves():
    p, g, m, v = _adam_arrays()
    good = _adam_arrays()
    before = [t.clone() for t in (p, g, m, v) + good]
    cases = [
        (([good[0], p], [good[1], g], [good[2], m], [good[3], v[:999]]), "exp_avg_sqs\\[1\\] has 999 elements"),
        (([good[0], p.double()], [good[1], g], [good[2], m], [good[3], v]), "params\\[1\\] has dtype torch.float64"),
        (([good[0], p], [good[1], g.double()], [good[2], m], [good[3], v]), "grads\\[1\\] has dtype torch.float64"),
        (([good[0], p.view(10, 100).t()], [good[1], g], [good[2], m], [good[3], v]), "params\\[1\\] is not contiguous"),
        (([good[0], p], [good[1], g], [good[2], m], [good[3]]), "exp_avg_sqs has 1 entries, params has 2"),
    ]
    for args, text in cases:
        with pytest.raises(spillway.InvalidArgument, match=text):
            so.adamw_step(*args, 1)
    with pytest.raises(TypeError, match="want a torch CPU tensor or a numpy array"):
        so.adamw_step([1.0], [1.0], [0.0], [0.0], 1)
    with pytest.raises(spillway.InvalidArgument, match="overlap"):
        so.adamw_step(p, g, p, v, 1)  # exp_avg is the parameter itself
    with pytest.raises(spillway.InvalidArgument, match="momentum_buffers are needed"):
        so.sgd_step(p, g, lr=0.1, momentum=0.9)
    with pytest.raises(spillway.InvalidArgument, match="moment = 'fast'"):
        so.adamw_step(p, g, m, v, 1, moment="fast")
    pool = so.Pool(2)
    pool.close()
    with pytest.raises(spillway.InvalidArgument, match="pool is closed"):
        so.adamw_step(p, g, m, v, 1, pool=pool)
    with pytest.raises(spillway.InvalidArgument, match="threads = -1"):
        so.Pool(-1)
    assert _unchanged(before, (p, g, m, v) + good)


def test_keep_freed_grows_and_refuses_bad_sizes():
    """The heap's kept size for a framework's own step only grows; bad sizes are the library's
    error (the behaviour itself: tests/test_optim.c and test_offload_train.py)."""
    first = so.keep_freed(40 << 20)
    assert first == 0 or first >= 40 << 20  # 0: the environment sets glibc's thresholds itself
    assert so.keep_freed(1 << 20) == first
    for bad, text in [(0, "0 bytes"), (so.KEEP_FREED_MAX + 1, f"want 1 to {so.KEEP_FREED_MAX}"), (1 << 40, "want 1 to")]:
        with pytest.raises(spillway.InvalidArgument, match=text):
            so.keep_freed(bad)
    for bad in (-1, 1.5, True, "40MiB"):
        with pytest.raises(spillway.InvalidArgument, match="nbytes"):
            so.keep_freed(bad)
