"""Training through spillway.torch.offload(model, budget, optimizer=opt) on the emu backend: the
trainable parameters are offloaded, gradients reach their host Parameters through autograd, the
optimizer steps on the host. Every case trains an identical resident copy the same way and
compares bitwise: losses at every step, gradients, parameters after 5 steps."""
from __future__ import annotations

import contextlib
import copy
import os
import resource
import warnings
from typing import Callable, List

import pytest
import torch
from torch import nn

import spillway
import spillway.torch as spt
from spillway.torch import _build
import models
from models import GEGLU, fail_at_call, make_decoder, moved, offloaded_bytes, step_pair, wrapped_linear

MiB = 1 << 20

EMU = dict(backend="emu")
STEPS = 5


def stack(seed: int = 0, dim: int = 512, depth: int = 8) -> nn.Sequential:
    """depth Linear+Tanh layers: 8 MiB at the defaults, twice a 4 MiB budget."""
    torch.manual_seed(seed)
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(dim, dim), nn.Tanh()]
    return nn.Sequential(*layers)


def snapshot(m: nn.Module):
    return {n: (t, t.data_ptr(), t.detach().clone(), t.device)
            for n, t in list(m.named_parameters()) + list(m.named_buffers())}


def assert_unchanged(m: nn.Module, snap) -> None:
    now = dict(list(m.named_parameters()) + list(m.named_buffers()))
    assert set(now) == set(snap)
    for n, (t, ptr, val, dev) in snap.items():
        assert now[n] is t and t.data_ptr() == ptr and t.device == dev and torch.equal(t, val), n
    for sub in m.modules():
        assert "forward" not in sub.__dict__


def assert_params_equal(m: nn.Module, ref: nn.Module, grads: bool = False) -> None:
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n
        if grads:
            assert (p.grad is None) == (q.grad is None), n
            if p.grad is not None:
                assert torch.equal(p.grad, q.grad), n


def train(m: nn.Module, ref: nn.Module, make_opt: Callable[[nn.Module], torch.optim.Optimizer],
          batches: Callable[[int], List], loss_of: Callable, budget: str = "4MiB", micro: int = 1,
          clip: float = 0.0, set_to_none: bool = True, explicit: bool = False, reacquires: bool = True,
          **offload_args):
    """STEPS steps of `micro` forward+backward passes each (then clip, step, zero_grad) on m
    offloaded under budget and on ref resident, compared bitwise throughout; explicit: each
    step inside `with off.step():`; reacquires: backward re-acquires units for the weights it
    saved (not where checkpointing recomputes them in backward). Returns the Offload, still
    active."""
    opt, opt_ref = make_opt(m), make_opt(ref)
    offload_args.setdefault("train_on_device", 0)  # every trained parameter offloaded, unless asked
    off = spt.offload(m, budget=budget, optimizer=opt, **EMU, **offload_args)
    on_device = {id(p) for _, p in off._trainable}
    assert off.optimizer is opt
    trained = sum(u.nbytes for u in off.units if u.trains)
    h2d = lambda: off.context.stats()["bytes_h2d"]["total"]  # noqa: E731
    since_step = None
    for step in range(STEPS):
        scope = off.step() if explicit else contextlib.nullcontext()
        scope.__enter__()
        for i, x in enumerate(batches(step)[:micro]):
            loss = moved(off, lambda: loss_of(m, x))
            if since_step is not None:  # the step dropped every trained unit's device copy: all came back
                assert h2d() - since_step >= trained
                since_step = None
            want = loss_of(ref, x)
            assert torch.equal(loss, want), (step, loss, want)
            loss.backward()
            want.backward()
        assert_params_equal(m, ref, grads=True)
        if clip:
            n1 = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=clip)
            n2 = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=clip)
            assert torch.equal(n1, n2)
        since_step = h2d()  # before the step: its end may already upload the new values (a plan prefetch)
        opt.step()
        opt_ref.step()
        opt.zero_grad(set_to_none=set_to_none)
        opt_ref.zero_grad(set_to_none=set_to_none)
        scope.__exit__(None, None, None)
    off.synchronize()  # overlap_update: the last step's update may still run
    assert_params_equal(m, ref, grads=True)
    packs = [(u.pack.data_ptr(), u.pack.data_ptr() + u.pack.numel()) for u in off.units]
    for sub in m.modules():  # every slot holds its Parameter again, a view into its unit's pack
        for n, p in sub._parameters.items():
            if p is not None and id(p) not in on_device:
                assert type(p) is nn.Parameter and any(a <= p.data_ptr() < b for a, b in packs), n
    h = off.stats()["offload"]
    assert h["optimizer_steps"] == STEPS and h["step_evictions"] >= STEPS
    assert h["saved_packed"] > 0  # the weights backward needed were records
    assert (h["saved_reacquires"] > 0) == reacquires
    return off


def mse(model: nn.Module, x) -> torch.Tensor:
    return model(x).square().mean()


def stack_batches(step: int) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(4, 512, generator=g) for _ in range(4)]


def finish(off, m: nn.Module, ref: nn.Module, x) -> None:
    """Inference on the trained weights (the fast path, fresh uploads) equal to ref, then remove()."""
    with torch.no_grad():
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    opt = off.optimizer
    off.remove()
    assert "step" not in opt.__dict__  # the wrapper is gone
    assert_params_equal(m, ref)
    assert all(p.device.type == "cpu" for p in m.parameters())


@pytest.mark.parametrize("policy", ["plan", "lru"])
def test_sgd_with_momentum(policy):
    m = stack()
    ref = copy.deepcopy(m)
    off = train(m, ref, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9), stack_batches, mse,
                policy=policy)
    assert offloaded_bytes(off) == sum(u.nbytes for u in off.units if u.trains)  # everything trained
    for u in off.units:  # no device tensor requires grad: no device .grad is ever kept
        assert not any(d.requires_grad for d in u.dev_set[0])
    s = off.summary()
    assert "trained on host   16 trainable parameters" in s and "by SGD" in s and "5 steps" in s
    assert "kept resident" not in s
    finish(off, m, ref, stack_batches(9)[0])


@pytest.mark.parametrize("explicit", [False, True], ids=["auto-steps", "off.step"])
def test_adamw(explicit):
    m = stack(1)
    ref = copy.deepcopy(m)
    off = train(m, ref, lambda mod: torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1), stack_batches,
                mse, explicit=explicit)
    assert "by AdamW" in off.summary()
    assert off.steps == STEPS  # explicit: one plan step per `with`, forward, backward and optimizer step
    finish(off, m, ref, stack_batches(9)[0])


def test_accumulation_over_micro_batches_and_clipping():
    m = stack(2)
    ref = copy.deepcopy(m)
    off = train(m, ref, lambda mod: torch.optim.AdamW(mod.parameters(), lr=1e-2), stack_batches, mse,
                micro=4, clip=1.0)
    finish(off, m, ref, stack_batches(9)[0])


def two_groups(mod: nn.Module) -> torch.optim.Optimizer:
    """AdamW over two parameter groups of their own hyper-parameters: weights and biases."""
    weights = [p for n, p in mod.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in mod.named_parameters() if n.endswith("bias")]
    return torch.optim.AdamW([{"params": weights, "lr": 1e-3, "weight_decay": 0.1},
                              {"params": biases, "lr": 3e-3, "weight_decay": 0.0}])


def test_two_parameter_groups():
    m = stack(3)
    ref = copy.deepcopy(m)
    off = train(m, ref, two_groups, stack_batches, mse)
    finish(off, m, ref, stack_batches(9)[0])


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad(set_to_none):
    m = stack(4)
    ref = copy.deepcopy(m)
    off = train(m, ref, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05), stack_batches, mse,
                micro=2, set_to_none=set_to_none)
    for p in m.parameters():
        assert (p.grad is None) if set_to_none else (p.grad is not None and not p.grad.any())
    finish(off, m, ref, stack_batches(9)[0])


def test_tied_embedding_and_head():
    m = make_decoder(vocab=1024, dim=256, heads=4, layers=4).train()  # 14 MiB, lm_head tied to embed
    ref = copy.deepcopy(m)
    assert m.lm_head.weight is m.embed.weight

    def batches(step: int):
        g = torch.Generator().manual_seed(step)
        return [(torch.randint(0, 1024, (2, 8), generator=g), torch.randint(0, 1024, (2, 8), generator=g))]

    def loss_of(model, batch):
        ids, target = batch
        logits, _ = model(ids)
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

    off = train(m, ref, lambda mod: torch.optim.AdamW(mod.parameters(), lr=1e-3), batches, loss_of, budget="8MiB")
    assert m.lm_head.weight is m.embed.weight  # still one Parameter
    ids = batches(9)[0][0]
    with torch.no_grad():
        assert torch.equal(moved(off, lambda: m(ids)[0]), ref(ids)[0])
    off.remove()
    assert_params_equal(m, ref)


class Twice(nn.Module):
    """One block called twice per forward: its unit is acquired, released and acquired again,
    so two aliases of each weight feed the same host Parameter's gradient."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.inp = nn.Linear(512, 512)
        self.shared = nn.Linear(512, 512)
        self.mid = nn.Linear(512, 512)
        self.out = nn.Linear(512, 512)

    def forward(self, x):
        x = torch.tanh(self.inp(x))
        x = torch.tanh(self.shared(x))
        x = torch.tanh(self.mid(x))
        x = torch.tanh(self.shared(x))
        return self.out(x)


def test_a_unit_used_twice_in_a_forward():
    m = Twice()
    ref = copy.deepcopy(m)
    off = train(m, ref, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9), stack_batches, mse,
                budget="2MiB")
    finish(off, m, ref, stack_batches(9)[0])


def test_adapters_on_a_frozen_base_are_offloaded_and_trained():
    """optimizer= offloads the trainable parameters also where the base is frozen (without it
    they stay resident): the adapters' units are trained, the frozen ones are not touched."""
    class Adapted(nn.Module):
        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base
            self.a = nn.Parameter(torch.randn(8, base.in_features) * 0.05)
            self.b = nn.Parameter(torch.randn(base.out_features, 8) * 0.05)

        def forward(self, x):
            return self.base(x) + (x @ self.a.t()) @ self.b.t()

    m = stack(6).requires_grad_(False)
    for i in range(0, len(m), 2):
        m[i] = Adapted(m[i])
    ref = copy.deepcopy(m)
    off = train(m, ref, lambda mod: torch.optim.AdamW([p for p in mod.parameters() if p.requires_grad], lr=1e-2),
                stack_batches, mse)
    assert off._trainable == []  # nothing kept resident
    trained = {e.name for u in off.units if u.trains for e in u.entries if e.tensor.requires_grad}
    assert len(trained) == 16 and all(n.endswith((".a", ".b")) for n in trained)
    finish(off, m, ref, stack_batches(9)[0])


def test_a_closure_sees_the_parameters_of_each_of_its_calls():
    """LBFGS calls its closure several times in one step and changes the parameters between the
    calls: each call runs on the current values."""
    m = stack(7, depth=4)
    ref = copy.deepcopy(m)
    opt = torch.optim.LBFGS(m.parameters(), lr=0.5, max_iter=4, history_size=3)
    opt_ref = torch.optim.LBFGS(ref.parameters(), lr=0.5, max_iter=4, history_size=3)
    off = spt.offload(m, budget="4MiB", optimizer=opt, **EMU)  # 4.02 MiB: most units stay resident across calls
    calls = []

    def closure_of(model, o, x):
        def closure():
            o.zero_grad()
            loss = mse(model, x)
            loss.backward()
            calls.append(loss.detach())
            return loss
        return closure

    for step in range(3):
        x = stack_batches(step)[0]
        n = len(calls)
        got = moved(off, lambda: opt.step(closure_of(m, opt, x)))
        mine = calls[n:]
        want = opt_ref.step(closure_of(ref, opt_ref, x))
        theirs = calls[n + len(mine):]
        assert torch.equal(got, want) and len(mine) == len(theirs) > 1
        assert all(torch.equal(a, b) for a, b in zip(mine, theirs))
        assert_params_equal(m, ref)
    off.remove()


@pytest.mark.parametrize("on_device", [0, 0.15])
def test_remove_puts_the_optimizer_back_and_training_goes_on_resident(on_device):
    m = stack(8)
    ref = copy.deepcopy(m)
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    off = spt.offload(m, budget="10MiB" if on_device else "4MiB", optimizer=opt, train_on_device=on_device, **EMU)
    assert len(off._trainable) == (2 if on_device else 0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)  # wraps opt.step over ours
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, step_size=2, gamma=0.5)
    x = stack_batches(0)[0]

    def step(model, o, s):
        loss = mse(model, x)
        loss.backward()
        o.step()
        o.zero_grad()
        s.step()
        return loss

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no scheduler warning about opt.step being overridden
        for i in range(4):
            if i == 2:
                off.remove()
            assert torch.equal(step(m, opt, sched), step(ref, opt_ref, sched_ref))
    assert_params_equal(m, ref)
    assert opt.state[m[0].weight]["momentum_buffer"].device.type == "cpu"
    with pytest.raises(spillway.StateError, match="removed"):
        off.summary()


def test_a_failure_midway_through_offload_puts_the_optimizer_back(monkeypatch):
    """optimizer=: a failure after the trained parameters became host views of the packs (and
    opt's state was moved with them) but before opt.step was wrapped leaves opt as it was:
    training it resident then matches a reference step for step."""
    from spillway.torch import _patch
    m = stack(9)
    ref = copy.deepcopy(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    x = stack_batches(0)[0]
    for model, o in ((m, opt), (ref, opt_ref)):  # some state to carry through the failure
        mse(model, x).backward()
        o.step()
        o.zero_grad()
    fail_at_call(monkeypatch, _patch, "wrap_forward", 2)
    with pytest.raises(RuntimeError, match="injected failure"):
        spt.offload(m, budget="4MiB", optimizer=opt, **EMU)
    monkeypatch.undo()
    assert "step" not in opt.__dict__  # not wrapped
    assert not any("forward" in sub.__dict__ for sub in m.modules())
    assert_params_equal(m, ref)
    for p, q in zip(m.parameters(), ref.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], opt_ref.state[q][k]), k
    for _ in range(2):
        for model, o in ((m, opt), (ref, opt_ref)):
            mse(model, x).backward()
            o.step()
            o.zero_grad()
    assert_params_equal(m, ref)


# ---- bad input: a clear error before anything moves; the model unchanged and usable ----

def check_refused(m: nn.Module, exc, match: str, **kw) -> None:
    ref = copy.deepcopy(m)
    snap = snapshot(m)
    with pytest.raises(exc, match=match):
        spt.offload(m, budget="4MiB", **EMU, **kw)
    assert_unchanged(m, snap)
    x = stack_batches(0)[0]
    assert torch.equal(m(x), ref(x))  # still usable, resident


@pytest.mark.parametrize("make", [
    lambda mod: torch.optim.Adam(mod.parameters(), lr=1e-3, weight_decay=0.1),
    lambda mod: torch.optim.Adam(mod.parameters(), lr=1e-3, amsgrad=True, maximize=True),
    lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01),
    lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9, nesterov=True),
    lambda mod: torch.optim.SGD([{"params": list(mod.parameters())[:4], "momentum": 0.5},
                                 {"params": list(mod.parameters())[4:]}], lr=0.05),
], ids=["adam", "adam-amsgrad-maximize", "sgd-momentum-dampening", "sgd-nesterov", "sgd-two-groups"])
def test_adam_and_sgd_by_spillways_c_step(make):
    """Adam and SGD run in the C kernels too (spillway.optim.adam_step, sgd_step): equal to
    torch's single-tensor step of the resident copy, step by step (SGD's first step sets each
    momentum buffer to the gradient, as torch's None does), and the state carries on."""
    m = stack(6)
    ref = copy.deepcopy(m)
    off = train(m, ref, make, stack_batches, mse, host_update="spillway")
    assert off.c_steps == STEPS
    st = off.optimizer.state
    for g in off.optimizer.param_groups:
        for p in g["params"]:
            assert (float(st[p]["step"]) == STEPS) if "betas" in g else \
                (("momentum_buffer" in st[p]) == bool(g["momentum"]))
    finish(off, m, ref, stack_batches(9)[0])


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_by_spillways_c_step(amsgrad):
    """host_update="spillway": AdamW's step runs in the C kernels on opt's own state; equal to
    torch's single-tensor AdamW (the resident copy's) step by step, and the state carries on."""
    m = stack(3)
    ref = copy.deepcopy(m)
    make = lambda mod: torch.optim.AdamW(mod.parameters(), lr=1e-3, weight_decay=0.1, amsgrad=amsgrad)  # noqa: E731
    off = train(m, ref, make, stack_batches, mse, host_update="spillway")
    assert off.c_steps == STEPS
    st = off.optimizer.state_dict()["state"]
    assert all(float(v["step"]) == STEPS and "exp_avg_sq" in v for v in st.values())
    finish(off, m, ref, stack_batches(9)[0])


@pytest.mark.parametrize("micro,clip", [(1, 0.0), (4, 1.0)])
def test_overlapped_update_is_the_same_update(micro, clip):
    """overlap_update=True: the C AdamW runs beside the next forward (two parameter groups,
    accumulation, clipping); every loss, gradient and parameter bitwise equal to the resident
    model's torch AdamW, as without the overlap."""
    m = stack(5)
    ref = copy.deepcopy(m)
    off = train(m, ref, two_groups, stack_batches, mse, micro=micro, clip=clip, overlap_update=True)
    assert off.c_steps == STEPS
    finish(off, m, ref, stack_batches(9)[0])


@pytest.mark.parametrize("make", [
    two_groups,
    lambda mod: torch.optim.Adam(mod.parameters(), lr=1e-3, weight_decay=0.01, amsgrad=True),
], ids=["adamw-two-groups", "adam-amsgrad"])
def test_updates_computed_during_the_backward_are_kept(make):
    """overlap_update="backward": each parameter's update is computed while the backward still runs,
    as soon as its gradient is in host memory, and opt.step() keeps it: from the second step on
    (the first creates the state) every one is kept, none computed again, and everything is
    bitwise the resident model's (train)."""
    m = stack(5)
    ref = copy.deepcopy(m)
    off = train(m, ref, make, stack_batches, mse, overlap_update="backward")
    n = len(list(m.parameters()))
    h = off.stats()["offload"]
    assert (h["updates_ahead_kept"], h["updates_ahead_dropped"]) == (n * (STEPS - 1), 0)
    assert f"{n * (STEPS - 1)} parameter updates computed during the backward and kept" in off.summary()
    # the work is queued during the backward, before opt.step()
    mse(m, stack_batches(9)[0]).backward()
    assert len(off._ahead.pending) == n
    off.optimizer.zero_grad()
    finish(off, m, ref, stack_batches(9)[0])


@pytest.mark.parametrize("change", ["clip", "accumulate", "lr", "zero_grad"])
def test_updates_computed_during_the_backward_are_dropped_when_their_inputs_change(change):
    """What an update computed ahead read changed before opt.step(): clipping scales the
    gradients, accumulation adds to them (nothing is computed ahead then), a scheduler changes
    the learning rate, zero_grad(set_to_none=False) zeroes them. The step computes those updates
    again: bitwise the resident model's; after a step that kept nothing, the work ahead pauses."""
    m, ref = stack(6), stack(6)
    opt, opt_ref = two_groups(m), two_groups(ref)
    off = spt.offload(m, budget="4MiB", optimizer=opt, overlap_update="backward", train_on_device=0, **EMU)
    for step in range(8):
        micro = 3 if change == "accumulate" else 1
        for model, o in ((m, opt), (ref, opt_ref)):
            for x in stack_batches(step)[:micro]:
                mse(model, x).backward()
            if change == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
            elif change == "lr":
                for g in o.param_groups:
                    g["lr"] *= 0.9
            elif change == "zero_grad":
                o.zero_grad(set_to_none=False)
            o.step()
            o.zero_grad(set_to_none=True)
        off.synchronize()
        assert_params_equal(m, ref)
    h = off.stats()["offload"]
    assert h["updates_ahead_kept"] == 0
    n = len(list(m.parameters()))
    if change == "accumulate":
        assert h["updates_ahead_dropped"] == 0  # never computed ahead
    else:  # steps 2 and 3 computed ahead; 3 pauses 1 step, 5 pauses 2, 8 pauses 4
        assert h["updates_ahead_dropped"] == 3 * n
    off.remove()
    assert_params_equal(m, ref)


def test_an_update_ahead_that_fails_is_computed_in_the_step(monkeypatch):
    """The kernel fails on the worker (here: every call with separate outputs): nothing is
    raised into the backward, and the step computes those updates itself; bitwise the resident
    model's."""
    real = spillway.optim.adamw_step

    def fails_ahead(*args, **kwargs):
        if kwargs.get("params_out") is not None:
            raise spillway.InvalidArgument("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(spillway.optim, "adamw_step", fails_ahead)
    m = stack(8)
    ref = copy.deepcopy(m)
    off = train(m, ref, two_groups, stack_batches, mse, overlap_update="backward")
    assert off.stats()["offload"]["updates_ahead_kept"] > 0
    finish(off, m, ref, stack_batches(9)[0])


@pytest.mark.parametrize("micro,clip,overlap", [(1, 0.0, False), (4, 1.0, False), (1, 0.0, True)])
def test_the_first_parameters_are_trained_on_the_device(micro, clip, overlap):
    """train_on_device=0.15: the first 15% of the trained bytes stay on the device with their
    gradients and state, stepped by opt's own step; the rest is offloaded (the weights move every
    step) and stepped in C. Two parameter groups, accumulation, clipping, the overlapped update:
    every loss, gradient and parameter bitwise equal to the resident model's (train). Their
    bytes, gradients and state come out of the budget."""
    m = stack(7)
    ref = copy.deepcopy(m)
    off = train(m, ref, two_groups, stack_batches, mse, budget="10MiB", micro=micro, clip=clip,
                overlap_update=overlap, train_on_device=0.15)
    first = list(m.named_parameters())
    kept = [n for n, p in first if any(p is q for _, q in off._trainable)]
    assert kept == ["0.weight", "0.bias"]  # the first ones, up to 15% of the 8 MiB
    kept_bytes = sum(p.numel() * 4 for n, p in first if n in kept)
    # parameter, gradient, two moments, the step's temporaries, in whole 2 MiB pages
    assert off.context.stats()["budget"] == (10 << 20) - -(-5 * kept_bytes // (2 << 20)) * (2 << 20)
    assert all(not u.trains or all(e.name not in kept for e in u.entries) for u in off.units)
    assert off.c_steps == STEPS
    st = off.optimizer.state
    assert all(float(st[p]["step"]) == STEPS for p in m.parameters())
    assert "trained on device 2 trainable parameters" in off.summary()
    finish(off, m, ref, stack_batches(9)[0])


@pytest.mark.parametrize("host_update", ["torch", "spillway"])
def test_an_optimizer_without_a_c_step_trains_both_parts(host_update):
    """RMSprop (no C step): its own step runs over the parameters on the device and on the host
    alike; host_update="torch" likewise for AdamW. Equal to resident throughout; the state lives
    where its parameters do."""
    m = stack(9)
    ref = copy.deepcopy(m)
    make = ((lambda mod: torch.optim.RMSprop(mod.parameters(), lr=1e-3, momentum=0.9)) if host_update == "spillway"
            else (lambda mod: torch.optim.AdamW(mod.parameters(), lr=1e-3)))
    off = train(m, ref, make, stack_batches, mse, budget="10MiB", train_on_device=0.15, host_update=host_update)
    assert [n for n, _ in off._trainable] == ["0.weight", "0.bias"] and off.c_steps == 0
    for p in m.parameters():
        assert all(v.data_ptr() != p.data_ptr() for v in off.optimizer.state[p].values() if torch.is_tensor(v))
    finish(off, m, ref, stack_batches(9)[0])


def test_train_on_device_auto():
    """train_on_device="auto" (the default) keeps the first parameters that take, with their
    gradients, AdamW's two moments and the step's temporaries, at most 70% of the budget, and
    none where that would leave the streamed units no room."""
    m = stack(8)
    opt = torch.optim.AdamW(m.parameters())
    off = spt.offload(m, budget="20MiB", optimizer=opt, **EMU)
    assert [n for n, _ in off._trainable] == ["0.weight", "0.bias", "2.weight", "2.bias"]  # 2.8 MiB at most
    assert off.device_trained_bytes == 5 * sum(p.numel() * 4 for _, p in off._trainable)
    off.remove()
    # a first parameter larger than the share (a large vocabulary's embedding) is passed over
    big = nn.Sequential(nn.Linear(1024, 1024), *[nn.Linear(256, 256) for _ in range(6)])
    off = spt.offload(big, budget="20MiB", optimizer=torch.optim.AdamW(big.parameters()), **EMU)
    assert [n for n, _ in off._trainable] == ["0.bias"] + [f"{i}.{w}" for i in range(1, 7) for w in ("weight", "bias")]
    off.remove()
    # nothing where what fits would not fill the page of the budget it takes (0.bias alone here)
    small = spt.offload(m, budget="4MiB", optimizer=torch.optim.AdamW(m.parameters()), **EMU)
    assert small._trainable == [] and small.context.stats()["budget"] == 4 << 20
    small.remove()


def test_train_on_device_auto_leaves_the_streamed_units_their_room():
    """Where the parameters "auto" would keep leave the offload's context less than the units
    need (a 3.4 MiB last layer after eight small ones), it keeps half as many bytes, and so on;
    training is still equal to resident's."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(128, 128) for _ in range(8)], nn.Linear(128, 7000))
    ref = copy.deepcopy(m)
    opt, opt_ref = torch.optim.AdamW(m.parameters()), torch.optim.AdamW(ref.parameters())
    # "auto" first asks for all eight small layers: 2.5 MiB with their gradients and state, 4 MiB
    # in whole pages, leaving 4 MiB where the last layer alone needs 6 (its 2 MiB pages and the
    # small ones')
    off = spt.offload(m, budget="8MiB", optimizer=opt, **EMU)
    assert [n for n, _ in off._trainable] == [f"{i}.{w}" for i in range(4) for w in ("weight", "bias")]
    assert off.context.stats()["budget"] == 6 << 20 and off.min_budget <= 6 << 20
    for step in range(3):
        x = torch.randn(4, 128, generator=torch.Generator().manual_seed(step))
        loss = m(x).square().mean()
        want = ref(x).square().mean()
        assert torch.equal(loss, want)
        step_pair(loss, want, opt, opt_ref)
    assert_params_equal(m, ref)
    off.remove()


@pytest.mark.parametrize("share,exc,match", [
    (1.5, spillway.ConfigError, "train_on_device = 1.5 is not a fraction"),
    ("half", spillway.ConfigError, "train_on_device must be 'auto' or a fraction"),
    (True, spillway.ConfigError, "train_on_device must be 'auto' or a fraction"),
    (0.5, spillway.ConfigError, r"keeps 4.* of parameters on the device, .* with their gradients and optimizer "
                                r"state \(.* in whole pages\): the whole budget \(4.00 MiB\) or more"),
])
def test_train_on_device_refused(share, exc, match):
    m = stack()
    check_refused(m, exc, match, optimizer=torch.optim.AdamW(m.parameters()), train_on_device=share)


def test_overlapped_update_is_finished_where_it_is_read(monkeypatch):
    """Right after opt.step() the update may still run: module.state_dict(), opt.state_dict(),
    opt.zero_grad(set_to_none=False) and remove() finish it first, so each sees (or zeroes after)
    the updated values; a failure in the update is raised at the next forward, the units are
    usable again and remove() works."""
    m = stack(6)
    ref = copy.deepcopy(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    off = spt.offload(m, budget="4MiB", optimizer=opt, overlap_update=True, **EMU)
    x = stack_batches(0)[0]

    def both_step():
        for model, o in ((m, opt), (ref, opt_ref)):
            mse(model, x).backward()
            o.step()
        assert off._update is not None  # the step went through the overlap

    both_step()
    sd, sd_ref = m.state_dict(), ref.state_dict()
    assert off._update is None and all(torch.equal(sd[k], sd_ref[k]) for k in sd_ref)
    opt.zero_grad(set_to_none=True)
    opt_ref.zero_grad(set_to_none=True)
    both_step()
    st, st_ref = opt.state_dict()["state"], opt_ref.state_dict()["state"]
    assert off._update is None
    assert all(torch.equal(st[i]["exp_avg_sq"], st_ref[i]["exp_avg_sq"]) for i in st_ref)
    opt.zero_grad(set_to_none=True)
    opt_ref.zero_grad(set_to_none=True)
    both_step()
    opt.zero_grad(set_to_none=False)  # zeroes the gradients the update reads: after it
    opt_ref.zero_grad(set_to_none=False)
    assert off._update is None
    assert_params_equal(m, ref, grads=True)
    # a failure in the update: raised at the next forward; the offload goes on and comes off
    from spillway import optim as spw_optim
    fail_at_call(monkeypatch, spw_optim, "adamw_step", 2)
    mse(m, x).backward()
    opt.step()
    with pytest.raises(spillway.StateError, match="update on the host failed: injected failure"):
        mse(m, x)
    monkeypatch.undo()
    assert torch.isfinite(mse(m, x))  # every unit usable again
    both_step()
    off.remove()
    assert "state_dict" not in m.__dict__ and "zero_grad" not in opt.__dict__ and "state_dict" not in opt.__dict__
    assert not any("forward" in sub.__dict__ for sub in m.modules())


def test_host_update_falls_back_to_the_optimizers_own_step():
    m = stack(4)
    ref = copy.deepcopy(m)
    off = train(m, ref, lambda mod: torch.optim.Adagrad(mod.parameters(), lr=0.05), stack_batches, mse,
                host_update="spillway")  # not AdamW, Adam or SGD: torch's step
    assert off.c_steps == 0
    finish(off, m, ref, stack_batches(9)[0])
    with pytest.raises(spillway.ConfigError, match="host_update"):
        spt.offload(stack(), budget="4MiB", optimizer=None, host_update="c", **EMU)
    with pytest.raises(spillway.ConfigError, match="overlap_update must be True, False or 'backward', got 'yes'"):
        spt.offload(stack(), budget="4MiB", optimizer=torch.optim.AdamW(stack().parameters()), overlap_update="yes",
                    **EMU)
    with pytest.raises(spillway.ConfigError, match="overlap_update.*no optimizer"):
        spt.offload(stack(), budget="4MiB", overlap_update=True, **EMU)
    m = stack()
    with pytest.raises(spillway.ConfigError, match="overlap_update.*host_update is 'torch'"):
        spt.offload(m, budget="4MiB", optimizer=torch.optim.AdamW(m.parameters()), host_update="torch",
                    overlap_update=True, **EMU)


def test_the_optimizers_own_step_reuses_its_temporaries():
    """torch's own host step (Adagrad: no C step) makes a temporary of each parameter's size
    and frees it within the step; two parameters of 36 MiB, above glibc's own 32 MiB ceiling,
    would be new mappings whose pages fault in again every step. From the first such step the
    process's heap keeps them: steps three to six fault in under three quarters of their
    temporaries' pages (the heap's layout around them, from whatever ran before in the process,
    may still move one now and then; none when it does not). The summary says so."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(3072, 3072, bias=False), nn.Tanh(), nn.Linear(3072, 3072, bias=False))
    opt = torch.optim.Adagrad(m.parameters(), lr=0.01)
    off = spt.offload(m, budget="48MiB", optimizer=opt, train_on_device=0, **EMU)
    try:
        assert off.stats()["offload"]["host_heap_kept"] is None  # nothing before the first step
        x = torch.randn(4, 3072, generator=torch.Generator().manual_seed(1))
        faults = []
        for _ in range(6):
            moved(off, lambda: m(x).square().mean()).backward()
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            opt.step()
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
            opt.zero_grad()
        assert off.c_steps == 0 and off.stats()["offload"]["optimizer_steps"] == 6
        kept = off.stats()["offload"]["host_heap_kept"]
        if kept == 0:  # the library left the environment's own malloc thresholds as they are
            assert any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in os.environ)
            assert "left as they are" in off.summary()
            return
        one = 3072 * 3072 * 4
        assert kept == one
        assert "stay in the process's heap" in off.summary()
        pages = 2 * one // resource.getpagesize()  # one temporary of each parameter a step
        assert sum(faults[2:]) < 3 * pages, (faults, pages)  # glibc's default heap: 4 * pages
    finally:
        off.remove()


# ---- activations saved for backward, kept under the same budget ----

@pytest.fixture
def stash_half_mib(monkeypatch):
    """Activations of 0.5 MiB or more are stashed (1 MiB by default): big_batches' then pass the
    budget at half the arithmetic that 1 MiB ones would take."""
    monkeypatch.setattr(_build, "_STASH_MIN", MiB // 2)


def big_batches(step: int) -> List[torch.Tensor]:
    """Batches whose activations (0.5 MiB a layer input, 8 MiB a forward) pass the 8 MiB budget
    beside the 8 MiB of weights."""
    g = torch.Generator().manual_seed(200 + step)
    return [torch.randn(256, 512, generator=g) for _ in range(4)]


@pytest.mark.parametrize("policy,micro,clip", [("plan", 1, 0.0), ("lru", 1, 0.0), ("plan", 4, 1.0)])
@pytest.mark.usefixtures("stash_half_mib")
def test_activations_are_kept_in_the_budget(policy, micro, clip):
    m = stack()
    ref = copy.deepcopy(m)
    off = train(m, ref, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9), big_batches, mse,
                budget="8MiB", micro=micro, clip=clip, policy=policy)
    h, st = off.stats()["offload"], off.stats()
    assert h["activations_stashed"] >= STEPS * micro * 8  # each Linear's input, at least
    assert h["activation_bytes"] >= STEPS * micro * 8 * (MiB // 2)
    assert st["bytes_d2h"]["total"] > 0  # they did not fit: written back to the host, read back in backward
    assert st["held"]["peak"] <= 8 << 20  # weights and activations, under the one budget
    assert "activations" in off.summary()
    finish(off, m, ref, big_batches(9)[0])


def test_activations_come_back_in_the_layout_they_were_saved_in():
    """Backward kernels pick their code path, and so the order of their sums, by the strides of
    what they read: the chunks of a projection given back contiguous made gradients that
    differed from resident ones in the last bits, and AdamW turns those into whole steps. The
    stash keeps the elements and gives backward their strides back: bitwise equal."""
    def model() -> nn.Sequential:
        torch.manual_seed(5)
        return nn.Sequential(*[GEGLU(128) for _ in range(6)])  # 4.5 MiB

    m, ref = model(), model()

    def batches(step: int) -> List[torch.Tensor]:  # 1 MiB chunks
        return [torch.randn(2, 256, 128, generator=torch.Generator().manual_seed(200 + step))]

    off = train(m, ref, lambda mod: torch.optim.AdamW(mod.parameters(), lr=1e-3, foreach=False), batches, mse,
                budget="4MiB")
    assert off.stats()["offload"]["activations_stashed"] >= STEPS * 6 * 2  # the two chunks of each layer, at least
    finish(off, m, ref, batches(9)[0])


def test_an_activation_the_budget_has_no_room_for_stays_pytorchs():
    """An activation larger than what the budget can hold beside the step's weights is left in
    PyTorch's memory, with one warning, instead of failing the step; so is the one at the same
    place of every later step. Training stays bitwise equal to resident."""
    def model() -> nn.Sequential:
        torch.manual_seed(6)
        return nn.Sequential(*[GEGLU(128) for _ in range(3)])  # 2.25 MiB

    m, ref = model(), model()

    def batches(step: int) -> List[torch.Tensor]:  # chunks of 2.34 MiB, in a 2 MiB budget
        return [torch.randn(2, 600, 128, generator=torch.Generator().manual_seed(300 + step))]

    with pytest.warns(UserWarning, match="does not fit the budget beside the weights") as seen:
        off = train(m, ref, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9), batches, mse,
                    budget="2MiB")
    assert seen[0].filename == models.__file__  # the line of the model's code that saved it
    h = off.stats()["offload"]
    assert h["activations_refused"] >= 3 and h["activations_refused"] == len(off._stash_refused)
    assert "left in PyTorch's memory" in off.summary()
    finish(off, m, ref, batches(9)[0])


class _Checkpointed(nn.Module):
    """A block run under torch.utils.checkpoint: backward calls it again (the recomputation)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.inner, x, use_reentrant=False)


@pytest.mark.usefixtures("stash_half_mib")
def test_activation_checkpointing():
    """Blocks under checkpoint: their recomputation in backward acquires the units again and
    everything stays bitwise equal to resident training with the same checkpointing, the
    weights moving; the inputs checkpoint keeps are its own (its hooks are innermost), so the
    offload stashes far fewer activations than without it."""
    def model(seed: int) -> nn.Sequential:
        flat = stack(seed)
        return nn.Sequential(*[_Checkpointed(nn.Sequential(flat[i], flat[i + 1], flat[i + 2], flat[i + 3]))
                               for i in range(0, len(flat), 4)])

    runs = {}
    for ckpt in (False, True):
        m = model(3) if ckpt else stack(3)
        ref = copy.deepcopy(m)
        off = train(m, ref, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9), big_batches,
                    mse, budget="8MiB", reacquires=not ckpt)
        runs[ckpt] = off.stats()["offload"]["activations_stashed"]
        finish(off, m, ref, big_batches(9)[0])
    assert runs[False] > 0 and runs[True] <= runs[False] // 2, runs


@pytest.mark.usefixtures("stash_half_mib")
def test_activation_buffers_are_made_once():
    """Each step saves the same activations: their buffers (and device blocks) are made in the
    first step and reused after, not made and destroyed per step; the results stay bitwise."""
    m = stack()
    ref = copy.deepcopy(m)
    opt, opt_ref = (torch.optim.SGD(x.parameters(), lr=0.05) for x in (m, ref))
    off = spt.offload(m, budget="8MiB", optimizer=opt, **EMU, train_on_device=0)
    made = []
    make = off.context.buffer
    off.context.buffer = lambda n, *a, **k: made.append(n) or make(n, *a, **k)  # type: ignore[method-assign]
    per_step, slots, diverged = [], [], []
    for step in range(4):
        before, stashed = len(made), off.stats()["offload"]["activations_stashed"]
        for model, o in ((m, opt), (ref, opt_ref)):
            mse(model, big_batches(step)[0]).backward()
            o.step()
            o.zero_grad()
        per_step.append((len(made) - before, off.stats()["offload"]["activations_stashed"] - stashed))
        slots.append([id(b) for b in off._stash_slots])
        diverged.append(off.context.stats()["plan_divergences"]["total"])
        assert_params_equal(m, ref)
    assert per_step[0][0] == per_step[0][1] > 0  # the first step makes one buffer per activation
    assert all(n == 0 and k == per_step[0][1] for n, k in per_step[1:]), per_step
    # the i-th activation of a step gets the buffer it had in the last step: the step's accesses
    # repeat, and the plan follows them
    assert all(s == slots[0] for s in slots[1:])
    assert diverged[-1] == diverged[1], diverged
    off.remove()


@pytest.mark.usefixtures("stash_half_mib")
def test_activations_off_stay_pytorchs():
    m = stack()
    ref = copy.deepcopy(m)
    off = train(m, ref, lambda mod: torch.optim.SGD(mod.parameters(), lr=0.05), big_batches, mse,
                budget="8MiB", activations=False)
    assert off.stats()["offload"]["activations_stashed"] == 0
    finish(off, m, ref, big_batches(9)[0])


@pytest.mark.usefixtures("stash_half_mib")
def test_activations_without_an_optimizer():
    """A frozen base with resident adapters: the step a forward opens ends at the next forward."""
    torch.manual_seed(0)
    base = stack().requires_grad_(False)
    head = nn.Linear(512, 512)
    ref_base, ref_head = copy.deepcopy(base), copy.deepcopy(head)
    off = spt.offload(base, budget="8MiB", activations=True, **EMU)
    for step in range(3):
        xs = []
        for b, h in ((base, head), (ref_base, ref_head)):
            h.zero_grad()
            x = big_batches(step)[0].requires_grad_()  # the base saves for backward only what x needs
            h(b(x)).square().mean().backward()
            xs.append(x.grad)
        assert torch.equal(head.weight.grad, ref_head.weight.grad) and torch.equal(xs[0], xs[1]), step
    assert off.stats()["offload"]["activations_stashed"] > 0
    off.remove()


def test_an_optimizer_holding_a_parameter_outside_the_model():
    m = stack()
    stray = nn.Parameter(torch.zeros(3, 3))
    check_refused(m, spillway.InvalidArgument, r"parameter group 1, parameter 0 is a \(3, 3\) tensor that is not a "
                  "parameter of Sequential",
                  optimizer=torch.optim.SGD([{"params": m.parameters()}, {"params": [stray]}], lr=0.1))


def test_an_optimizer_holding_frozen_parameters_of_the_model_skips_them():
    """AdamW(model.parameters()) over a model with frozen parts (Whisper's positions, a frozen
    encoder): torch's optimizers skip a parameter without a gradient, and so does the offload,
    which streams the frozen ones as frozen weights."""
    m = stack()
    m[2].requires_grad_(False)
    m[10].weight.requires_grad_(False)
    ref = copy.deepcopy(m)
    frozen = {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad}
    off = train(m, ref, lambda mod: torch.optim.AdamW(mod.parameters(), lr=1e-3), stack_batches, mse)
    assert off.optimizer.param_groups[0]["params"][2] is m[2].weight  # in the optimizer, frozen
    assert all(torch.equal(dict(m.named_parameters())[n], v) for n, v in frozen.items())
    finish(off, m, ref, stack_batches(9)[0])


def test_an_optimizer_for_a_model_with_nothing_trainable():
    m = stack().requires_grad_(False)
    check_refused(m, spillway.InvalidArgument, "no parameter of Sequential requires grad",
                  optimizer=torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))


def test_an_optimizer_that_is_not_an_optimizer():
    m = stack()
    check_refused(m, spillway.InvalidArgument, "optimizer must be a torch.optim.Optimizer, got list",
                  optimizer=list(m.parameters()))


def test_an_optimizer_with_offload_trainable_false():
    m = stack()
    check_refused(m, spillway.ConfigError, "cannot go with offload_trainable=False",
                  optimizer=torch.optim.SGD(m.parameters(), lr=0.1), offload_trainable=False)


def test_an_optimizer_for_several_modules():
    a, b = stack(), stack(1)
    with pytest.raises(spillway.InvalidArgument, match="optimizer= trains one nn.Module"):
        spt.offload([a, b], budget="4MiB", optimizer=torch.optim.SGD(a.parameters(), lr=0.1), **EMU)
    assert all("forward" not in s.__dict__ for s in list(a.modules()) + list(b.modules()))


def test_without_an_optimizer_a_trainable_model_is_offloaded_for_inference():
    m = stack()
    off = spt.offload(m, budget="4MiB", **EMU)
    assert off.optimizer is None and not any(u.trains for u in off.units)
    y = moved(off, lambda: m(stack_batches(0)[0]))
    with pytest.raises(RuntimeError, match="offloaded for inference.*or pass optimizer="):
        y.sum().backward()
    off.remove()
    assert all(p.grad is None for p in m.parameters())


def test_trained_weights_are_units_small_enough_to_stream():
    """Each optimizer step makes the device copies of trained weights stale, so they cross the
    link every step whatever the budget: a budget that would take the whole model as one unit
    still gets units of at most a sixteenth of it (one a layer here: a Linear is not split), which the plan can upload
    while the one before computes."""
    m = stack()
    ref = copy.deepcopy(m)
    frozen = spt.offload(copy.deepcopy(m).requires_grad_(False), budget="64MiB", **EMU)
    assert len(frozen.units) <= 2  # inference: a few large units, uploaded once
    frozen.remove()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    off = spt.offload(m, budget="64MiB", optimizer=opt, **EMU, train_on_device=0)
    layer = sum(p.numel() * p.element_size() for p in ref[0].parameters())  # a Linear is not split
    assert len(off.units) >= 8 and max(u.nbytes for u in off.units) <= layer
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(2):
        for model, o in ((m, opt), (ref, opt_ref)):
            mse(model, stack_batches(step)[0]).backward()
            o.step()
            o.zero_grad()
    assert_params_equal(m, ref)
    off.remove()


class _MixedBlock(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.n, self.a, self.up, self.dn = nn.LayerNorm(d), nn.Linear(d, d), nn.Linear(d, f), nn.Linear(f, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.a(self.n(x))
        return h + self.dn(torch.nn.functional.silu(self.up(h)))


def test_prefetch_never_waits_for_a_trim_while_training():
    """Training with prefetch on (as on a GPU), activations and units of several sizes at a budget
    below them: a prefetch whose room only a trim would give (a host wait for the device) is
    declined, so once the plan follows the step no step trims; the results stay bitwise."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 256), *[_MixedBlock(256, 704) for _ in range(3)], nn.Linear(256, 64))
    ref = copy.deepcopy(m)
    opt, opt_ref = (torch.optim.SGD(x.parameters(), lr=0.01) for x in (m, ref))
    off = spt.offload(m, budget="6MiB", optimizer=opt, backend="emu", prefetch="on", emu_link_gbps=200, train_on_device=0)
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(5))
    trims = []
    h2d0 = off.context.stats()["bytes_h2d"]["total"]
    for step in range(8):
        before = off.context.stats()["trim_syncs"]["total"]
        for model, o in ((m, opt), (ref, opt_ref)):
            model(x).square().mean().backward()
            o.step()
            o.zero_grad()
        trims.append(off.context.stats()["trim_syncs"]["total"] - before)
    assert_params_equal(m, ref)
    # the weights (5.0 MiB) and activations do not fit 6 MiB: they move every step
    assert off.stats()["offload"]["activations_stashed"] > 0
    assert off.context.stats()["bytes_h2d"]["total"] - h2d0 > 8 * 4 * 2**20
    assert sum(trims[1:]) == 0, trims
    off.remove()


@pytest.mark.parametrize("pattern", ["sizes", "frozen-prefix", "accumulation"])
@pytest.mark.usefixtures("stash_half_mib")
def test_activations_whose_pattern_changes_step_to_step(pattern):
    """The activations a step stashes change from step to step: batches of other sizes, a part
    of the model run under no_grad first (fewer activations saved), a varying number of
    micro-batches. The plan learns each step's buffers anew (a buffer written first in one
    step may be read in a later one) and never reads dropped contents; with prefetch on, as on
    a GPU, everything stays bitwise equal to resident training, the activations moving."""
    m = stack()
    ref = copy.deepcopy(m)
    opt, opt_ref = (torch.optim.SGD(x.parameters(), lr=0.05, momentum=0.9) for x in (m, ref))
    off = spt.offload(m, budget="8MiB", optimizer=opt, backend="emu", train_on_device=0, policy="plan",
                      prefetch="on", emu_link_gbps=200)
    for step in range(6):
        for model, o in ((m, opt), (ref, opt_ref)):
            g = torch.Generator().manual_seed(300 + step)
            if pattern == "sizes":
                mse(model, torch.randn([256, 32, 384, 150][step % 4], 512, generator=g)).backward()
            elif pattern == "frozen-prefix":
                k = 2 * (step % 4 + 1)
                with torch.no_grad():
                    h = model[:k](torch.randn(256, 512, generator=g))
                model[k:](h).square().mean().backward()
            else:
                for j in range(step % 3 + 1):
                    mse(model, torch.randn([256, 128, 320][j], 512, generator=g)).backward()
            o.step()
            o.zero_grad()
        assert_params_equal(m, ref)
    assert off.stats()["offload"]["activations_stashed"] > 0
    assert off.context.stats()["bytes_d2h"]["total"] > 0  # they did not all fit: written back and read again
    finish(off, m, ref, big_batches(9)[0])


@pytest.mark.parametrize("overlap", [False, True])
def test_the_step_renews_units_without_displacing_them(overlap):
    """The C step (also beside the next forward) uploads each unit it updated into the room its
    stale copy left, and never makes room: the units are renewed in the forward's order, so
    making room would push out those renewed just before, which the forward needs first. So
    the step uploads at most the budget, and with the next forward little more than the
    offloaded bytes once; the backward finds the forward's last units still there."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 512)) for _ in range(8)])
    ref = copy.deepcopy(m)
    opt, opt_ref = (torch.optim.AdamW(x.parameters(), lr=1e-3) for x in (m, ref))
    # no prefetch worker: its uploads (and the room its evictions free) would land in the step's
    # window as the host's load times them, and the window's counts are to be the step's own
    off = spt.offload(m, budget="6MiB", optimizer=opt, backend="emu", train_on_device=0, prefetch="off",
                      emu_link_gbps=200, activations=False, overlap_update=overlap)
    offloaded = sum(u.nbytes for u in off.units)
    assert offloaded > 2 * (6 << 20)
    h2d = lambda: off.context.stats()["bytes_h2d"]["total"]  # noqa: E731
    renewed = 0  # the previous step's renewals (step 0 has none before it)
    for step in range(4):
        x = torch.randn(256, 512, generator=torch.Generator().manual_seed(step))
        for model, o in ((m, opt), (ref, opt_ref)):
            before_fwd = h2d()
            loss = model(x).square().mean()
            fwd = h2d() - before_fwd
            loss.backward()
            bwd = h2d() - before_fwd - fwd
            before_step = h2d()
            o.step()
            o.zero_grad()
            if model is m:
                off.synchronize()  # overlap_update: the update (and its uploads) done
                stepped = h2d() - before_step
                assert 0 < stepped <= 6 << 20, stepped
                if step:
                    # the renewed units are used where they are: the rest come in the forward
                    assert renewed + fwd <= 1.25 * offloaded, (renewed, fwd, offloaded)
                    # the step spans forward and backward, so the plan keeps the forward's last
                    # units for the backward, which starts with them
                    assert bwd <= 0.8 * offloaded, (bwd, offloaded)
                renewed = stepped
        assert_params_equal(m, ref)
    off.remove()


class _Adapted(nn.Module):
    """A frozen quantized linear layer with a trainable low-rank adapter beside it (QLoRA)."""

    def __init__(self, n: int, r: int = 8) -> None:
        super().__init__()
        self.base = wrapped_linear(n).requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, n) * 0.01)
        self.b = nn.Parameter(torch.randn(n, r) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.gelu(self.base(x) + x @ self.a.t() @ self.b.t())


def test_adapters_on_a_quantized_base_of_a_wrapper_subclass_train_as_resident():
    """QLoRA's shape with torchao's kind of quantized weight: the int8 base streams under the
    budget, the adapters train; losses and adapters bitwise equal to resident training."""
    torch.manual_seed(0)
    ref = nn.Sequential(*[_Adapted(1024) for _ in range(12)])  # 12 MiB of int8 base
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dequantized weights saved for backward find no room
        off = spt.offload(model, budget="6MiB", backend="emu", vmm="on", optimizer=opt)
        assert 12 * MiB < offloaded_bytes(off) < 13 * MiB
        for _ in range(4):
            x = torch.randn(4, 1024)
            loss = moved(off, lambda: model(x).square().mean())
            want = ref(x).square().mean()
            assert torch.equal(loss, want)
            for o, l in ((opt, loss), (ref_opt, want)):
                l.backward()
                o.step()
                o.zero_grad()
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.requires_grad:
            assert torch.equal(p, q), n
    off.remove()
