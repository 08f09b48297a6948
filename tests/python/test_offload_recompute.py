"""offload(recompute=...) on the emu backend: blocks' activations recomputed in the backward
(torch.utils.checkpoint around each block's forward), the training state kept whole on the
device when it fits beside them, and the learning of recompute="auto"."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import spillway.torch as spt
from spillway.errors import ConfigError
from spillway.torch import _recompute
from models import make_decoder, moved

EMU = dict(backend="emu")


class Blocks(nn.Module):
    """A ModuleList of 8 blocks of 1 MiB (Linear 512 x 512 and tanh), a head outside it."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(8))
        self.head = nn.Linear(512, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def count_calls(m: Blocks) -> list:
    """The number of times each block's Linear runs, kept in a list (a forward hook each)."""
    calls = [0]
    for b in m.blocks:
        b[0].register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def batch(step: int) -> torch.Tensor:
    return torch.randn(4, 512, generator=torch.Generator().manual_seed(200 + step))


def assert_params_equal(m: nn.Module, ref: nn.Module) -> None:
    for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("train_on_device", [0, "auto"])
def test_recomputed_blocks_train_as_resident(train_on_device):
    """recompute=True: every block's forward runs again in the backward (each Linear twice a
    step), nothing of it is kept for backward, and 5 steps of AdamW equal the resident run
    bitwise; with every parameter offloaded (train_on_device=0) the weights move each step."""
    m = Blocks()
    ref = copy.deepcopy(m)
    calls = count_calls(m)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    off = spt.offload(m, budget="4MiB" if train_on_device == 0 else "48MiB", optimizer=opt, recompute=True,
                      train_on_device=train_on_device, **EMU)
    for step in range(5):
        x = batch(step)
        calls[0] = 0
        if train_on_device == 0:
            loss = moved(off, lambda: m(x).square().mean())
        else:
            loss = m(x).square().mean()
        want = ref(x).square().mean()
        assert torch.equal(loss, want)
        loss.backward()
        want.backward()
        assert calls[0] == 16  # 8 in the forward, 8 recomputed in the backward
        opt.step()
        opt_ref.step()
        opt.zero_grad()
        opt_ref.zero_grad()
    assert_params_equal(m, ref)
    h = off.stats()["offload"]
    assert h["blocks_recomputed"] == 5 * 8 and h["blocks_kept"] == 0
    assert "recompute         True: every block; 40 block forwards recomputed" in off.summary()
    if train_on_device == "auto":  # the state takes 5 x 8.0 MiB of 48 MiB: all of it on the device
        assert off.units == [] and len(off._trainable) == len(list(m.parameters()))
        assert "offloaded         nothing: every parameter is trained on the device" in off.summary()
    off.remove()
    assert all("forward" not in b.__dict__ for b in m.blocks)
    assert_params_equal(m, ref)


def test_train_on_device_auto_keeps_everything_only_with_recompute():
    """The same budget without recompute keeps at most 70% of it at 5 bytes a byte."""
    m = Blocks()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    off = spt.offload(m, budget="48MiB", optimizer=opt, **EMU)
    assert off.units  # not everything fits AUTO_SHARE: some of the parameters stream
    off.remove()


def test_recompute_in_inference_and_without_an_optimizer():
    """No grad: no recomputation. Adapters trained by the user's own optimizer on an offloaded
    frozen decoder (no optimizer=): the layers recomputed, gradients equal to resident."""
    base = make_decoder(layers=6, dim=256)
    for p in base.parameters():
        p.requires_grad_(False)
    base.layers[2].attn.out.weight.requires_grad_(True)  # one trainable weight, kept resident
    ref = copy.deepcopy(base)
    off = spt.offload(base, budget="8MiB", recompute=True, **EMU)
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(base(ids)[0], ref(ids)[0])
    assert off.stats()["offload"]["blocks_recomputed"] == 0
    for _ in range(2):
        loss, want = base(ids)[0].square().mean(), ref(ids)[0].square().mean()
        assert torch.equal(loss, want)
        loss.backward()
        want.backward()
    w, wr = base.layers[2].attn.out.weight, ref.layers[2].attn.out.weight
    assert torch.equal(w.grad, wr.grad)
    assert off.stats()["offload"]["blocks_recomputed"] == 2 * 6
    off.remove()


def test_auto_recomputes_every_block_where_it_cannot_read_the_device():
    m = Blocks()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    off = spt.offload(m, budget="4MiB", optimizer=opt, recompute="auto", train_on_device=0, **EMU)
    for step in range(3):
        m(batch(step)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    h = off.stats()["offload"]
    assert h["blocks_recomputed"] == 24 and h["blocks_kept"] == 0
    off.remove()


@pytest.mark.parametrize("uploads", [None, "first", "little", "every"])
def test_auto_learns_to_keep_what_fits(uploads):
    """The controller with a device it can read, played on the host: a block's forward leaves
    100 bytes allocated when it keeps its activations, 10 (its output) when it runs under
    checkpoint, and its recomputation in the backward 100 while it runs; the step's peak is
    where the forward ended plus 300. Under a limit of 1000 the first step recomputes every
    block; the second keeps as many as the peak leaves room for (6: the forward ends at 620,
    the peak at 920, under 1000 less 5%), and the choice holds. With offloaded weights sharing
    the limit (use_allocator): uploads in the first step only (the weights fit), or of less
    than a 64th of the limit a step (small tensors pushed out and back), change nothing;
    uploads in every step (the weights stream) turn keeping off after the second step, for
    good."""
    mem, up = [0], [0]
    counter = None if uploads is None else lambda: up[0]
    rec = _recompute.Recompute("auto", 1000, lambda: None, lambda: mem[0] + 300, lambda: mem[0], counter)
    blocks = [nn.Linear(4, 4) for _ in range(8)]

    def inner_for(b):
        def inner(x):
            mem[0] += 10 if rec.in_forward else 100
            return b(x)
        return inner

    wrapped = [rec.wrap(b, inner_for(b)) for b in blocks]
    kept, peaks = [], []
    for step in range(_recompute.LEARN_STEPS + 2):
        mem[0] = 0
        x = torch.randn(2, 4, requires_grad=True)
        for b, f in zip(blocks, wrapped):
            x = f(b, x)
        kept.append(rec.last_kept)
        end = mem[0]
        x.sum().backward()  # the recomputations
        mem[0] = end
        peaks.append(end + 300)
        if uploads == "every" or (uploads == "first" and step == 0):
            up[0] += 4096
        elif uploads == "little":
            up[0] += 1000 // _recompute.STREAM_FRACTION
        rec.step_done()
    if uploads == "every":
        assert kept == [0, 6] + [0] * (len(kept) - 2) and rec.streams and rec.limit is None
        assert rec.recomputed == 8 + 2 + 8 * (len(kept) - 2)
        return
    assert kept == [0] + [6] * (len(kept) - 1) and not rec.streams
    assert peaks[0] == 380 and all(p <= 950 for p in peaks)
    assert rec.activation == 100 and rec.recomputed == 8 + 2 * (len(kept) - 1)


@pytest.mark.parametrize("value", ["sometimes", 2, 0.5])
def test_bad_recompute_values(value):
    m = Blocks()
    snap = {n: p.detach().clone() for n, p in m.named_parameters()}
    with pytest.raises(ConfigError, match="recompute must be True, False or 'auto'"):
        spt.offload(m, budget="4MiB", recompute=value, **EMU)
    assert all(torch.equal(p, snap[n]) for n, p in m.named_parameters())
    assert all("forward" not in b.__dict__ for b in m.blocks)


def test_a_model_that_recomputes_itself():
    m = Blocks()
    m.is_gradient_checkpointing = True  # as transformers' models report gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match="recomputes its layers itself"):
        spt.offload(m, budget="4MiB", recompute=True, **EMU)
    off = spt.offload(m, budget="4MiB", recompute="auto", **EMU)  # left to the model
    assert off._recompute is None
    off.remove()
    # "auto" changes nothing then: with optimizer= the activations stash keeps its default (on)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    off = spt.offload(m, budget="4MiB", optimizer=opt, recompute="auto", **EMU)
    assert off._recompute is None and off._stash_min is not None
    off.remove()


def test_recompute_defaults_to_auto_when_training_under_use_allocator():
    """Without recompute=: "auto" where optimizer= trains under use_allocator (one budget over
    PyTorch's activations too), off elsewhere and for inference; an explicit value stands. The
    default's training equals resident's."""
    from spillway.torch import _alloc
    _alloc._shutdown()
    try:
        m = Blocks().requires_grad_(False)
        off = spt.offload(m, budget="4MiB", **EMU)
        assert off._recompute is None
        off.remove()
        m = Blocks()
        off = spt.offload(m, budget="4MiB", optimizer=torch.optim.SGD(m.parameters(), lr=0.1), **EMU)
        assert off._recompute is None  # no use_allocator: none
        off.remove()
        spt.use_allocator("24MiB", backend="emu", emu_capacity="256MiB")
        m = Blocks()
        off = spt.offload(m, recompute=False, optimizer=torch.optim.SGD(m.parameters(), lr=0.1), **EMU)
        assert off._recompute is None
        off.remove()
        m, ref = Blocks(), Blocks()
        calls = count_calls(m)
        opt, ref_opt = torch.optim.AdamW(m.parameters(), lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3)
        off = spt.offload(m, optimizer=opt, **EMU)
        assert off._recompute is not None and off._recompute.mode == "auto"
        for step in range(2):
            for model, o in ((m, opt), (ref, ref_opt)):
                model(batch(step)).square().mean().backward()
                o.step()
                o.zero_grad()
        assert calls[0] == 2 * 8 * 2  # the emulated backend: "auto" recomputes every block
        off.remove()
        assert_params_equal(m, ref)
    finally:
        a = spt.current()
        if a is not None:
            a.close()
        _alloc._shutdown()
