"""Adapter gradients through an offloaded frozen base, against the resident model.

Twelve frozen nn.Linear(2048, 2048) with rank-8 adapters (x @ a @ b added to each output),
offloaded at 30, 60 and 120 % of the base's bytes; one loss, loss.backward(). Two ways to run
the same computation: the adapters inside wrapper blocks (the model's own forward runs) and the
adapters beside the base's layers, which the caller's loop calls one by one (the offloaded
module's own forward never runs). Prints, per budget and way, whether the loss and every adapter
gradient are bitwise equal to the resident run, the largest relative error, and the bytes moved.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python python3 bench/dev/adapter_grads.py [--backend emu|cuda]
"""
from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

import spillway.torch as spt

D, R, N = 2048, 8, 12


class Adapted(nn.Module):
    def __init__(self, base: nn.Linear, a: torch.Tensor, b: torch.Tensor) -> None:
        super().__init__()
        self.base, self.a, self.b = base, nn.Parameter(a), nn.Parameter(b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a @ self.b


def build(dev: torch.device):
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(D, D) for _ in range(N)]).requires_grad_(False).to(dev)
    ads = [((torch.randn(D, R) * 0.02).to(dev), (torch.randn(R, D) * 0.02).to(dev)) for _ in range(N)]
    return base, ads


def run(way: str, frac: float, dev: torch.device, backend: str):
    base, ads = build(dev)
    x = torch.randn(8, D, device=dev, generator=torch.Generator(device=dev).manual_seed(1))
    if way == "inside":
        model = nn.Sequential(*[Adapted(lin, a.clone(), b.clone()) for lin, (a, b) in zip(base, ads)])
        ref = copy.deepcopy(model)
        target, params, ref_params = model, [p for p in model.parameters() if p.requires_grad], \
            [p for p in ref.parameters() if p.requires_grad]
        fwd, ref_fwd = (lambda: model(x)), (lambda: ref(x))
    else:
        ref_base = copy.deepcopy(base)
        params = [t.clone().requires_grad_() for ab in ads for t in ab]
        ref_params = [t.clone().requires_grad_() for ab in ads for t in ab]

        def loop(layers, ps):
            h = x
            for i, lin in enumerate(layers):
                h = lin(h) + h @ ps[2 * i] @ ps[2 * i + 1]
            return h

        target = base
        fwd, ref_fwd = (lambda: loop(base, params)), (lambda: loop(ref_base, ref_params))
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters())
    off = spt.offload(target, budget=int(nbytes * frac), backend=backend, policy="plan")
    loss, ref_loss = fwd().square().mean(), ref_fwd().square().mean()
    loss.backward()
    ref_loss.backward()
    equal = all(torch.equal(p.grad, q.grad) for p, q in zip(params, ref_params))
    err = max(((p.grad - q.grad).norm() / q.grad.norm()).item() for p, q in zip(params, ref_params))
    moved = off.stats()["bytes_h2d"]["total"] / nbytes
    off.remove()
    return torch.equal(loss, ref_loss), equal, err, moved


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda" if torch.cuda.is_available() else "emu")
    args = ap.parse_args()
    dev = torch.device("cuda") if args.backend == "cuda" else torch.device("cpu")
    if args.backend == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    print(f"backend {args.backend}: {N} x Linear({D}, {D}), adapters of rank {R}, policy plan")
    print(f"{'adapters':8} {'budget':>7} | {'loss':>6} | {'gradients':>9} | {'max rel err':>11} | moved (x base)")
    for way in ("inside", "beside"):
        for frac in (0.3, 0.6, 1.2):
            leq, geq, err, moved = run(way, frac, dev, args.backend)
            print(f"{way:8} {frac:>6.0%} | {'equal' if leq else 'DIFF':>6} | {'equal' if geq else 'DIFF':>9} | "
                  f"{err:>11.3g} | {moved:.2f}")


if __name__ == "__main__":
    main()
