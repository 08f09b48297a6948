#!/usr/bin/env python3
"""Where spillway's C AdamW and torch's single-tensor AdamW (foreach=False) part, operation by
operation, on the torch in this process.

One AdamW step over the same random parameters, gradients and state (state from a few earlier
steps, so that no moment is zero), then for each array (exp_avg, exp_avg_sq, param) the number
of elements that differ and the largest difference in units in the last place. Each operation of
torch's formula is also recomputed as the C kernel computes it (optim_kernel.h: fused
multiply-adds as fmaf, emulated here in float64, whose product of two floats is exact), and
compared with torch's own result of that operation, so that the operation whose rounding
differs is named.

    PYTHONPATH=python python3 bench/dev/adamw_parts.py [--n 1000003] [--steps 3] [--threads 1]
"""
import argparse

import numpy as np
import torch

import spillway.optim as so


def ulps(a, b):
    """Largest distance in units in the last place between two float32 arrays (0 when equal)."""
    ia = a.view(np.int32).astype(np.int64)
    ib = b.view(np.int32).astype(np.int64)
    ia = np.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = np.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int(np.abs(ia - ib).max()) if a.size else 0


def report(name, mine, ref):
    mine, ref = np.asarray(mine, dtype=np.float32), np.asarray(ref, dtype=np.float32)
    diff = int((mine.view(np.int32) != ref.view(np.int32)).sum())
    d = np.abs(mine.astype(np.float64) - ref)
    rel = float(np.max(d / np.maximum(np.abs(ref.astype(np.float64)), 1e-30)))
    # the tests' measure: the largest difference over the array's largest element (the ratio per
    # element is arbitrarily large where the reference is near zero)
    of_max = float(d.max() / max(float(np.abs(ref).max()), 1e-30)) if ref.size else 0.0
    print(f"  {name:44s} differ {diff:9d} of {mine.size}  max ulps {ulps(mine, ref):6d}  max rel {rel:.3e}"
          f"  of the largest {of_max:.3e}")
    return diff


def f32(x):
    return np.asarray(x, dtype=np.float64).astype(np.float32)


def fma(a, b, c):
    """fmaf(a, b, c) for float32 arrays: a * b is exact in float64; one rounding to float64, then
    to float32 (the double rounding is wrong only in rare ties)."""
    return f32(np.asarray(a, np.float64) * np.asarray(b, np.float64) + np.asarray(c, np.float64))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1_000_003)
    ap.add_argument("--steps", type=int, default=3, help="steps before the compared one")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, spillway isa {so.isa()}, moment formula {so.torch_moment_formula()}")
    g = torch.Generator().manual_seed(0)
    p = torch.randn(a.n, generator=g)
    opt = torch.optim.AdamW([torch.nn.Parameter(p)], lr=a.lr, weight_decay=a.weight_decay, foreach=False)
    param = opt.param_groups[0]["params"][0]
    for _ in range(a.steps):
        param.grad = torch.randn(a.n, generator=g)
        opt.step()
    st = opt.state[param]
    grad = torch.randn(a.n, generator=g)
    p0, m0, v0 = param.detach().clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone()
    step = int(st["step"]) + 1

    # torch's step
    param.grad = grad.clone()
    opt.step()
    tp, tm, tv = param.detach().numpy().copy(), st["exp_avg"].numpy().copy(), st["exp_avg_sq"].numpy().copy()

    # spillway's step on copies of the same start
    sp, sm, sv = p0.clone(), m0.clone(), v0.clone()
    so.adamw_step([sp], [grad.clone()], [sm], [sv], step=step, lr=a.lr, weight_decay=a.weight_decay)
    print(f"one step ({step}) from the same state, spillway against torch foreach=False:")
    report("exp_avg", sm.numpy(), tm)
    report("exp_avg_sq", sv.numpy(), tv)
    report("param", sp.numpy(), tp)

    # torch's formula op by op (torch ops), against the C kernel's arithmetic for each op
    b1, b2, eps, lr, wd = 0.9, 0.999, 1e-8, a.lr, a.weight_decay
    print("torch's operations, each against the kernel's arithmetic on the same inputs:")
    P = p0.clone().mul_(1 - lr * wd)
    report("param.mul_(1 - lr*wd)", P.numpy(), f32(p0.numpy() * np.float32(1 - lr * wd)))
    M = m0.clone().lerp_(grad, 1 - b1)
    w = np.float32(1 - b1)
    report("exp_avg.lerp_ vs fma(w, g - m, m)", M.numpy(), fma(w, f32(grad.numpy() - m0.numpy()), m0.numpy()))
    report("exp_avg.lerp_ vs m + w*(g - m) unfused", M.numpy(),
           f32(m0.numpy() + f32(w * f32(grad.numpy() - m0.numpy()))))
    Vm = v0.clone().mul_(b2)
    report("exp_avg_sq.mul_(b2)", Vm.numpy(), f32(v0.numpy() * np.float32(b2)))
    V = Vm.clone().addcmul_(grad, grad, value=1 - b2)
    a2 = np.float32(1 - b2)
    gn = grad.numpy()
    report("addcmul_ vs fma(a2*g, g, v)", V.numpy(), fma(f32(a2 * gn), gn, Vm.numpy()))
    report("addcmul_ vs v + (a2*g)*g unfused", V.numpy(), f32(Vm.numpy() + f32(f32(a2 * gn) * gn)))
    report("addcmul_ vs fma(g, g, v) after a2 (a2*(g*g))", V.numpy(), f32(Vm.numpy() + f32(a2 * f32(gn * gn))))
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    S = V.sqrt()
    report("sqrt", S.numpy(), np.sqrt(V.numpy()))
    D = (S / bc2 ** 0.5)
    report("sqrt / bc2_sqrt (divide)", D.numpy(), f32(S.numpy() / np.float32(bc2 ** 0.5)))
    report("sqrt / bc2_sqrt vs * (1/bc2_sqrt)", D.numpy(), f32(S.numpy() * np.float32(1 / bc2 ** 0.5)))
    D2 = D.clone().add_(eps)
    report("add_(eps)", D2.numpy(), f32(D.numpy() + np.float32(eps)))
    step_size = lr / bc1
    Pn = P.clone().addcdiv_(M, D2, value=-step_size)
    nss = np.float32(-step_size)
    report("addcdiv_ vs p + (s*m)/d", Pn.numpy(), f32(P.numpy() + f32(f32(nss * M.numpy()) / D2.numpy())))
    report("addcdiv_ vs fma(s*m, 1/d, p)", Pn.numpy(), fma(f32(nss * M.numpy()), f32(1 / D2.numpy()), P.numpy()))
    report("addcdiv_ vs p + s*(m/d)", Pn.numpy(), f32(P.numpy() + f32(nss * f32(M.numpy() / D2.numpy()))))
    report("torch's ops chained = torch's step (param)", Pn.numpy(), tp)


if __name__ == "__main__":
    main()
