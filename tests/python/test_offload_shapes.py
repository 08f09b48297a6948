"""offload() with default arguments on models that are not a uniform decoder stack (emu): a UNet
with skip connections and one block larger than the budget, a DiT with two block lists, an
encoder-decoder, a three-module pipeline under one budget, and a model none of whose weights is
frozen. Outputs bitwise equal to the resident model; the weights really move; plan's bytes moved
per steady step at most 1.15 x (offloaded bytes - budget + largest unit). The default budget is
the emulated device's free memory less offload()'s reserve (emu_capacity sizes the device)."""
from __future__ import annotations

import contextlib
import copy
from typing import List

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils import parametrize
from torch.nn.utils.weight_norm import WeightNorm

import spillway
import spillway.torch as spt
from models import NestedInt8, QuantLinear, QuantParam, SavingLinear, WrappedInt8, moved, offloaded_bytes, wrapped_linear

MiB = 1 << 20


def steady_bound(off) -> float:
    total = offloaded_bytes(off)
    return 1.15 * (total - off.context.budget + max(u.nbytes for u in off.units))


def run_steps(off, fn, steps: int = 10):
    """fn() `steps` times (each a plan step), the weights moving in each; returns the last
    output and the mean bytes uploaded per step over the second half (the steady steps)."""
    per_step = []
    out = None
    for _ in range(steps):
        before = off.context.stats()["bytes_h2d"]["total"]
        out = moved(off, fn)
        per_step.append(off.context.stats()["bytes_h2d"]["total"] - before)
    steady = per_step[steps // 2:]
    return out, sum(steady) / len(steady)


# ---- a UNet: skip connections, one up block larger than the budget ----

class Res(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(8, cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.time = nn.Linear(temb, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, t):
        h = self.conv1(F.silu(self.norm(x))) + self.time(t)[:, :, None, None]
        return self.skip(x) + self.conv2(F.silu(h))


class Down(nn.Module):
    def __init__(self, cin: int, cout: int, temb: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([Res(cin, cout, temb), Res(cout, cout, temb)])
        self.down = nn.Conv2d(cout, cout, 3, stride=2, padding=1)

    def forward(self, x, t):
        skips = []
        for r in self.resnets:
            x = r(x, t)
            skips.append(x)
        return self.down(x), skips


class Up(nn.Module):
    def __init__(self, cin: int, cskip: int, cout: int, temb: int) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([Res(cin + cskip, cout, temb), Res(cout + cskip, cout, temb)])
        self.up = nn.Conv2d(cout, cout, 3, padding=1)

    def forward(self, x, skips, t):
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        for r in self.resnets:
            x = r(torch.cat([x, skips.pop()], 1), t)
        return self.up(x)


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        temb = 256
        self.time_embedding = nn.Sequential(nn.Linear(64, temb), nn.SiLU(), nn.Linear(temb, temb))
        self.conv_in = nn.Conv2d(4, 128, 3, padding=1)
        self.down_blocks = nn.ModuleList([Down(128, 128, temb), Down(128, 256, temb)])
        self.mid_block = Res(256, 256, temb)
        self.up_blocks = nn.ModuleList([Up(256, 256, 384, temb), Up(384, 128, 128, temb)])  # the first: ~30 MiB
        self.conv_out = nn.Conv2d(128, 4, 3, padding=1)

    def forward(self, x, t):
        t = self.time_embedding(t)
        x = self.conv_in(x)
        stack: List[List[torch.Tensor]] = []
        for d in self.down_blocks:
            x, skips = d(x, t)
            stack.append(skips)
        x = self.mid_block(x, t)
        for u in self.up_blocks:
            x = u(x, stack.pop(), t)
        return self.conv_out(x)


def test_unet_with_a_block_larger_than_the_budget():
    torch.manual_seed(0)
    m = UNet().eval().requires_grad_(False)
    ref = copy.deepcopy(m)
    x, t = torch.randn(2, 4, 16, 16), torch.randn(2, 64)
    off = spt.offload(m, emu_capacity="48MiB", backend="emu")  # no budget: free memory less the reserve
    budget = off.context.budget
    assert off.budget_source == "default" and budget == 24 * MiB
    up0 = sum(p.numel() * 4 for p in m.up_blocks[0].parameters())
    assert up0 > budget  # a whole up block would not fit: it was split
    assert not any(u.name == "up_blocks.0" for u in off.units)
    assert any(u.name.startswith("up_blocks.0.resnets") for u in off.units)
    with torch.no_grad():
        out, last = run_steps(off, lambda: m(x, t))
    assert torch.equal(out, ref(x, t))
    assert last <= steady_bound(off), (last, steady_bound(off))
    text = off.summary()
    assert "units" in text and "free memory" in text
    assert "device memory     pages" in text  # units of many sizes: not a stack
    off.remove()


@pytest.mark.parametrize("ring", ["on", "off"])
def test_a_unet_under_a_static_split_streams_its_units_through_a_ring(ring):
    """pipeline="split" (named, untimed) with ring="on": the streamed units of the UNet, of many
    sizes, go through the split's room in turn (ring uploads every step, the same number each
    steady step, no trim); outputs stay equal to the resident model's and the weights move. Off,
    the same split places none so."""
    torch.manual_seed(0)
    m = UNet().eval().requires_grad_(False)
    ref = copy.deepcopy(m)
    x, t = torch.randn(2, 4, 16, 16), torch.randn(2, 64)
    off = spt.offload(m, budget="24MiB", backend="emu", vmm="on", prefetch="on", pipeline="split", ring=ring,
                      emu_link_gbps=20)
    assert "device memory     pages" in off.summary()
    rings, trims = [], []
    with torch.no_grad():
        want = ref(x, t)
        for _ in range(8):
            st0 = off.context.stats()
            assert torch.equal(moved(off, lambda: m(x, t)), want)
            st = off.context.stats()
            rings.append(st["ring_uploads"]["total"] - st0["ring_uploads"]["total"])
            trims.append(st["trim_syncs"]["total"] - st0["trim_syncs"]["total"])
    assert "pipeline static split, as named" in off.summary()
    if ring == "on":
        steady = rings[-4:]
        assert steady[0] >= 2 and all(n == steady[0] for n in steady), rings
        assert not any(trims[-4:]), trims
    else:
        assert not any(rings), rings
    assert off.context.stats()["held"]["peak"] <= off.context.budget
    off.remove()


# ---- a DiT with two block lists ----

class Attention(nn.Module):
    def __init__(self, d: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        att = torch.einsum("bqhd,bkhd->bhqk", q, k).softmax(-1)
        return self.out(torch.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, n, d))


class DoubleBlock(nn.Module):
    """Image and text streams, modulated by the conditioning, attending jointly."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.mod_img, self.mod_txt = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d)
        self.attn = Attention(d)
        self.mlp_img = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.mlp_txt = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, img, txt, c):
        si, bi = self.mod_img(c)[:, None].chunk(2, -1)
        st, bt = self.mod_txt(c)[:, None].chunk(2, -1)
        joint = torch.cat([txt * (1 + st) + bt, img * (1 + si) + bi], 1)
        a = self.attn(joint)
        txt, img = txt + a[:, :txt.shape[1]], img + a[:, txt.shape[1]:]
        return img + self.mlp_img(img), txt + self.mlp_txt(txt)


class SingleBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.scale_shift_table = nn.Parameter(torch.randn(2, d) * 0.1)  # read by the block itself
        self.attn = Attention(d)
        self.proj = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d))

    def forward(self, x, c):
        s, b = self.scale_shift_table.unbind(0)
        return x + self.proj(self.attn(x * (1 + s) + b + c[:, None]))


class DiT(nn.Module):
    def __init__(self, d: int = 512) -> None:
        super().__init__()
        self.x_embedder = nn.Linear(16, d)
        self.context_embedder = nn.Linear(32, d)
        self.time_embed = nn.Sequential(nn.Linear(32, d), nn.SiLU(), nn.Linear(d, d))
        self.transformer_blocks = nn.ModuleList(DoubleBlock(d) for _ in range(3))
        self.single_transformer_blocks = nn.ModuleList(SingleBlock(d) for _ in range(6))
        self.norm_out = nn.LayerNorm(d)
        self.proj_out = nn.Linear(d, 16)

    def forward(self, x, txt, t):
        c = self.time_embed(t)
        img, txt = self.x_embedder(x), self.context_embedder(txt)
        for b in self.transformer_blocks:
            img, txt = b(img, txt, c)
        h = torch.cat([txt, img], 1)
        for b in self.single_transformer_blocks:
            h = b(h, c)
        return self.proj_out(self.norm_out(h[:, txt.shape[1]:]))


def test_dit_with_two_block_lists():
    torch.manual_seed(0)
    m = DiT().eval().requires_grad_(False)
    ref = copy.deepcopy(m)
    x, txt, t = torch.randn(2, 16, 16), torch.randn(2, 8, 32), torch.randn(2, 32)
    off = spt.offload(m, emu_capacity="96MiB", backend="emu", vmm="on")  # 48 MiB for 84 MiB of weights
    names = [u.name for u in off.units]
    # in pages (in plain segments, the default for this stack, see below) both block lists are units block by block (a double block, above a quarter of the budget,
    # in a few parts), not one list of blocks and every other module a unit of its own
    single = [n for n in names if n.startswith("single_transformer_blocks.")]
    assert 1 <= len(single) <= 6 and not any(".attn" in n or ".proj" in n for n in single)  # whole blocks
    assert 3 <= sum(n.startswith("transformer_blocks.") for n in names) <= 12
    assert len(off.units) <= 24
    with torch.no_grad():
        out, last = run_steps(off, lambda: m(x, txt, t))
    assert torch.equal(out, ref(x, txt, t))
    assert last <= steady_bound(off), (last, steady_bound(off))
    off.remove()



@pytest.mark.parametrize("given", ["keyword", "SPILLWAY_CONF", "default"])
def test_dit_in_plain_segments_streams_smaller_units(given, monkeypatch):
    """vmm="off" (a keyword, or in SPILLWAY_CONF, or chosen by offload() for a stack, as a DiT's
    two block lists are): the plan's static split streams every unit through two blocks of the
    largest unit's size, so the partition keeps units to a sixteenth of the budget (a quarter
    otherwise): the double blocks, and the single blocks' attentions, come in parts."""
    torch.manual_seed(0)
    m = DiT().eval().requires_grad_(False)
    ref = copy.deepcopy(m)
    x, txt, t = torch.randn(2, 16, 16), torch.randn(2, 8, 32), torch.randn(2, 32)
    budget = 48 * MiB
    pages = spt.offload(m, budget=budget, backend="emu", vmm="on")
    largest_pages = max(u.nbytes for u in pages.units)
    assert "pages" in pages.summary()
    pages.remove()
    if given == "keyword":
        off = spt.offload(m, budget=budget, backend="emu", vmm="off")
    elif given == "default":
        off = spt.offload(m, budget=budget, backend="emu")
        assert "plain segments (chosen: the units are a stack's and stream)" in off.summary()
    else:
        monkeypatch.setenv("SPILLWAY_CONF", "policy=plan, vmm = off")
        off = spt.offload(m, budget=budget, backend="emu")
    assert max(u.nbytes for u in off.units) <= budget // 16 < largest_pages
    assert not any(u.name.startswith("transformer_blocks.") and u.name.count(".") == 1 for u in off.units)
    with torch.no_grad():
        out, last = run_steps(off, lambda: m(x, txt, t))
    assert torch.equal(out, ref(x, txt, t))
    assert last <= steady_bound(off), (last, steady_bound(off))
    off.remove()


def test_the_arena_mode_is_chosen_only_for_a_stack_that_streams(monkeypatch):
    """Plain segments only where the units stream, are a stack's, and no option names the mode:
    the same DiT keeps pages when its budget holds it, when its pages are named, under an
    optimizer (training), and through a pipeline's shared context; a_stack reads the sizes."""
    from spillway.torch import _partition
    assert _partition.a_stack([8] * 10 + [3] * 2 + [1])  # layers, embedding and head, a norm
    assert _partition.a_stack([6] * 19 + [3] * 38 + [1, 1])  # two block lists
    assert not _partition.a_stack([1, 2, 3, 4, 5, 6, 7, 8])  # a UNet's many sizes
    assert not _partition.a_stack([])
    torch.manual_seed(0)
    m = DiT().eval().requires_grad_(False)
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    cases = {"fits": dict(budget=2 * total), "pages named": dict(budget=48 * MiB, vmm_large_page="2MiB")}
    for what, kw in cases.items():
        off = spt.offload(m, backend="emu", **kw)
        assert "device memory     pages" in off.summary(), what
        off.remove()
    monkeypatch.setenv("SPILLWAY_CONF", "vmm_large_page=2MiB")
    off = spt.offload(m, budget=48 * MiB, backend="emu")
    assert "device memory     pages" in off.summary()
    off.remove()
    monkeypatch.delenv("SPILLWAY_CONF")
    trained = copy.deepcopy(m).requires_grad_(True)
    off = spt.offload(trained, budget=48 * MiB, backend="emu", optimizer=torch.optim.SGD(trained.parameters(), lr=0.1),
                      train_on_device=0, activations=False)
    assert "device memory     pages" in off.summary()
    off.remove()
    pipe = spt.offload([m], budget=48 * MiB, backend="emu")
    assert all("device memory     pages" in o.summary() for o in pipe)
    pipe.remove()

# ---- an encoder-decoder ----

class EncLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn, self.norm = Attention(d), nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 6 * d), nn.ReLU(), nn.Linear(6 * d, d))  # 4 MiB a layer at d=256

    def forward(self, x):
        x = x + self.attn(self.norm(x))
        return x + self.ff(x)


class DecLayer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.self_attn, self.norm = Attention(d), nn.LayerNorm(d)
        self.cross_q, self.cross_kv = nn.Linear(d, d), nn.Linear(d, 2 * d)
        self.ff = nn.Sequential(nn.Linear(d, 4608 * d // 1024), nn.ReLU(), nn.Linear(4608 * d // 1024, d))

    def forward(self, y, mem):
        y = y + self.self_attn(self.norm(y))
        k, v = self.cross_kv(mem).chunk(2, -1)
        y = y + torch.einsum("bqk,bkd->bqd", (self.cross_q(y) @ k.transpose(1, 2)).softmax(-1), v)
        return y + self.ff(y)


class EncDec(nn.Module):
    def __init__(self, d: int = 256, vocab: int = 4096) -> None:
        super().__init__()
        self.shared = nn.Embedding(vocab, d)
        self.encoder = nn.ModuleList(EncLayer(d) for _ in range(4))
        self.decoder = nn.ModuleList(DecLayer(d) for _ in range(4))
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, src, tgt):
        mem = self.shared(src)
        for layer in self.encoder:
            mem = layer(mem)
        y = self.shared(tgt)
        for layer in self.decoder:
            y = layer(y, mem)
        return self.lm_head(y)


def test_encoder_decoder():
    torch.manual_seed(0)
    m = EncDec().eval().requires_grad_(False)
    ref = copy.deepcopy(m)
    src, tgt = torch.randint(0, 4096, (2, 9)), torch.randint(0, 4096, (2, 5))
    off = spt.offload(m, emu_capacity="40MiB", backend="emu")
    assert sum(e.tensor is m.shared.weight for u in off.units for e in u.entries) == 1  # used twice, stored once
    with torch.no_grad():
        out, last = run_steps(off, lambda: m(src, tgt))
    assert torch.equal(out, ref(src, tgt))
    assert last <= steady_bound(off), (last, steady_bound(off))
    off.remove()


# ---- a model used through a method other than forward (a VAE's decode) ----

# ---- a mixture of experts in a ModuleList: only the experts the router picks move ----

class Expert(nn.Module):
    def __init__(self, d: int, f: int) -> None:
        super().__init__()
        self.up, self.gate, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class SparseMoE(nn.Module):
    """Mixtral's block as transformers 4 wrote it: top-2 routing, experts a ModuleList, only the
    experts some token is routed to called."""

    def __init__(self, d: int, f: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList([Expert(d, f) for _ in range(experts)])
        self.routed: List[int] = []  # the experts the last call ran

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.router(x).softmax(-1).topk(2, dim=-1)
        out = torch.zeros_like(x)
        self.routed = sorted(set(idx.flatten().tolist()))
        for e in self.routed:
            tok, k = torch.where(idx == e)
            out.index_add_(0, tok, self.experts[e](x[tok]) * w[tok, k, None])
        return out


class MoEModel(nn.Module):
    def __init__(self, layers: int = 4, d: int = 256, f: int = 512, experts: int = 8) -> None:
        super().__init__()
        self.attn = nn.ModuleList([nn.Linear(d, d) for _ in range(layers)])
        self.moe = nn.ModuleList([SparseMoE(d, f, experts) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for a, m in zip(self.attn, self.moe):
            x = x + a(x)
            x = x + m(x)
        return x


@pytest.mark.parametrize("policy", ["plan", "lru"])
def test_a_mixture_of_experts_moves_only_the_routed_experts(policy):
    """The block picks its experts by index (self.experts[e]), so no unit holds two of them,
    even where two would make a run of the usual size: a decoded token brings up the two
    experts per layer its router picks, not the layer's eight (a quarter of the experts'
    bytes), with the outputs equal."""
    torch.manual_seed(0)
    m = MoEModel().requires_grad_(False)  # 32 experts of 1.5 MiB: 48 MiB, the rest 1 MiB
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="24MiB", backend="emu", policy=policy, vmm="on")  # runs up to 3 MiB
    unit_of = {}
    for u in off.units:
        for e in u.entries:
            unit_of.setdefault(e.name.rsplit(".", 2)[0], set()).add(u.index)
    expert_units = {k: v for k, v in unit_of.items() if ".experts." in k}
    assert len(expert_units) == 32
    # no unit holds two experts' weights (an expert may be several units: its Linears)
    assert len({i for v in expert_units.values() for i in v}) == sum(len(v) for v in expert_units.values())
    nbytes = {u.index: -(-u.nbytes // 4096) * 4096 for u in off.units}  # a unit's upload: whole 4 KiB
    rest = sum(n for i, n in nbytes.items() if i not in {j for v in expert_units.values() for j in v})
    moved_steps = []
    with torch.no_grad():
        for step in range(12):
            x = torch.randn(1, 256, generator=torch.Generator().manual_seed(step))  # one token
            st = off.context.stats()
            before, ahead = st["bytes_h2d"]["total"], st["plan_prefetch_bytes"]["total"]
            assert torch.equal(m(x), ref(x)), step
            st = off.context.stats()
            moved_steps.append(st["bytes_h2d"]["total"] - before)
            ahead = st["plan_prefetch_bytes"]["total"] - ahead  # the plan's guess of the next step's first units
            routed = sum(nbytes[i] for li, blk in enumerate(m.moe) for e in blk.routed
                         for i in expert_units[f"moe.{li}.experts.{e}"])
            assert all(len(blk.routed) <= 2 for blk in m.moe)
            assert moved_steps[-1] <= routed + rest + ahead, (step, moved_steps[-1], routed, rest, ahead)
    assert sum(moved_steps[2:]) > 0  # the routed experts did move: 49 MiB under 24
    assert max(moved_steps[2:]) <= 8 * 1.5 * MiB + rest + 2 * MiB  # at most two of eight experts a layer
    off.remove()


class AutoEncoder(nn.Module):
    """As diffusers' AutoencoderKL is used in a pipeline: decode(), not forward()."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Decoder()
        self.post_quant_conv = nn.Conv2d(16, 16, 1)
        self.decoder = Decoder()

    def decode(self, z):
        return self.decoder(self.post_quant_conv(z))

    def forward(self, z):
        return self.decode(z)


def test_a_method_other_than_forward_brings_the_weights():
    torch.manual_seed(0)
    m = AutoEncoder().eval().requires_grad_(False)
    ref = copy.deepcopy(m)
    z = torch.randn(1, 16, 8, 8)
    total = sum(p.numel() * p.element_size() for p in m.parameters())
    off = spt.offload(m, budget=4 * total, backend="emu")  # the whole model fits a quarter of it
    assert len(off.units) >= 2  # the top level is split: decode()'s calls reach hooked children
    with torch.no_grad():
        before = off.context.stats()["bytes_h2d"]["total"]
        out = m.decode(z)
        assert off.context.stats()["bytes_h2d"]["total"] - before >= sum(
            p.numel() * p.element_size() for p in list(m.decoder.parameters()) + list(m.post_quant_conv.parameters()))
    assert torch.equal(out, ref.decode(z))
    off.remove()


# ---- a three-module pipeline under one budget ----

class TextEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(2048, 256)
        self.layers = nn.ModuleList(EncLayer(256) for _ in range(3))
        self.proj = nn.Linear(256, 32)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.proj(x)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(16, 256, 3, padding=1), nn.Conv2d(256, 256, 3, padding=1),
                                    nn.Conv2d(256, 256, 3, padding=1), nn.Conv2d(256, 3, 3, padding=1)])

    def forward(self, z):
        for c in self.convs[:-1]:
            z = F.silu(c(z))
        return self.convs[-1](z)


class Pipe:
    """What a diffusers pipeline looks like to offload(): modules as attributes, and others."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.text_encoder = TextEncoder().eval().requires_grad_(False)
        self.transformer = DiT().eval().requires_grad_(False)
        self.vae = Decoder().eval().requires_grad_(False)
        self.scheduler_steps = 5
        self.safety_checker = None

    def __call__(self, ids, x):
        txt = self.text_encoder(ids)
        for i in range(self.scheduler_steps):
            x = x - 0.1 * self.transformer(x, txt, torch.full((x.shape[0], 32), float(i)))
        return self.vae(x.transpose(1, 2).reshape(x.shape[0], 16, 4, 4))


def test_a_pipeline_of_three_modules_under_one_budget():
    pipe = Pipe()
    ref = copy.deepcopy(pipe)
    ids, x = torch.randint(0, 2048, (2, 8)), torch.randn(2, 16, 16)
    offs = spt.offload(pipe, emu_capacity="80MiB", backend="emu")
    assert isinstance(offs, spt.Offloads) and offs.names == ["text_encoder", "transformer", "vae"]
    assert all(o.context is offs.context for o in offs)  # one context: one budget
    budget = offs.context.budget
    total = sum(offloaded_bytes(o) for o in offs)
    assert total > budget
    with torch.no_grad():
        for _ in range(3):
            before = offs.context.stats()["bytes_h2d"]["total"]
            out = pipe(ids, x)
            assert offs.context.stats()["bytes_h2d"]["total"] - before >= total - budget
            assert torch.equal(out, ref(ids, x))
    assert offs["transformer"].steps == 3 * pipe.scheduler_steps and offs["vae"].steps == 3
    assert offs.context.stats()["held"]["peak"] <= budget
    assert "3 modules under one budget" in offs.summary()
    # an in-place op on .data (w.data += d) is seen after refresh_weights()
    w, w_ref = next(pipe.vae.parameters()), next(ref.vae.parameters())
    w.data += 0.5
    w_ref.data += 0.5
    offs.refresh_weights()
    with torch.no_grad():
        assert torch.equal(pipe(ids, x), ref(ids, x))
    assert all(o.hook_stats()["edit_evictions"] == len(o.units) for o in offs)
    offs.remove()
    assert offs.context.closed
    assert all("forward" not in m.__dict__ for o in (pipe.text_encoder, pipe.transformer, pipe.vae)
               for m in o.modules())
    lst = spt.offload([pipe.text_encoder, pipe.vae], budget="32MiB", backend="emu")  # a list works too
    with torch.no_grad():
        assert torch.equal(pipe.vae(torch.randn(1, 16, 4, 4).zero_()), ref.vae(torch.zeros(1, 16, 4, 4)))
    lst.remove()


# ---- a model none of whose weights is frozen (what from_pretrained returns) ----

def test_parameters_that_require_grad_are_offloaded_for_inference():
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)])  # every parameter requires grad
    ref = copy.deepcopy(m)
    x = torch.randn(3, 1024)
    off = spt.offload(m, emu_capacity="24MiB", backend="emu")
    assert offloaded_bytes(off) > 24 * MiB  # everything was offloaded, nothing kept resident
    assert off._trainable == [] and "kept resident" not in off.summary()
    assert all(p.requires_grad for p in m.parameters())
    with torch.no_grad():
        assert torch.equal(moved(off, lambda: m(x)), ref(x))
    y = m(x)  # grad mode: fine until a backward needs the parameters' gradients
    assert torch.equal(y, ref(x))
    with pytest.raises(RuntimeError, match="offloaded for inference.*requires_grad_\\(False\\)"):
        y.sum().backward()
    off.remove()
    assert all(p.requires_grad and p.grad is None for p in m.parameters())


# ---- bad input: a clear error before anything moves ----

def test_bad_input_is_a_clear_error_before_anything_moves():
    m = nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).requires_grad_(False)
    with pytest.raises(spillway.ConfigError, match=r"budget 1.00 MiB is below .*at least 6.00 MiB \(\d is one Linear, "
                                                   r"which is not split\)"):
        spt.offload(m, budget="1MiB", backend="emu")  # no unit smaller than one Linear's weight
    with pytest.raises(spillway.InvalidArgument, match="given twice"):
        spt.offload([m, m], budget="16MiB", backend="emu")
    with pytest.raises(spillway.InvalidArgument, match="submodule"):
        spt.offload([m, m[0]], budget="16MiB", backend="emu")
    with pytest.raises(spillway.InvalidArgument, match="holds no torch.nn.Module"):
        spt.offload(object(), budget="16MiB", backend="emu")
    with pytest.raises(spillway.InvalidArgument, match="expected a torch.nn.Module"):
        spt.offload(torch.zeros(3), budget="16MiB", backend="emu")
    with pytest.raises(spillway.InvalidArgument, match="not a submodule"):
        spt.offload(m, budget="16MiB", blocks=[nn.Linear(2, 2)], backend="emu")
    assert all("forward" not in s.__dict__ for s in m.modules())
    assert all(p.device.type == "cpu" and p.data_ptr() for p in m.parameters())


def test_a_module_another_offloader_already_moves_is_refused_before_anything_moves():
    """accelerate's placing hooks (cpu_offload, a device_map, a pipeline's model or sequential CPU
    offload) and diffusers' group offloading move the same weights: a clear error names the
    module and the hook; diffusers' other hooks (layerwise casting, caches) are no obstacle."""
    class AlignDevicesHook:  # the names the libraries give their hooks
        def __init__(self, offload=True):
            self.offload = offload

    class CpuOffload:
        pass

    class SequentialHook:
        def __init__(self, *hooks):
            self.hooks = hooks

    class Registry:
        def __init__(self, *names):
            self.hooks = {n: object() for n in names}

    def model():
        return nn.Sequential(nn.Linear(1024, 1024), nn.Sequential(nn.Linear(1024, 1024))).requires_grad_(False)

    for where, attr, value, match in (
            (lambda m: m[1][0], "_hf_hook", AlignDevicesHook(), r"1\.0 has accelerate's AlignDevicesHook hook"),
            (lambda m: m, "_hf_hook", CpuOffload(), r"Sequential has accelerate's CpuOffload hook"),
            (lambda m: m[0], "_hf_hook", SequentialHook(object(), AlignDevicesHook()), "0 has accelerate's Align"),
            (lambda m: m[1], "_diffusers_hook", Registry("layerwise_casting", "group_offloading"),
             "1 has diffusers' group_offloading hook")):
        m = model()
        setattr(where(m), attr, value)
        with pytest.raises(spillway.InvalidArgument, match=match):
            spt.offload(m, budget="6MiB", backend="emu")
        assert all("forward" not in s.__dict__ for s in m.modules())
    m = model()
    m[1]._diffusers_hook = Registry("layerwise_casting", "first_block_cache")
    m[0]._hf_hook = SequentialHook(object(), AlignDevicesHook(offload=False))  # moves the inputs only
    off = spt.offload(m, budget="6MiB", backend="emu")
    off.remove()


def test_a_module_and_a_pipeline_resolve_a_budget_alike():
    """One budget resolution (_budget.resolve_budget): the same budget is refused with the same
    message by offload(module) and offload([modules]), before anything moves; a percentage is of
    the device's memory, and no budget is its free memory less the reserve, in both."""
    a = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).requires_grad_(False)
    b = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512)).requires_grad_(False)
    for target in (a, [a, b]):
        with pytest.raises(spillway.ConfigError, match="budget 64.00 MiB is above the free device memory "
                                                       "\\(32.00 MiB of 32.00 MiB on emu\\)"):
            spt.offload(target, budget="64MiB", emu_capacity="32MiB", backend="emu")
        with pytest.raises(spillway.ConfigError, match="a budget is bytes"):
            spt.offload(target, budget=1.5, backend="emu")
        assert all("forward" not in s.__dict__ for s in a.modules())
        assert all(p.device.type == "cpu" and p.data_ptr() for p in a.parameters())
        off = spt.offload(target, budget="25%", emu_capacity="64MiB", backend="emu")
        assert off.context.budget == 16 * MiB and off.budget_source == "given"
        off.remove()
        off = spt.offload(target, emu_capacity="64MiB", backend="emu")  # no budget: free less the reserve
        assert off.context.budget == 32 * MiB and off.budget_source == "default" and off.reserve == 32 * MiB
        off.remove()


def test_torch_transformer_layers_that_read_their_childrens_weights_stay_whole():
    """nn.TransformerEncoderLayer in eval runs torch's fused path, which reads linear1.weight,
    self_attn.out_proj.weight, ... itself: a layer is never split into its children (whose hooks
    would never run), whatever the budget."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    m = nn.TransformerEncoder(layer, num_layers=8, enable_nested_tensor=False).eval().requires_grad_(False)
    ref = copy.deepcopy(m)
    x = torch.randn(2, 16, 256)
    off = spt.offload(m, budget="8MiB", backend="emu")  # a layer (3 MiB) is above a quarter of it
    assert sum(u.name.startswith("layers.") and u.name.count(".") == 1 for u in off.units) == 8
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(moved(off, lambda: m(x)), ref(x))
    off.remove()


def test_a_run_of_small_modules_shares_one_acquisition():
    """A run of small neighbours is one unit that each of them acquires: inside the forward, the
    second and later modules of the run find the first one's release still pending and take the
    unit without a call into the library; the weights still move and the output is equal."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(256, 256) for _ in range(64)]).requires_grad_(False)  # 16 MiB
    ref = copy.deepcopy(m)
    x = torch.randn(4, 256)
    off = spt.offload(m, budget="6MiB", backend="emu", vmm="on")  # pages: units up to a quarter of it
    runs = [u for u in off.units if ".." in u.name]  # "3..5": modules 3 to 5
    assert len(off.units) < 64 and runs, [u.name for u in off.units]
    calls = []
    for name in ("_c_acquire", "_c_release_acquire"):
        fn = getattr(off, name)
        setattr(off, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(x), steps=6)
    assert torch.equal(out, ref(x))
    assert per_step > 0  # the weights moved in the steady steps
    hooked = 64 * 6
    assert off.acquires >= hooked
    assert len(calls) <= len(off.units) * 6, (len(calls), len(off.units))  # one call a unit a step, not a module
    off.remove()


def test_a_small_module_beside_a_large_one_is_not_a_unit_of_its_own():
    """A norm before its attention, or after the last large module of a block, joins that unit
    where both fit: no unit is only a norm's few KiB, each paying a hook and a transfer."""
    from spillway.torch import _partition

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = nn.LayerNorm(512)
            self.attn = nn.Linear(512, 2048)  # 4 MiB
            self.norm2 = nn.LayerNorm(512)
            self.ff = nn.Linear(512, 2048)
            self.norm3 = nn.LayerNorm(2048)

        def forward(self, x):
            return self.norm3(self.ff(self.norm2(self.attn(self.norm1(x))[..., :512])))[..., :512]

    m = nn.Sequential(Block(), Block())
    lo, hi = 3 * MiB, 6 * MiB
    groups = _partition.partition(m, set(), lo, hi)
    sizes = [sum(p.numel() * p.element_size() for g in grp for p in g.parameters()) for grp in groups]
    names = {id(x): n for n, x in m.named_modules()}
    assert len(groups) == 4, [[names[id(x)] for x in g] for g in groups]
    assert min(sizes) >= lo and max(sizes) <= hi, sizes
    assert [names[id(x)] for x in groups[0]] == ["0.norm1", "0.attn"]
    assert [names[id(x)] for x in groups[1]] == ["0.norm2", "0.ff", "0.norm3"]
    m = nn.Sequential(*[Block() for _ in range(6)]).requires_grad_(False)  # 48 MiB
    x = torch.randn(2, 512)
    ref = copy.deepcopy(m)(x)
    off = spt.offload(m, budget="20MiB", backend="emu", vmm="on")  # pages: units up to 5 MiB
    # two a block, and the unit of the norms' tensors, which the top level holds
    assert len(off.units) == 13, [u.name for u in off.units]
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(x), steps=6)
    assert torch.equal(out, ref) and per_step > 0
    off.remove()


class Alternating(nn.Module):
    """A UNet block's shape: its resnets and attentions in two lists, run alternately."""

    def __init__(self) -> None:
        super().__init__()
        self.resnets = nn.ModuleList([nn.Sequential(nn.Linear(256, 320), nn.Linear(320, 256))
                                      for _ in range(3)])  # 642 KiB each
        self.attentions = nn.ModuleList([nn.Sequential(nn.Linear(256, 1024), nn.Linear(1024, 256)) for _ in range(3)])

    def forward(self, x):
        for r, a in zip(self.resnets, self.attentions):
            x = a(r(x))
        return x


def test_modules_of_lists_called_in_alternation_are_not_grouped():
    """zip(self.resnets, self.attentions): a run of resnets made one unit would be held from the
    first resnet's call to the last one's, across the attentions between them, and acquired again
    for each; so the children of lists iterated together are units of their own, unless tiny."""
    from spillway.torch import _partition

    m = nn.Sequential(Alternating(), Alternating())
    names = {id(x): n for n, x in m.named_modules()}
    groups = [[names[id(x)] for x in g] for g in _partition.partition(m, set(), 2 * MiB, 4 * MiB)]
    assert ["0.resnets.0", "0.resnets.1", "0.resnets.2"] not in groups  # what a list iterated alone gives
    assert all(len(g) == 1 for g in groups), groups  # runs of them would pass 1 MiB
    m = nn.Sequential(Alternating(), Alternating())
    for blk in m:
        blk.resnets = nn.ModuleList([nn.Linear(256, 256) for _ in range(3)])  # 257 KiB each
    names = {id(x): n for n, x in m.named_modules()}
    groups = [[names[id(x)] for x in g] for g in _partition.partition(m, set(), 2 * MiB, 4 * MiB)]
    assert ["0.resnets.0", "0.resnets.1", "0.resnets.2"] in groups, groups  # tiny: one hook for the three

    class InOrder(nn.Module):  # a list by index in a range() loop: called in order
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(3)])

        def forward(self, x):
            for i in range(len(self.layers)):
                x = self.layers[i](x)
            return x

    class WithNorms(nn.Module):  # two lists by one index in one loop: they alternate
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(3)])
            self.norms = nn.ModuleList([nn.LayerNorm(256) for _ in range(3)])

        def forward(self, x):
            for i in range(len(self.layers)):
                x = self.norms[i](self.layers[i](x))
            return x

    class EveryExpert(nn.Module):  # every expert in order, those no token picked skipped (transformers 4.36)
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(3)])

        def forward(self, x):
            out = torch.zeros_like(x)
            for i in range(len(self.layers)):
                expert_layer = self.layers[i]
                if i % 2:
                    continue
                out = out + expert_layer(x)
            return out

    class Skipping(nn.Module):  # a loop over the list itself that skips some
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                if float(x.sum()) > 1e30:
                    continue
                x = layer(x)
            return x

    class LayerDrop(nn.Module):  # skips only in training (BART's, Whisper's): in order at inference
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(256, 256) for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                if self.training:
                    p = float(torch.rand(()))  # a continue in a comment: continue
                    if p < 0.1:
                        continue
                x = layer(x)
            return x

    for cls, alternate in ((InOrder, False), (WithNorms, True), (EveryExpert, True), (Skipping, True),
                           (LayerDrop, False)):
        m = cls()
        for layer in m.layers:  # 640 KiB each (the partition reads sizes only): three make a run
            layer.weight = nn.Parameter(torch.zeros(640, 256))  # below lo, two pass 1 MiB
        names = {id(x): n for n, x in m.named_modules()}
        groups = [[names[id(x)] for x in g] for g in _partition.partition(m, set(), 2 * MiB, 4 * MiB)]
        assert (["layers.0", "layers.1", "layers.2"] in groups) == (not alternate), (cls, groups)
        assert (["layers.1"] in groups) == alternate, (cls, groups)
    m = nn.Sequential(*[Alternating() for _ in range(4)]).requires_grad_(False)  # 31.5 MiB
    x = torch.randn(4, 256)
    ref = copy.deepcopy(m)(x)
    off = spt.offload(m, budget="12MiB", backend="emu", vmm="on")
    assert not any(".." in u.name for u in off.units), [u.name for u in off.units]
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(x), steps=6)
    assert torch.equal(out, ref) and per_step > 0
    off.remove()


# ---- forward pre-hooks that read the weights: weight_norm (diffusers' audio autoencoders), prune ----

class Seen(nn.Conv1d):
    """A Conv1d that notes where the weight its forward reads lies."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(self.weight.data_ptr())
        return super().forward(x)


class Snake(nn.Module):
    """A residual unit of weight-normed convolutions, as an audio autoencoder's decoder has."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.conv1 = nn.utils.weight_norm(nn.Conv1d(dim, dim, 7, padding=3))
        self.conv2 = nn.utils.weight_norm(nn.Conv1d(dim, dim, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.conv2(F.elu(self.conv1(F.elu(x))))


def test_weight_norm_and_the_callers_pre_hooks_see_the_device_copies():
    """A pre-hook runs before the forward that brings the weights; offload() makes it run with
    them brought: weight_norm computes its weight from the device copies of weight_g and
    weight_v (on CUDA, from the host views the forward would get a host tensor), and a
    pre-hook of the caller's sees the same weight as the forward, also one registered after
    offload(). After each forward the computed weight is no longer held (on CUDA it would be a
    device copy outside the budget). remove() gives every hook back, and handles made before,
    during and after the offload remove theirs."""
    torch.manual_seed(0)
    m = nn.Sequential(*[Snake(256) for _ in range(6)], Seen(256, 256, 3, padding=1)).eval().requires_grad_(False)
    m[-1].seen = []
    pre_seen: List[int] = []
    m[-1].register_forward_pre_hook(lambda mod, args: pre_seen.append(mod.weight.data_ptr()))
    calls = []
    counter = m.register_forward_pre_hook(lambda mod, args: calls.append(1))  # the top level's: left as it is
    x = torch.randn(2, 256, 64)
    with torch.no_grad():
        ref = m(x)  # (a weight-normed module cannot be deep-copied: its weight is not a leaf)
    m[-1].seen.clear()
    pre_seen.clear()
    at_offload = {id(c): c.weight for c in m.modules() if isinstance(c, nn.Conv1d) and hasattr(c, "weight_g")}
    # 12.8 MiB of weights in 8 MiB: several units are brought every step
    off = spt.offload(m, budget="8MiB", backend="emu", vmm="on")
    host_views = {c.weight_v.data_ptr() for c in m.modules() if id(c) in at_offload}
    seen_v: List[int] = []
    late = [c.register_forward_pre_hook(lambda mod, args: seen_v.append(mod.weight_v.data_ptr()))
            for c in m.modules() if id(c) in at_offload]  # registered after offload()
    dropped = m[0].conv1.register_forward_pre_hook(lambda mod, args: calls.append("dropped"))
    dropped.remove()  # a handle made while offloaded removes its hook
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(x), steps=4)
    assert torch.equal(out, ref)
    assert per_step >= offloaded_bytes(off) - 8 * MiB, per_step
    assert pre_seen == m[-1].seen and len(pre_seen) == 4  # the pre-hook saw the forward's device copy
    assert len(calls) == 5 and m._forward_pre_hooks[counter.id].__name__ == "<lambda>"
    assert len(seen_v) == 4 * len(at_offload) and not set(seen_v) & host_views  # the late ones too
    for c in m.modules():
        if id(c) in at_offload:
            assert c.weight is at_offload[id(c)]  # the computed weight is not kept past the forward
    xg = x.clone().requires_grad_(True)  # backward through weights computed in pre-hooks
    m(xg).square().sum().backward()
    off.remove()
    xr = x.clone().requires_grad_(True)
    m(xr).square().sum().backward()
    assert torch.equal(xg.grad, xr.grad)
    hooks = [h for c in m.modules() for h in c._forward_pre_hooks.values()]
    assert sum(isinstance(h, WeightNorm) for h in hooks) == 12
    assert not any(type(h).__module__.startswith("spillway") for h in hooks)
    for h in late + [counter]:
        h.remove()
    seen_v.clear()
    with torch.no_grad():
        assert torch.equal(m(x), ref)
    assert not seen_v and len(calls) == 7 and "dropped" not in calls


def test_weight_norm_inside_a_unit_keeps_no_computed_weight():
    """Weight-normed convolutions small enough to share a unit with their block (diffusers'
    Oobleck VAE): the block's hook brings them, their pre-hooks compute from the device copies,
    and after each forward no computed weight is held (on CUDA each would be a device copy of
    its weight outside the budget, the whole model's worth)."""
    torch.manual_seed(0)
    m = nn.Sequential(*[Snake(128) for _ in range(12)]).eval().requires_grad_(False)  # 6.3 MiB
    x = torch.randn(2, 128, 64)
    with torch.no_grad():
        ref = m(x)
    convs = [c for c in m.modules() if isinstance(c, nn.Conv1d)]
    off = spt.offload(m, budget="4MiB", backend="emu", vmm="on")
    assert not any(id(c) in off._needs for c in convs)  # inside their blocks' units, not hooked themselves
    at_offload = {id(c): c.weight for c in convs}
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(x), steps=3)
    assert torch.equal(out, ref) and per_step >= offloaded_bytes(off) - 4 * MiB
    assert all(c.weight is at_offload[id(c)] for c in convs)
    off.remove()
    with torch.no_grad():
        assert torch.equal(m(x), ref)


def test_a_pruned_model_and_its_deep_copy_run_as_resident():
    """prune's pre-hook computes weight = weight_orig * weight_mask from the device copies; a deep
    copy of the offloaded model is a plain model whose hooks are the caller's."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)]).requires_grad_(False)  # 8 MiB
    for lin in m:
        nn.utils.prune.l1_unstructured(lin, "weight", amount=0.5)
    x = torch.randn(4, 512)
    ref = copy.deepcopy(m)(x)
    at_offload = [lin.weight for lin in m]
    off = spt.offload(m, budget="4MiB", backend="emu", vmm="on")
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(x), steps=4)
        twin = copy.deepcopy(m)
        assert torch.equal(twin(x), ref)
    assert torch.equal(out, ref) and per_step > 0
    assert all(lin.weight is w for lin, w in zip(m, at_offload))  # the masked weight is not kept
    assert not any(type(h).__module__.startswith("spillway") for c in twin.modules()
                   for h in c._forward_pre_hooks.values())
    off.remove()


# ---- quantized weights in a Parameter subclass (diffusers' GGUFParameter, bitsandbytes' Params4bit) ----

def test_quantized_weights_in_a_parameter_subclass_keep_their_class_and_attributes():
    """A module reads its weight's attributes in its forward (the quantization type of a GGUF
    checkpoint); the device copy it gets while its unit is acquired is of the Parameter's class
    and has them, also after an attribute set on the Parameter after offload()."""
    torch.manual_seed(0)
    m = nn.Sequential(*[QuantLinear(1024) for _ in range(12)]).requires_grad_(False)  # 12 MiB of int8
    x = torch.randn(4, 1024)
    with torch.no_grad():
        ref = m(x)
    host = m[3].weight
    seen = []  # what the slot holds during the forward (a pre-hook present at offload() sees it)
    m[3].register_forward_pre_hook(lambda mod, args: seen.append((type(mod.weight), mod.weight is host)))
    off = spt.offload(m, budget="6MiB", backend="emu", vmm="on")
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(x), steps=4)
    assert torch.equal(out, ref) and per_step >= offloaded_bytes(off) - 6 * MiB
    assert seen == [(QuantParam, False)] * 4  # a device copy of the Parameter's class
    assert "12 QuantParam (12.00 MiB)" in off.summary()
    assert type(m[0].weight) is QuantParam and m[0].weight.scale == 1 / 64  # the host Parameter between forwards
    m[5].weight.scale = 1 / 32
    with torch.no_grad():
        halved = m(x)
    m[5].weight.scale = 1 / 64
    assert not torch.equal(halved, ref)
    with torch.no_grad():
        assert torch.equal(m(x), ref)
    off.remove()
    with torch.no_grad():
        assert type(m[0].weight) is QuantParam and torch.equal(m(x), ref)


@pytest.mark.parametrize("nested", [False, True])
def test_quantized_weights_in_a_wrapper_subclass_move_as_their_leaves(nested):
    """torchao's and quanto's quantized weights are wrapper subclasses: their data are plain
    tensors they hold. Those move (int8 and scales, not the weights' logical float32 size);
    while its unit is acquired a module's weight is one of the subclass rebuilt over the
    device copies, between forwards the same Parameter object holding the host copies. An
    in-place edit of a leaf is uploaded by the next forward; remove() gives the model back."""
    torch.manual_seed(0)
    m = nn.Sequential(*[wrapped_linear(1024, nested) for _ in range(12)]).requires_grad_(False)  # 12 MiB of int8
    m_state = copy.deepcopy(m.state_dict())
    x = torch.randn(4, 1024)
    with torch.no_grad():
        ref = m(x)
    host = m[3].weight
    leaf = (lambda w: w.impl.qdata) if nested else (lambda w: w.qdata)
    qdata = leaf(host)
    seen = []
    m[3].register_forward_pre_hook(lambda mod, args: seen.append(
        (type(mod.weight), mod.weight is host, leaf(mod.weight).data_ptr())))
    off = spt.offload(m, budget="6MiB", backend="emu", vmm="on")
    stored = offloaded_bytes(off)
    assert 12 * MiB < stored < 13 * MiB  # int8 and float32 scales and biases: not 48 MiB of float32
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(x), steps=4)
    assert torch.equal(out, ref) and per_step >= stored - 6 * MiB
    cls = NestedInt8 if nested else WrappedInt8
    assert f"12 {cls.__name__} (12.05 MiB, moved as their data and scales)" in off.summary()
    assert m[3].weight is host and type(host) is cls
    assert leaf(host) is not qdata and torch.equal(leaf(host), qdata)  # the host copy, in the pack
    pack = next(u for u in off.units if any(e.tensor is host for e in u.entries)).pack
    assert pack.data_ptr() <= leaf(host).data_ptr() < pack.data_ptr() + pack.numel()
    assert [(t, same) for t, same, _ in seen] == [(cls, False)] * 4
    assert all(not (pack.data_ptr() <= p < pack.data_ptr() + pack.numel()) for _, _, p in seen)  # device copies
    with torch.no_grad():
        leaf(host).neg_()  # an edit in place, uploaded by the next forward
        edited = m(x)
        leaf(host).neg_()
        assert not torch.equal(edited, ref) and torch.equal(m(x), ref)
    # load_state_dict: the subclass's copy_ writes the leaves below autograd, where their
    # version counters stay; the wrapper's own moves
    torch.manual_seed(1)
    other = nn.Sequential(*[wrapped_linear(1024, nested) for _ in range(12)]).requires_grad_(False)
    m.load_state_dict(other.state_dict())
    with torch.no_grad():
        assert torch.equal(m(x), other(x))
    m.load_state_dict(copy.deepcopy(m).state_dict())  # a deep copy of an offloaded model reads its host copies
    with torch.no_grad():
        assert torch.equal(m(x), other(x))
        m.load_state_dict(m_state)
        assert torch.equal(m(x), ref)
    off.remove()
    assert m[3].weight is host and type(host) is cls and torch.equal(leaf(host), qdata)
    with torch.no_grad():
        assert torch.equal(m(x), ref)


def test_a_wrapper_subclass_that_cannot_be_rebuilt_is_refused_before_anything_moves():
    class Broken(WrappedInt8):
        @staticmethod
        def __tensor_unflatten__(inner, ctx, size, stride):
            raise TypeError("no")

    torch.manual_seed(0)
    m = nn.Sequential(*[wrapped_linear(1024) for _ in range(4)]).requires_grad_(False)
    w = m[2].weight
    m[2].weight = nn.Parameter(Broken(w.qdata, w.scale), requires_grad=False)
    x = torch.randn(4, 1024)
    with torch.no_grad():
        ref = m(x)
    leaves = [(p.qdata, p.scale) for p in (lin.weight for lin in m)]
    with pytest.raises(spillway.ConfigError, match=r"2\.weight is a Broken that its class cannot rebuild .*TypeError: no"):
        spt.offload(m, budget="2MiB", backend="emu")
    assert [(p.qdata, p.scale) for p in (lin.weight for lin in m)] == leaves  # the same tensors, untouched
    assert all("forward" not in s.__dict__ for s in m.modules())
    with torch.no_grad():
        assert torch.equal(m(x), ref)


@pytest.mark.parametrize("train", [False, True])
def test_a_wrapper_subclass_weight_saved_for_backward_is_rebuilt_from_its_unit(train):
    """An autograd function saves the offloaded quantized weight itself (a device tensor of the
    wrapper subclass over the unit's memory, which the engine may reuse before backward): the
    backward gets it rebuilt from its unit acquired again, so gradients equal resident's."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(SavingLinear(1024), nn.Tanh()) for _ in range(12)])  # 12 MiB of int8
    ref = copy.deepcopy(m)
    head = nn.Linear(1024, 1024)  # trained, so that optimizer= has a parameter
    ref_head = copy.deepcopy(head)
    model, ref_model = nn.Sequential(head, m), nn.Sequential(ref_head, ref)
    opt = torch.optim.SGD(head.parameters(), lr=0.1) if train else None
    off = spt.offload(model, budget="6MiB", backend="emu", vmm="on", optimizer=opt)
    for step in range(3):
        x = torch.randn(4, 1024, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        out = moved(off, lambda: model(x))
        want = ref_model(xr)
        assert torch.equal(out, want)
        out.square().sum().backward()
        want.square().sum().backward()
        assert torch.equal(x.grad, xr.grad) and torch.equal(head.weight.grad, ref_head.weight.grad), step
        head.zero_grad()
        ref_head.zero_grad()
    assert off.stats()["offload"]["saved_reacquires"] > 0  # the weights came back for backward
    off.remove()


def test_a_norm_before_a_layer_larger_than_a_unit_shares_its_unit():
    """A batch norm between two convolutions each larger than a unit would be a unit of a few
    KiB, paying a hook for nothing: it joins the convolution after it."""
    def conv() -> nn.Conv2d:
        return nn.Conv2d(512, 512, 3, padding=1)  # 9 MiB

    torch.manual_seed(0)
    m = nn.Sequential(conv(), nn.BatchNorm2d(512), nn.ReLU(), conv(), nn.BatchNorm2d(512), nn.ReLU(),
                      conv()).requires_grad_(False).eval()
    x = torch.randn(1, 512, 4, 4)
    with torch.no_grad():
        ref = m(x)
    off = spt.offload(m, budget="20MiB", backend="emu")
    assert [u.name for u in off.units] == ["0", "1..3", "4..6", "small tensors of the blocks"]
    with torch.no_grad():
        assert torch.equal(moved(off, lambda: m(x)), ref)
    off.remove()


def test_batch_norm_in_training_keeps_its_running_statistics_as_resident():
    """Batch norm's kernel updates its running statistics in place without moving their version
    counters, so a write-back at release cannot see it: they stay on the device, not offloaded,
    and a convolutional network trained through the offload keeps them as the resident one."""
    def block(c: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())

    torch.manual_seed(0)
    m = nn.Sequential(*[block(256) for _ in range(8)]).train()  # 18 MiB of convolutions
    ref = copy.deepcopy(m)
    off = spt.offload(m, budget="8MiB", backend="emu")
    stats = {id(t) for mod in m.modules() if isinstance(mod, nn.BatchNorm2d)
             for t in (mod.running_mean, mod.running_var, mod.num_batches_tracked)}
    assert not stats & {id(e.tensor) for u in off.units for e in u.entries}  # not offloaded
    for step in range(3):
        x = torch.randn(2, 256, 8, 8)
        with torch.no_grad():
            assert torch.equal(moved(off, lambda: m(x)), ref(x)), step
        for (n, a), b in zip(m.named_buffers(), ref.buffers()):
            assert torch.equal(a, b), (step, n)
    off.remove()
    m.eval()
    ref.eval()
    with torch.no_grad():
        x = torch.randn(2, 256, 8, 8)
        assert torch.equal(m(x), ref(x))


class Mixer(nn.Module):
    """Mamba's mixer in miniature: its forward calls in_proj and out_proj, and a method of its
    own multiplies by dt_proj's weight and adds its bias without calling dt_proj."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(d, 2 * d)
        self.dt_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.A = nn.Parameter(torch.randn(d))
        self.seen: List[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.in_proj(x))

    def mix(self, h: torch.Tensor) -> torch.Tensor:
        a, b = h.chunk(2, -1)
        self.seen.append(self.dt_proj.weight.data_ptr())
        return self.out_proj(F.linear(a, self.dt_proj.weight, self.dt_proj.bias) * b * self.A)


def test_a_weight_a_module_reads_from_its_child_itself_is_in_its_own_unit():
    """A parent larger than a unit that reads a child's weight in its own code (the child's hook
    never runs) holds that weight in its own unit while it runs: on CUDA the host copy would
    meet device tensors."""
    torch.manual_seed(0)
    m = nn.Sequential(*[Mixer(256) for _ in range(6)]).requires_grad_(False)  # 1 MiB a mixer, 6 MiB
    x = torch.randn(4, 256)
    with torch.no_grad():
        ref = m(x)
    off = spt.offload(m, budget="3MiB", backend="emu", vmm="off")
    assert all(any(e.tensor is mx.dt_proj.weight for u in off._needs[id(mx)] for e in u.entries)
               and not any(e.tensor is mx.in_proj.weight for u in off._needs[id(mx)] for e in u.entries)
               for mx in m)
    host = {mx.dt_proj.weight.data_ptr() for mx in m}
    for mx in m:
        mx.seen.clear()
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(x), steps=3)
    assert torch.equal(out, ref) and per_step >= offloaded_bytes(off) - 3 * MiB
    assert all(len(mx.seen) == 3 and not host & set(mx.seen) for mx in m)  # the device copy, every call
    off.remove()
    with torch.no_grad():
        assert torch.equal(m(x), ref)


class _Plus(nn.Module):
    def __init__(self, delta: torch.Tensor) -> None:
        super().__init__()
        self.delta = delta

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + self.delta


class ParamLoRA(nn.Module):
    """peft's LoRA on a Parameter (its MoE experts' path) in miniature: each call registers a
    parametrization adding B @ A to the wrapped module's weight, and removes it after."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base_layer = base
        self.A = nn.Parameter(torch.randn(rank, base.in_features) * 0.05)
        self.B = nn.Parameter(torch.randn(base.out_features, rank) * 0.05)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self._activate():
            return self.base_layer(x)

    @contextlib.contextmanager
    def _activate(self):
        parametrize.register_parametrization(self.base_layer, "weight", _Plus(self.B @ self.A))
        try:
            yield
        finally:
            parametrize.remove_parametrizations(self.base_layer, "weight", leave_parametrized=False)


def test_a_parametrization_registered_for_each_call_gets_the_device_copy():
    """register_parametrization takes the weight out of its module's parameters for the call and
    removing it puts the tensor it took back as a buffer: the wrapper is one unit, the
    parametrization wraps the device copy, and the host Parameter goes back after each call."""
    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Sequential(ParamLoRA(nn.Linear(512, 512).requires_grad_(False)), nn.Tanh())
                        for _ in range(8)])  # 8 MiB of frozen weights
    ref = copy.deepcopy(m)
    bases = [blk[0].base_layer for blk in m]
    host = [b.weight for b in bases]
    off = spt.offload(m, budget="4MiB", backend="emu", vmm="off")
    assert all(id(blk[0]) in off._needs and id(b) not in off._needs for blk, b in zip(m, bases))
    opts = [torch.optim.SGD([p for p in mod.parameters() if p.requires_grad], lr=0.1) for mod in (m, ref)]
    for step in range(3):
        x = torch.randn(16, 512, generator=torch.Generator().manual_seed(step))
        loss = moved(off, lambda: m(x).square().mean())
        want = ref(x).square().mean()
        assert torch.equal(loss, want), step
        loss.backward()
        want.backward()
        for (n, p), q in zip(m.named_parameters(), ref.parameters()):
            assert p.requires_grad == q.requires_grad and (not p.requires_grad or torch.equal(p.grad, q.grad)), n
        for o in opts:
            o.step()
            o.zero_grad()
        assert all(type(b) is nn.Linear and b._parameters["weight"] is w and "weight" not in b._buffers
                   for b, w in zip(bases, host))
    off.remove()
    x = torch.randn(16, 512)
    with torch.no_grad():
        assert torch.equal(m(x), ref(x))


class TiedHead(nn.Module):
    """A language model whose head is computed by its own forward from the embedding's weight
    (x @ self.embed.weight.T), as much research code writes it."""

    def __init__(self, vocab: int = 2048, dim: int = 256, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList([nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                     for _ in range(depth)])
        self.seen: List[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        self.seen.append(self.embed.weight.data_ptr())
        return x @ self.embed.weight.T


def test_a_weight_the_top_levels_own_code_reads_from_a_child_is_held_for_the_step():
    torch.manual_seed(0)
    m = TiedHead().requires_grad_(False)  # 2 MiB of embedding, 6 MiB of layers
    ids = torch.randint(0, 2048, (2, 32))
    with torch.no_grad():
        ref = m(ids)
    off = spt.offload(m, budget="4MiB", backend="emu", vmm="off")
    host = m.embed.weight.data_ptr()
    m.seen.clear()
    with torch.no_grad():
        out, per_step = run_steps(off, lambda: m(ids), steps=3)
    assert torch.equal(out, ref) and per_step >= offloaded_bytes(off) - 4 * MiB
    assert len(m.seen) == 3 and host not in m.seen  # the device copy when the head reads it
    off.remove()
    with torch.no_grad():
        assert torch.equal(m(ids), ref)


def test_reading_a_childs_dtype_or_shape_does_not_hold_its_weight():
    """What a host copy answers as the device copy does (dtype, shape) is not a read of the
    weight: transformers' heads cast to self.lm_head.weight.dtype before calling lm_head."""
    from spillway.torch import _partition

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = nn.Linear(4, 4)
            self.proj = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.lm_head(x.to(self.lm_head.weight.dtype)) * self.lm_head.weight.shape[0]
            return y + F.linear(x, self.proj.weight)

    h = Head()
    assert _partition.children_read(h) == [h.proj]


def test_a_tensor_read_two_modules_down_is_held_by_the_reader():
    """self.blocks[...] aside, a path through modules (self.head.proj.weight) reaches a tensor
    of a grandchild: it is held by the reader too."""
    from spillway.torch import _partition

    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = Inner()
            self.other = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.linear(x, self.head.proj.weight.T) + self.other(x) * self.other.weight.dtype.itemsize

    r = Reader()
    assert _partition.children_read(r) == [r.head.proj]


def test_a_tensor_read_by_getattr_or_through_a_local_name_is_held_by_the_reader():
    from spillway.torch import _partition

    class Reader(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d, self.e = (nn.Linear(4, 4) for _ in range(5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            d = self.d
            e = self.e  # called, not read
            y = F.linear(x, getattr(self.a, "weight"), getattr(self.b, 'bias')) + self.c(x)
            return F.linear(y, d.weight) * d.weight.shape[0] + e(y)

    r = Reader()
    assert _partition.children_read(r) == [r.a, r.b, r.d]


class Wrapped(nn.Module):
    """An adapter wrapper as peft's LoRA layers are: .weight answers with its base layer's."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base_layer = base

    @property
    def weight(self) -> torch.Tensor:
        return self.base_layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)


def test_a_weight_read_through_a_wrappers_property_is_held_by_the_reader():
    from spillway.torch import _partition
    mx = Mixer(8)
    mx.dt_proj = Wrapped(mx.dt_proj)
    assert _partition.children_read(mx) == [mx.dt_proj.base_layer]
