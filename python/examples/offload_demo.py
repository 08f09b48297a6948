"""A tiny spillway.torch demo: a transformer whose weights are twice the device budget.

Runs on the GPU when torch sees one, else on the emulated device with CPU tensors. It checks
that the offloaded model gives the same output as the resident one, then prints what moved
with policy lru and plan.
"""
from __future__ import annotations

import copy
import time

import torch
from torch import nn

import spillway
import spillway.torch as spt


def model() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    return nn.TransformerEncoder(layer, num_layers=8, enable_nested_tensor=False).eval()


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ref = model().to(device)
    x = torch.randn(1, 16, 256, device=device)
    with torch.no_grad():
        want = ref(x)
    weights = sum(p.numel() * p.element_size() for p in ref.parameters())
    print(f"spillway {spillway.__version__} ({spillway.library_path})")
    print(f"model: 8 encoder layers, {weights / 2**20:.1f} MiB of weights; budget 12 MiB; "
          f"{'cuda' if device.type == 'cuda' else 'emu (CPU tensors)'}\n")
    for policy in ("lru", "plan"):
        m = copy.deepcopy(ref).requires_grad_(False)
        off = spt.offload(m, budget="12MiB", policy=policy, prefetch="off")
        t0 = time.perf_counter()
        with torch.no_grad():
            for _ in range(5):
                out = m(x)
        ms = (time.perf_counter() - t0) / 5 * 1000
        assert torch.equal(out, want), "offloaded output differs from the resident model"
        st = off.stats()
        print(f"policy={policy}: output equal to the resident model; {ms:.1f} ms a forward, "
              f"{st['bytes_h2d']['total'] / 5 / 2**20:.1f} MiB moved per forward, "
              f"held at most {st['held']['peak'] / 2**20:.0f} MiB")
        if policy == "plan":
            print()
            print(off.summary())
        off.remove()


if __name__ == "__main__":
    main()
