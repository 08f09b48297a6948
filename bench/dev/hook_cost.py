#!/usr/bin/env python3
"""Host time of spillway.torch.offload's forward hooks per block acquired, split into the C calls
(spw_acquire, spw_release, spw_release_acquire, and on emu spw_stream_synchronize, through ctypes) and the Python
around them, next to the costs of the pieces the hooks are made of.

Model: nn.Sequential of --layers nn.Linear(--dim, --dim) (bias with --bias), frozen; each Linear
is one block. For each budget in --budgets ("all": every block fits, so after the warm-up every
acquire is a hit; "tight": a quarter of the blocks fit on emu, half on --cuda (workload a's
2 GiB), so plan or lru moves blocks every pass), --warmup passes whose output is checked bitwise
against the resident model, then --passes timed passes (medians over the passes):
  hooks/block   hook_ns / acquires: the figure bench/peers/torch_offload.py prints as "hook us
                per block" (its acceptance: <= 30 us on the H200, workload a)
  C/block       time inside the C calls per acquire, measured in a second offload of the same
                model whose library functions are wrapped by timers
  python/block  in that second offload, the hooks' time less the C calls and the wrappers' own
                cost: what the Python side of the hooks costs
  pass/block    (offloaded pass - resident pass) / layers, wall time: also counts torch's own
                dispatch of the hooks (nn.Module takes its slow path when a module has hooks)
  spw_acquire   ns per call, median/90th percentile/max (on CUDA a plan acquire may enqueue the
                next blocks' copies and evictions), views built (device addresses not seen
                before: a new torch view each), bytes moved host to device per pass
On emu every acquire also synchronizes the stream (CPU torch reads the memory at once); the CUDA
path does not. The "all" budget is run a third time with that synchronize replaced by a Python
no-op (safe there: nothing is in flight once every block is resident): the emu estimate of the
CUDA path's host time. Then the first block's wrapper is called directly in a loop (no forward,
no torch dispatch; best of 5), which is the least noisy figure, and the pieces are timed alone.

    SPILLWAY_LIBRARY=build/libspillway.so PYTHONPATH=python python3 bench/dev/hook_cost.py
    SPILLWAY_LIBRARY=build/libspillway.so PYTHONPATH=python python3 bench/dev/hook_cost.py --cuda
        (workload a of torch_offload.py: 32 x Linear(8192, 8192, bias=False) bf16, batch 16,
         budgets all = 4 GiB + 8 MiB and tight = 2 GiB, policy plan; --policy plan,lru for both)
"""
from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
import time
import timeit
import types
from pathlib import Path

_REPO_PY = Path(__file__).resolve().parents[2] / "python"
if (_REPO_PY / "spillway").is_dir():
    sys.path.insert(0, str(_REPO_PY))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import spillway  # noqa: E402
import spillway.torch as spt  # noqa: E402
from spillway import _lib  # noqa: E402
from spillway.torch import _build, _device, _offload, _units  # noqa: E402

MIB = 1 << 20
_C_CALLS = ("spw_acquire", "spw_release", "spw_release_acquire", "spw_stream_synchronize", "spw_step_begin",
            "spw_step_end")
_TIMED = _C_CALLS[:4]  # the calls a hook makes; the step calls are made outside the hooks' clock


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuda", action="store_true", help="the cuda backend and workload a's shape")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--dim", type=int, help="Linear size (default 512 on emu: 1 MiB blocks; 8192 on cuda)")
    ap.add_argument("--bias", action="store_true", help="Linear with bias: two tensors a block")
    ap.add_argument("--batch", type=int, help="default 1 on emu (little compute to time around), 16 on cuda")
    ap.add_argument("--policy", default="plan", help="plan, lru, or both: plan,lru")
    ap.add_argument("--budgets", default="all,tight", help='"" for only the direct calls and the pieces')
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--passes", type=int, help="timed passes (default 200 on emu, 50 on cuda)")
    ap.add_argument("--alloc", choices=("all", "tight"),
                    help="--cuda: under use_allocator(budget=that budget + 64 MiB), the weights in its context "
                         "(SPILLWAY_CONF reaches it); the model is made and referenced a layer at a time")
    a = ap.parse_args()
    a.dim = a.dim or (8192 if a.cuda else 512)
    a.passes = a.passes or (50 if a.cuda else 200)
    a.batch = a.batch or (16 if a.cuda else 1)
    return a


def model_dtype(a: argparse.Namespace) -> torch.dtype:
    return torch.bfloat16 if a.cuda else torch.float32


def build(a: argparse.Namespace) -> nn.Sequential:
    """The model on the device (on the host under --alloc: made on the device a layer at a time)."""
    dev = "cuda" if a.cuda else "cpu"
    dtype = model_dtype(a)
    g = torch.Generator(device=dev).manual_seed(0)
    layers = []
    for _ in range(a.layers):
        lin = nn.utils.skip_init(nn.Linear, a.dim, a.dim, bias=a.bias, device=dev, dtype=dtype)
        for p in lin.parameters():
            p.data.normal_(0, a.dim ** -0.5, generator=g)
        layers.append(lin.cpu() if a.alloc else lin)
    return nn.Sequential(*layers).requires_grad_(False)


def sync(a: argparse.Namespace) -> None:
    if a.cuda:
        torch.cuda.synchronize()


def timed_passes(a, model, x, n):
    """Median wall ms of n passes, and the last output."""
    ts = []
    out = None
    for _ in range(n):
        sync(a)
        t = time.perf_counter_ns()
        out = model(x)
        sync(a)
        ts.append(time.perf_counter_ns() - t)
    return statistics.median(ts) / 1e6, out


class Timers:
    """Stand-in for _offload._lib_c whose C functions are wrapped by timers (ns per call kept);
    installed before offload() so that however the hooks bind the functions, they get these."""

    def __init__(self, real) -> None:
        self.real = real
        self.ns = {n: [] for n in _C_CALLS}
        for n in _C_CALLS:
            setattr(self, n, self._wrap(n, getattr(real, n)))

    def _wrap(self, name, fn):
        keep = self.ns[name].append
        clock = time.perf_counter_ns

        def timed(*args):
            t = clock()
            r = fn(*args)
            keep(clock() - t)
            return r

        return timed

    def __getattr__(self, name):
        return getattr(self.real, name)

    def reset(self) -> None:
        for v in self.ns.values():
            v.clear()


class NoSync:
    """Stand-in for _offload._lib_c whose spw_stream_synchronize becomes a no-op once skip is
    set (after the warm-up passes have uploaded every block); nothing is timed."""

    def __init__(self, real) -> None:
        self.real = real
        self.skip = False
        real_sync = real.spw_stream_synchronize
        self.spw_stream_synchronize = lambda *args: 0 if self.skip else real_sync(*args)
        for n in _C_CALLS:
            if n != "spw_stream_synchronize":
                setattr(self, n, getattr(real, n))

    def __getattr__(self, name):
        return getattr(self.real, name)


def run_one(a, model, x, ref, budget, policy, lib_c, wrapper_ns=0.0):
    """Offload model with _build._lib_c = lib_c (what offload() binds its C calls from), check the output after the warm-up and after
    the timed passes, remove. Per pass: wall time, hook ns per acquire, and with Timers the C ns
    per acquire and the rest of the hooks' time in the same pass (less wrapper_ns a call); the
    medians over the passes are returned, so a pass the machine interrupted does not decide."""
    real = _build._lib_c
    _build._lib_c = lib_c
    try:
        off = spt.offload(model, budget=budget, policy=policy, backend="cuda" if a.cuda else "emu")
        try:
            with torch.no_grad():
                out = None
                for _ in range(a.warmup):
                    out = model(x)
                sync(a)
                if not torch.equal(out, ref):
                    raise SystemExit(f"hook_cost: offloaded output differs from the resident model "
                                     f"(budget {budget}, policy {policy})")
                if isinstance(lib_c, Timers):
                    lib_c.reset()
                if isinstance(lib_c, NoSync):
                    lib_c.skip = True
                h0 = off.hook_stats()
                s0 = off.stats()["bytes_h2d"]["total"]
                wall, hook, c_calls, py, acq_ns = [], [], [], [], []
                hp = h0
                for _ in range(a.passes):
                    sync(a)
                    t = time.perf_counter_ns()
                    out = model(x)
                    sync(a)
                    wall.append(time.perf_counter_ns() - t)
                    h = off.hook_stats()
                    n = max(h["acquires"] - hp["acquires"], 1)
                    hook.append((h["hook_ns"] - hp["hook_ns"]) / n)
                    hp = h
                    if isinstance(lib_c, Timers):
                        c = sum(sum(lib_c.ns[k]) for k in _TIMED)
                        calls = sum(len(lib_c.ns[k]) for k in _TIMED)
                        c_calls.append(c / n)
                        py.append(hook[-1] - (c + wrapper_ns * calls) / n)
                        acq_ns += lib_c.ns["spw_acquire"] + lib_c.ns["spw_release_acquire"]
                        lib_c.reset()
                h1 = off.hook_stats()
                moved = off.stats()["bytes_h2d"]["total"] - s0
                if not torch.equal(out, ref):
                    raise SystemExit("hook_cost: offloaded output differs during the timed passes")
            return dict(ms=statistics.median(wall) / 1e6, hook_ns=statistics.median(hook),
                        c_ns=statistics.median(c_calls) if c_calls else None,
                        py_ns=statistics.median(py) if py else None, acq_ns=sorted(acq_ns) or [0],
                        acquires=(h1["acquires"] - h0["acquires"]) / a.passes,
                        view_builds=h1["view_builds"] - h0["view_builds"], moved=moved / a.passes)
        finally:
            off.remove()
    finally:
        _build._lib_c = real


def direct(a, model, x, ref, lib_c, n):
    """ns per block of the first block's forward wrapper called directly n times (no
    forward, no torch dispatch), budget "all", after a warm-up pass; lib_c as in run_one."""
    real = _build._lib_c
    _build._lib_c = lib_c
    try:
        off = spt.offload(model, budget=a.all_budget, policy="lru", backend="cuda" if a.cuda else "emu")
        try:
            with torch.no_grad():
                for _ in range(a.warmup):
                    out = model(x)
                sync(a)
                if not torch.equal(out, ref):
                    raise SystemExit("hook_cost: offloaded output differs from the resident model (direct)")
                if isinstance(lib_c, NoSync):
                    lib_c.skip = True
                if isinstance(lib_c, Timers):
                    lib_c.reset()
                mod = model[0]
                y = torch.zeros(1, device=x.device)  # an output that aliases nothing
                # the block's wrapper around a forward that does nothing, as inside the top-level
                # forward (its common case): each call acquires, returns y, releases
                wrapped = off._block_forward(mod, lambda *args: y, off._needs[id(mod)])
                clock = time.perf_counter_ns
                best = None
                off._depth = 1
                try:
                    for _ in range(5):
                        t = clock()
                        for _ in range(n):
                            wrapped(mod, x)
                        dt = (clock() - t) / n
                        best = dt if best is None else min(best, dt)
                finally:
                    off._depth = 0
                    off._flush()
                sync(a)
                c = {}
                if isinstance(lib_c, Timers):
                    c = {k: statistics.median(lib_c.ns[k]) for k in _TIMED if lib_c.ns[k]}
            return best, c
        finally:
            off.remove()
    finally:
        _build._lib_c = real


def wrapper_cost() -> float:
    """ns a Timers wrapper adds around a call, outside what it records."""
    t = Timers(types.SimpleNamespace(**{n: (lambda *args: 0) for n in _C_CALLS}))
    f = t.spw_release
    n = 200000
    bare = min(timeit.repeat(lambda: (lambda *args: 0)(1, None), number=n, repeat=5)) / n
    wrapped = min(timeit.repeat(lambda: f(1, None), number=n, repeat=5)) / n
    inside = statistics.median(t.ns["spw_release"])
    return (wrapped - bare) * 1e9 - inside


def per_call_ns(stmt, g, n=100000) -> float:
    return min(timeit.repeat(stmt, globals=g, number=n, repeat=5)) / n * 1e9


def components(a: argparse.Namespace) -> None:
    """ns of the pieces the hooks are made of, on this backend and device."""
    # a tenth of the calls on cuda, where several pieces launch work: the whole fits in a minute
    def call_ns(stmt: str, g: dict, n: int = 100000) -> float:
        return per_call_ns(stmt, g, max(1000, n // 10) if a.cuda else n)

    dev = "cuda" if a.cuda else "cpu"
    w = torch.zeros(4, 4, device=dev)
    v1, v2 = torch.zeros(4, 4, device=dev), torch.zeros(4, 4)  # as the hooks swap: device view, host view
    lin = nn.Linear(4, 4, device=dev).requires_grad_(False)
    hooked = nn.Linear(4, 4, device=dev).requires_grad_(False)
    hooked.register_forward_pre_hook(lambda m, args: None)
    hooked.register_forward_hook(lambda m, args, out: None)
    xi = torch.zeros(1, 4, device=dev)
    pairs = ((w, v1),)
    d = {12345: pairs}
    lc = _lib.lib
    nop = NoSync(types.SimpleNamespace(**{n: None for n in _C_CALLS}))
    nop.skip = True
    g = dict(nop=nop.spw_stream_synchronize, time=time, w=w, v1=v1, v2=v2, lin=lin, hooked=hooked, xi=xi, d=d, torch=torch, pairs=pairs)
    rows = [
        ("perf_counter_ns pair", call_ns("t = time.perf_counter_ns(); x = time.perf_counter_ns() - t", g)),
        ("t.data = v", call_ns("w.data = v1; w.data = v2", g) / 2),
        ("dict get of a view tuple", call_ns("d.get(12345)", g)),
        ("out.data_ptr() range test", call_ns("p = xi.data_ptr(); 0 <= p < 4096", g)),
        ("try/finally", call_ns("try:\n    pass\nfinally:\n    pass", g)),
        ("a Python no-op call (NoSync's stand-in)", call_ns("nop(1, None)", g)),
    ]
    if a.cuda:
        g.update(raw=torch._C._cuda_getCurrentRawStream)
        rows.append(("torch._C._cuda_getCurrentRawStream", call_ns("raw(0)", g)))
    dv = torch.empty(0, device=dev)
    tdev = torch.device(dev, 0) if a.cuda else torch.device(dev)
    g.update(at=_units._storage_at, dev=tdev, dv=dv)
    rows.append(("storage over a unit at a new address", call_ns("at(xi.data_ptr(), 16, dev)", g, 20000)))
    st = _units._storage_at(xi.data_ptr(), 16, tdev)
    g.update(st=st)
    rows.append(("Tensor.set_ of one tensor onto it", call_ns("dv.set_(st, 0, (2, 2), (2, 1))", g, 20000)))
    with torch.inference_mode():
        rows.append(("the same set_ inside inference mode", call_ns("dv.set_(st, 0, (2, 2), (2, 1))", g, 20000)))
        rows.append(("t.data = v inside inference mode", call_ns("w.data = v1; w.data = v2", g) / 2))
        rows.append(("enter + exit inference_mode(False) inside it",
                     call_ns("with torch.inference_mode(False):\n    pass", g, 20000)))
    with torch.no_grad():
        plain = call_ns("lin(xi)", g, 20000)
        rows.append(("torch's dispatch of a no-op pre+post hook pair", call_ns("hooked(xi)", g, 20000) - plain))
    stream = torch.cuda.current_stream().cuda_stream if a.cuda else None
    with spillway.Context(budget="64MiB", policy="lru", backend="cuda" if a.cuda else "emu") as ctx:
        host = torch.zeros(MIB + 4096, dtype=torch.uint8)
        host = host[(-host.data_ptr()) % 4096:][:MIB]
        buf = ctx.register_host(host.data_ptr(), MIB, read_only=True)
        ptr = ctypes.c_void_p()
        g.update(acq=lc.spw_acquire, rel=lc.spw_release, sync=lc.spw_stream_synchronize, h=buf.handle,
                 s=stream, ref=ctypes.byref(ptr), ch=ctx._handle)
        buf.acquire("r", stream)
        buf.release(stream)
        sync(a)
        rows.append(("spw_acquire + spw_release, resident, ctypes", call_ns("acq(h, s, 1, ref); rel(h, s)", g, 20000)))
        if not a.cuda:
            rows.append(("spw_stream_synchronize (emu only)", call_ns("sync(ch, None)", g, 20000)))
        sync(a)
        buf.close()
    print("pieces, ns per call:")
    for name, ns in rows:
        print(f"  {name:<48} {ns:8.0f}")


def main() -> None:
    a = parse()
    if a.cuda:
        if not torch.cuda.is_available():
            raise SystemExit("hook_cost: --cuda needs CUDA torch and a GPU")
        # the outputs are checked bitwise against the resident model, as in torch_offload.py
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    if not a.cuda:
        torch.set_num_threads(1)
    if a.alloc and not a.cuda:
        raise SystemExit("hook_cost: --alloc needs --cuda")
    # "all" leaves room for the arena's rounding; "tight" holds a quarter (emu) or half (cuda) of the
    # blocks, never less than the device arena's 2 MiB page offload() requires
    # known before the model exists: under --alloc, use_allocator comes before any CUDA allocation
    block = (a.dim * a.dim + (a.dim if a.bias else 0)) * torch.empty(0, dtype=model_dtype(a)).element_size()
    whole = block * a.layers
    page = _device._ARENA_PAGE
    a.all_budget = whole + whole // 8 + 2 * page
    budgets = {"all": a.all_budget,
               "tight": max(whole // 2 if a.cuda else whole // 4, -(-block // page) * page)}
    if a.alloc:
        spt.use_allocator(budget=budgets[a.alloc] + 64 * MIB)
    model = build(a)
    assert block == sum(p.numel() * p.element_size() for p in model[0].parameters())
    dev = "cuda" if a.cuda else "cpu"
    x = torch.randn(a.batch, a.dim, device=dev, dtype=next(model.parameters()).dtype)
    with torch.no_grad():
        if a.alloc:  # the same kernels a layer at a time: the resident model's output, bitwise
            res_ms, ref = float("nan"), x
            for lin in model:
                ref = lin.cuda()(ref)
                lin.cpu()
        else:
            for _ in range(a.warmup):
                ref = model(x)
            res_ms, ref = timed_passes(a, model, x, a.passes)
    print(f"hook_cost: {'cuda' if a.cuda else 'emu'}, {a.layers} x Linear({a.dim}, {a.dim}, bias={a.bias}) "
          f"{next(model.parameters()).dtype}, batch {a.batch}, {a.passes} passes; "
          f"resident pass {res_ms:.3f} ms; torch {torch.__version__}")
    wc = wrapper_cost()
    print(f"  (timer wrapper cost {wc:.0f} ns a call, left out of C/block and python/block)")
    hdr = (f"  {'budget':<16} {'policy':<6} {'hooks/block':>11} {'C/block':>9} {'python/block':>12} "
           f"{'pass/block':>10} {'acq/pass':>8} {'spw_acquire ns med/p90/max':>28} {'views built':>11} "
           f"{'moved/pass':>10}")
    for policy in a.policy.split(",") if a.budgets else ():
        print(hdr)
        for bname in [a.alloc] if a.alloc else a.budgets.split(","):
            budget = budgets[bname]
            plain = run_one(a, model, x, ref, budget, policy, _offload._lib_c)
            t = run_one(a, model, x, ref, budget, policy, Timers(_offload._lib_c), wc)
            hook, c_ns = plain["hook_ns"], t["c_ns"]
            acq = t["acq_ns"]
            pct = f"{acq[len(acq) // 2]}/{acq[int(len(acq) * 0.9)]}/{acq[-1]}"
            label = f"{bname} {budget / MIB:.0f}MiB"
            print(f"  {label:<16} {policy:<6} {hook / 1e3:9.2f}us {c_ns / 1e3:7.2f}us {t['py_ns'] / 1e3:10.2f}us "
                  f"{(plain['ms'] - res_ms) * 1e3 / a.layers:8.2f}us {plain['acquires']:8.1f} {pct:>28} "
                  f"{plain['view_builds']:11d} {plain['moved'] / MIB:7.1f}MiB")
            if bname == "all" and not a.cuda:
                ns = run_one(a, model, x, ref, budget, policy, NoSync(_offload._lib_c))
                print(f"  {'  no emu sync':<16} {policy:<6} {ns['hook_ns'] / 1e3:9.2f}us "
                      f"{'':>9} {'':>12} {(ns['ms'] - res_ms) * 1e3 / a.layers:8.2f}us")
    if a.alloc:
        return
    n = 2000 if a.cuda else 20000
    d_sync, _ = direct(a, model, x, ref, _offload._lib_c, n)
    _, c_t = direct(a, model, x, ref, Timers(_offload._lib_c), n)
    # medians a call: inside the model's forward a block's wrapper makes one C call (its release
    # goes with the next acquire); acquire + release where that call is absent
    c_ns = c_t["spw_release_acquire"] if "spw_release_acquire" in c_t else c_t["spw_acquire"] + c_t["spw_release"]
    if a.cuda:
        print(f"hooks called directly, resident block: {d_sync / 1e3:.2f} us per block, of which C "
              f"{c_ns / 1e3:.2f} us and Python {(d_sync - c_ns) / 1e3:.2f} us")
    else:
        d_nosync, _ = direct(a, model, x, ref, NoSync(_offload._lib_c), n)
        print(f"hooks called directly, resident block: {d_sync / 1e3:.2f} us per block with the emu sync; "
              f"{d_nosync / 1e3:.2f} us without it (the CUDA path), of which C {c_ns / 1e3:.2f} us and "
              f"Python {(d_nosync - c_ns) / 1e3:.2f} us")
    components(a)


if __name__ == "__main__":
    main()
