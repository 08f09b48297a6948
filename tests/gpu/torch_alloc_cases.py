"""Scenarios of spillway.torch.use_allocator, several per process (the routing is per process),
run by tests/gpu/test_torch_alloc_gpu.py:

    python torch_alloc_cases.py ALLOCATOR BUDGET CASE[,CASE...]

ALLOCATOR: default | global | pool. The cases run in the order given; each prints one line
`RESULT {"case": ..., ...}` with what the test asserts (an exception in a case is reported as
"crash" and the next case still runs). Before each case spillway.torch.empty_cache() gives the
previous case's cached memory back, so each starts from the same budget.
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402
from torch import nn  # noqa: E402

import spillway.torch as spt  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.use_deterministic_algorithms(True, warn_only=True)  # the same seed gives the same losses run to run


_case = {"name": ""}


def report(**kw) -> None:
    print("RESULT " + json.dumps(dict(case=_case["name"], **kw)), flush=True)


def start(alloc: str, budget: str):
    if alloc == "default":
        return None
    return spt.use_allocator(budget=budget, mode=alloc)


class Region:
    """`with region(a):` enters the pool (pool mode); nothing otherwise."""

    def __init__(self, a) -> None:
        self.a = a

    def __enter__(self):
        if self.a is not None and self.a.mode == "pool":
            self.a.__enter__()

    def __exit__(self, *exc):
        if self.a is not None and self.a.mode == "pool":
            self.a.__exit__(*exc)


def mem(a) -> dict:
    out = {"torch_max_reserved": torch.cuda.max_memory_reserved(), "torch_max_allocated": torch.cuda.max_memory_allocated()}
    if a is not None:
        s = spt.memory_stats()
        out.update(spw_held_peak=s["held.peak"], spw_budget=s["budget"], spw_live=s["live.current"])
    return out


def make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(), nn.Linear(4096, 10)).cuda()


def case_train(a):
    m = make_mlp()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    g = torch.Generator(device="cuda").manual_seed(1)
    losses = []
    with Region(a):
        for _ in range(20):
            x = torch.randn(256, 1024, device="cuda", generator=g)
            y = torch.randint(0, 10, (256,), device="cuda", generator=g)
            loss = nn.functional.cross_entropy(m(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    report(losses=losses, **mem(a))


def case_oom(a):
    out = {}
    with Region(a):
        keep = torch.ones(256 * MiB // 4, device="cuda")
        try:
            torch.empty(3 * GiB, dtype=torch.uint8, device="cuda")
            out["raised"] = None
        except Exception as e:  # noqa: BLE001 - the type is the result
            out.update(raised=type(e).__name__, is_torch_oom=isinstance(e, torch.OutOfMemoryError),
                       is_spillway=isinstance(e, spt.OutOfMemoryError), message=str(e)[:1500])
        # backward that does not fit (global mode routes autograd's threads too)
        if a is None or a.mode == "global":
            w = torch.ones(8192, 8192, device="cuda", requires_grad=True)
            try:
                xs = [torch.ones(8192, 8192, device="cuda") * i for i in range(10)]  # 2.5 GiB live
                (sum((w * x).sum() for x in xs)).backward()
                out["backward_raised"] = None
            except Exception as e:  # noqa: BLE001
                out.update(backward_raised=type(e).__name__, backward_is_torch_oom=isinstance(e, torch.OutOfMemoryError),
                           backward_has_message="budget" in str(e))
            xs = None
        # still usable afterwards
        from spillway.torch import _alloc

        out["before_z"] = dict(reserved=torch.cuda.memory_reserved(), allocated=torch.cuda.memory_allocated(),
                               inactive=torch.cuda.memory_stats().get("inactive_split_bytes.all.current"),
                               reclaims=dict(_alloc._reclaims))
        z = torch.ones(64 * MiB // 4, device="cuda") * 2
        out["after_sum"] = float(z.sum().item()) + float(keep[0].item())
    report(**out, **mem(a))


def _side_stream_round(side) -> bool:
    """Five 64 MiB tensors read on a side stream and freed with record_stream; True when the side
    stream read what it should (no block was reused before its work on the side stream ended)."""
    ok = True
    for _ in range(5):
        x = torch.ones(64 * MiB // 4, device="cuda")
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles before reading x
            out = x * 2
        x.record_stream(side)
        del x
        z = torch.full((64 * MiB // 4,), 7.0, device="cuda")  # would reuse x's block if not recorded
        torch.cuda.synchronize()
        ok = ok and bool((out == 2).all().item())
        del z, out
    return ok


def _stream_counts() -> dict:
    s = torch.cuda.memory_stats()
    out = dict(awaiting=s["active_bytes.all.current"] - s["allocated_bytes.all.current"],
               torch_reserved=torch.cuda.memory_reserved())
    w = spt.memory_stats()
    out.update(spw_live=w["live.current"], spw_held=w["held.current"], spw_requested=w["requested.current"])
    return out


def case_record_stream(a):
    with Region(a):
        side = torch.cuda.Stream()
        ok = _side_stream_round(side)
    out = {"correct": ok}
    if a is not None and a.mode == "global":
        from spillway.torch import _alloc

        cycles0 = _alloc._cycles["count"]
        # the blocks the side stream used await it (PyTorch defers them while a pool is routed to);
        # collect() cycles the routing and they go back to spillway
        out["round1"] = _stream_counts()
        out["collected1"] = spt.collect()
        out["after1"] = _stream_counts()
        # the same again: the memory is spillway's to hand out again, and nothing accumulates
        out["correct2"] = _side_stream_round(side)
        out["round2"] = _stream_counts()
        out["collected2"] = spt.collect()
        out["after2"] = _stream_counts()
        out["collect_idle"] = spt.collect()  # nothing awaits: no cycle
        out["cycles"] = _alloc._cycles["count"] - cycles0
        out["summary_line"] = [ln for ln in spt.memory_summary().splitlines() if "other streams" in ln]
    report(**out, **mem(a))


def case_empty_cache(a):
    base = spt.memory_allocated()  # what earlier cases in this process still hold
    with Region(a):
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        x.fill_(1)
        del x
        torch.cuda.synchronize()
    before = spt.memory_reserved()
    torch_before = torch.cuda.memory_reserved()
    spt.empty_cache()
    report(base=base, before=before, after=spt.memory_reserved(), torch_before=torch_before,
           torch_after=torch.cuda.memory_reserved())


def case_stats(a):
    with Region(a):
        x = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
        s1 = spt.memory_stats()
        alloc1 = spt.memory_allocated()
        peak1 = spt.max_memory_allocated()
        del x
        y = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
        torch.cuda.empty_cache()
        spt.reset_peak_memory_stats()
        peak2 = spt.max_memory_allocated()
        torch_stats_ok = "allocated_bytes.all.current" in torch.cuda.memory_stats()
        summary = spt.memory_summary()
        del y
    report(alloc1=alloc1, peak1=peak1, peak2=peak2, held_peak=s1["held.peak"], budget=s1["budget"],
           torch_stats_ok=torch_stats_ok, summary_has=("budget" in summary and "offloaded weights" in summary),
           torch_summary_ok=len(torch.cuda.memory_summary()) > 0)


def case_cudnn(a):
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3), nn.BatchNorm2d(64), nn.ReLU(), nn.Conv2d(64, 128, 3, 2, 1),
                      nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)).cuda()
    x = torch.randn(16, 3, 224, 224, device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    out = {}
    with Region(a):
        try:
            loss = m(x).float().pow(2).mean()
            loss.backward()
            out.update(ok=True, loss=loss.item(), grad=m[0].weight.grad.abs().sum().item())
        except Exception as e:  # noqa: BLE001
            out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:800]}")
        finally:
            torch.backends.cudnn.benchmark = False
    report(**out, **mem(a))


def case_compile(a):
    m = make_mlp()
    x = torch.randn(64, 1024, device="cuda", generator=torch.Generator(device="cuda").manual_seed(3))
    out = {}
    with Region(a):
        try:
            ref = m(x)
            cm = torch.compile(m)
            y = cm(x)
            y.sum().backward()
            out.update(ok=True, max_diff=(y - ref).abs().max().item())
        except Exception as e:  # noqa: BLE001
            out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:800]}")
    report(**out, **mem(a))


def case_graph(a):
    x = torch.ones(1024, device="cuda")
    out = {}
    g = torch.cuda.CUDAGraph()
    t0 = time.perf_counter()
    try:
        with torch.cuda.graph(g):
            y = x * 2
        g.replay()
        torch.cuda.synchronize()
        out.update(captured=True, value=y[0].item())
    except Exception as e:  # noqa: BLE001
        out.update(captured=False, error=f"{type(e).__name__}: {str(e)[:600]}")
    out["seconds"] = time.perf_counter() - t0
    if a is not None and a.mode == "pool":  # inside the region: refused at once
        with a:
            try:
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    _ = x * 3
                out["inside"] = "captured"
            except RuntimeError as e:
                out["inside"] = str(e)[:300]
    report(**out)


def llama(layers=8):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096,
                      attn_implementation="eager")  # no fused attention: the same kernels every run
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(torch.float16).eval()


def case_offload_kv(a, budget_mib: int, new_tokens: int = 768, batch: int = 8):
    m = llama()
    nbytes = sum(p.numel() * p.element_size() for p in m.parameters())
    ids = torch.randint(0, 32000, (batch, 32), generator=torch.Generator().manual_seed(4)).cuda()
    out = {"weights": nbytes}
    if a is None:
        m.cuda()
        with torch.no_grad():
            toks = m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        out["tokens"] = toks.tolist()
        report(**out, **mem(a))
        return
    m.requires_grad_(False)
    off = spt.offload(m, budget=f"{budget_mib}MiB")
    try:
        with torch.no_grad():
            toks = m.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        out["tokens"] = toks.tolist()
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {str(e)[:1500]}"
    s = spt.memory_stats()
    out.update(evictions=s["evictions_clean.total"] + s["evictions_dirty.total"], held_peak=s["held.peak"],
               budget=s["budget"], tensors_peak_hint=s["live.peak"], summary=spt.memory_summary()[:1200])
    off.remove()
    report(**out, **mem(a))


def main() -> None:
    alloc, budget, cases = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    a = start(alloc, budget)
    for case in cases:
        _case["name"] = case
        if a is not None:
            spt.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        try:
            if case == "offload_kv":
                case_offload_kv(a, int(budget.rstrip("MiB")) if a is not None else 0)
            else:
                globals()["case_" + case](a)
        except Exception as e:  # noqa: BLE001 - reported; the next case runs
            report(crash=f"{type(e).__name__}: {str(e)[:1500]}")
        print(f"case {case} {alloc}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
