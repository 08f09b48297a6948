"""spillway.torch.use_allocator against PyTorch's default caching allocator, on the acceptance
workloads (random weights from configs; nothing is downloaded):

  gpt2    HF GPT-2 medium training, batch 8 x 1024, bf16 autocast, AdamW, 50 steps
  bert    HF BERT-base masked-LM training, batch 32, a random length in 32..512 each step
  resnet  torchvision ResNet-50 training, batch 128, 224x224 (skipped, and said so, without torchvision)
  llama   greedy generation, Llama-shaped (2048 hidden, 16 layers, fp16), batch 8, 128 + 256 tokens

Each (workload, allocator) runs in its own process: default | global | pool. Printed per row:
loss (or tokens) equal to the default allocator's, the peak device memory held by spillway vs
PyTorch's max_memory_reserved under the default allocator, and the median step time ratio.
Then, under a cap C (--cap), the largest batch that trains with use_allocator(budget=C) against
the largest with torch.cuda.set_per_process_memory_fraction(C / total) (3 steps each).

    SPILLWAY_LIBRARY=build/libspillway.so PYTHONPATH=python python3 bench/peers/torch_alloc.py \
        [--workloads gpt2,bert,resnet,llama] [--steps 50] [--cap 24GiB] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

GiB = 1 << 30
DEFAULT_BATCH = {"gpt2": 8, "bert": 32, "resnet": 128, "llama": 8}
LADDER = {"gpt2": [1, 2, 4, 6, 8, 12, 16, 20, 24, 32, 40, 48], "bert": [32, 64, 96, 128, 160, 192, 256],
          "resnet": [128, 192, 256, 320, 384, 448, 512], "llama": [8, 16, 32, 48, 64, 96, 128]}


# ---------------------------------------------------------------- child: one run
def child(workload: str, alloc: str, budget: str, batch: int, steps: int, cap_fraction: float) -> dict:
    import torch

    import spillway.torch as spt

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # the same seed must give the same losses run to run for the comparison to mean anything
    # (CUBLAS_WORKSPACE_CONFIG comes from the parent, before CUDA starts)
    torch.use_deterministic_algorithms(True, warn_only=True)
    a = None
    if alloc in ("global", "pool"):
        a = spt.use_allocator(budget=budget, mode=alloc)
    elif alloc == "fraction":
        torch.cuda.set_per_process_memory_fraction(cap_fraction)
    elif alloc != "default":
        raise SystemExit(f"unknown allocator {alloc}")
    region = a if (a is not None and a.mode == "pool") else None
    fn = {"gpt2": run_gpt2, "bert": run_bert, "resnet": run_resnet, "llama": run_llama}[workload]
    out: dict = {}
    try:
        if region is not None:
            with region:
                out = fn(torch, batch, steps)
        else:
            out = fn(torch, batch, steps)
        out["ok"] = True
    except torch.OutOfMemoryError as e:
        out = {"ok": False, "oom": True, "error": str(e)[:400]}
    torch.cuda.synchronize()
    out["torch_max_reserved"] = torch.cuda.max_memory_reserved()
    out["torch_max_allocated"] = torch.cuda.max_memory_allocated()
    if a is not None:
        s = spt.memory_stats()
        out["spw_held_peak"] = s["held.peak"]
        out["spw_budget"] = s["budget"]
    return out


def timed_steps(torch, step, steps: int):
    losses, times = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss)
    return {"losses": losses, "step_s": statistics.median(times[min(5, steps - 1):])}


def train_step(torch, opt, loss_fn):
    """One training step as a function: loss_fn() under bf16 autocast, backward, optimizer step;
    returns the loss."""

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    return step


def run_gpt2(torch, batch: int, steps: int) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024)).cuda().train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(1)

    def loss():
        ids = torch.randint(0, 50257, (batch, 1024), device="cuda", generator=g)
        return m(input_ids=ids, labels=ids).loss

    return timed_steps(torch, train_step(torch, opt, loss), steps)


def run_bert(torch, batch: int, steps: int) -> dict:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    m = BertForMaskedLM(BertConfig()).cuda().train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator(device="cuda").manual_seed(1)
    lengths = torch.randint(32, 513, (steps,), generator=torch.Generator().manual_seed(2)).tolist()
    it = iter(lengths)

    def loss():
        ids = torch.randint(0, 30522, (batch, next(it)), device="cuda", generator=g)
        return m(input_ids=ids, labels=ids).loss

    return timed_steps(torch, train_step(torch, opt, loss), steps)


def run_resnet(torch, batch: int, steps: int) -> dict:
    import torchvision

    torch.manual_seed(0)
    m = torchvision.models.resnet50(weights=None).cuda().train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator(device="cuda").manual_seed(1)

    def loss():
        x = torch.randn(batch, 3, 224, 224, device="cuda", generator=g)
        y = torch.randint(0, 1000, (batch,), device="cuda", generator=g)
        return torch.nn.functional.cross_entropy(m(x), y)

    return timed_steps(torch, train_step(torch, opt, loss), steps)


def run_llama(torch, batch: int, steps: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                      num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096)
    m = LlamaForCausalLM(cfg).to(torch.float16).cuda().eval()
    ids = torch.randint(0, 32000, (batch, 128), device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    new = 256
    times, toks = [], None
    for _ in range(max(1, steps // 25)):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            toks = m.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / new)
    return {"tokens_hash": hash(tuple(toks.flatten().tolist())), "tokens": toks[:, -16:].tolist(),
            "step_s": min(times)}


# ---------------------------------------------------------------- parent
def spawn(workload: str, alloc: str, budget: str, batch: int, steps: int, frac: float, timeout: int = 400) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", workload, alloc, budget, str(batch), str(steps),
           str(frac)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8"))
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {timeout} s"}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"ok": False, "error": f"rc {p.returncode}: {p.stderr[-600:]}"}
    return json.loads(lines[-1][7:])


def equal(ref: dict, got: dict) -> bool:
    if "losses" in ref:
        return got.get("losses") == ref["losses"]
    return got.get("tokens_hash") == ref.get("tokens_hash")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        w, alloc, budget, batch, steps, frac = sys.argv[2:8]
        print("RESULT " + json.dumps(child(w, alloc, budget, int(batch), int(steps), float(frac))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="gpt2,bert,resnet,llama")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--budget", default="90%", help="use_allocator budget for the comparison runs")
    ap.add_argument("--cap", default="24GiB", help="cap C for the largest-batch search ('' skips it)")
    ap.add_argument("--json")
    args = ap.parse_args()
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    results: dict = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": [], "cap": []}
    for w in args.workloads.split(","):
        if w == "resnet":
            try:
                import torchvision  # noqa: F401
            except ImportError:
                print("resnet: torchvision is not installed on this machine: not run", flush=True)
                results["rows"].append({"workload": w, "skipped": "no torchvision"})
                continue
        ref = spawn(w, "default", "", DEFAULT_BATCH[w], args.steps, 0)
        for alloc in ("global", "pool"):
            got = spawn(w, alloc, args.budget, DEFAULT_BATCH[w], args.steps, 0)
            row = {"workload": w, "allocator": alloc, "equal": equal(ref, got) if got.get("ok") else None,
                   "spw_held_peak": got.get("spw_held_peak"), "default_max_reserved": ref.get("torch_max_reserved"),
                   "held_over_reserved": (got.get("spw_held_peak") or 0) / max(1, ref.get("torch_max_reserved") or 1),
                   "step_ratio": (got.get("step_s") or 0) / max(1e-9, ref.get("step_s") or 1e-9),
                   "default_step_s": ref.get("step_s"), "step_s": got.get("step_s"),
                   "error": got.get("error") or ref.get("error")}
            results["rows"].append(row)
            print(f"{w:7s} {alloc:6s} equal {row['equal']}  held {row['spw_held_peak'] or 0:>12,} B vs default "
                  f"max_reserved {row['default_max_reserved'] or 0:>12,} B ({row['held_over_reserved']:.3f})  "
                  f"step {row['step_ratio']:.3f}x of default ({(row['step_s'] or 0) * 1e3:.1f} vs "
                  f"{(row['default_step_s'] or 0) * 1e3:.1f} ms)" + (f"  ERROR {row['error']}" if row['error'] else ""),
                  flush=True)
        if args.cap:
            from spillway import parse_size

            cap = parse_size(args.cap)
            best = {}
            for alloc in ("fraction", "global"):
                best[alloc] = 0
                for b in LADDER[w]:
                    got = spawn(w, alloc, str(cap), b, 3, cap / total)
                    if not got.get("ok"):
                        break
                    best[alloc] = b
            results["cap"].append({"workload": w, "cap": cap, "largest_fraction": best["fraction"],
                                   "largest_spillway": best["global"]})
            print(f"{w:7s} cap {args.cap}: largest batch use_allocator {best['global']} vs "
                  f"set_per_process_memory_fraction {best['fraction']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
