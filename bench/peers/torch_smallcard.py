#!/usr/bin/env python3
"""A 13.5 GiB model on an 8 GB card, as a user runs it: transformers' loading and generate().

The process is capped with `spillway run` and the weights are streamed by spillway.torch.

The model is workload b of torch_offload.py: a Llama-shaped decoder (hidden 4096, intermediate
14336, 32 layers, 32 heads, 8 kv heads, vocab 32000), random bf16 weights ~ N(0, 0.02) made on
the GPU, norms 1; 13.5 GiB. It is saved once with save_pretrained into --ckpt (skipped when that
directory exists). Each variant, in a process of its own, loads it as a user does,
AutoModelForCausalLM.from_pretrained(ckpt, torch_dtype=torch.bfloat16) on the CPU, and calls
generate(): batch 8 x 512 prompt tokens (fixed random ids, attention mask all ones), 64 new
tokens, greedy, with the KV cache, min_new_tokens=64 so that every variant makes all 64.

Variants
  resident          model.to("cuda") on the whole device: the reference tokens, kept in --ckpt
                    for later runs that leave resident out
  capped-alloc      under `spillway run --budget 8GiB`: `with spillway.torch.use_allocator():`
                    without a budget (the library's default, 90% of the device, which the cap
                    makes 8 GiB), then spillway.torch.offload(model) without one (the weights
                    share that context with PyTorch's tensors)
  capped-offload    under `spillway run --budget 8GiB`: spillway.torch.offload(model) alone,
                    without a budget (the device's free memory, which the cap makes about 8 GiB,
                    less offload's reserve for activations)
  uncapped-alloc    the same two flows on the whole device, given the budget their capped twin
  uncapped-offload  resolved: use_allocator(budget=B) and offload(model, budget=B)

Columns
  budget          spillway's budget: use_allocator's context (alloc) or the Offload's (offload)
  prefill ms      a generate() of 1 new token: its one forward, over the prompt
  generate s      a generate() of 64 new tokens
  decode tok/s    new tokens per second across the batch after the first token of each
                  sequence: 8 x 63 / (generate s - prefill s)
  tokens          the 8 x 64 new tokens equal to resident's, or not
  peak GiB        device memory at peak over the process: PyTorch's max_memory_reserved plus the
                  Offload context's peak held bytes; under use_allocator that context's peak
                  alone (PyTorch's segments are inside it)
  cap peak GiB    capped variants: the interposer's peak charged bytes, every CUDA allocation of
                  the process (`spillway run --report`, at its exit)
  moved MiB/fwd   bytes uploaded per forward over the 64-token generate
  hook us         the Offload's median host time per acquire (hook_stats()["hook_us_median"])
Each variant also drives --trace-steps decode steps by hand, fed resident's tokens, and records
per step the logits and every layer's hidden state at the new position: the table says at which
step and layer a variant first differs from resident (and resident from a second run of its
own), and by how much.
An out-of-memory error (torch's; spillway's is one) ends its variant, which reports it with the
phase it happened in. Timing starts after one untimed 64-token generate (the plan policy learns
its step in the first few forwards); --repeats timed calls of each kind, the median. Every
process runs deterministic kernels (torch.use_deterministic_algorithms,
CUBLAS_WORKSPACE_CONFIG=:4096:8, and SDPA without cuDNN's attention, which deterministic mode
does not cover) so that tokens compare exactly.

The acceptance ratios are decode tok/s of capped-alloc over uncapped-alloc and of capped-offload
over uncapped-offload, what the cap itself costs at the same budgets; the target is >= 0.9.
Exit status 1 when a variant failed or its tokens differ from resident's.

    python3 bench/peers/torch_smallcard.py                           # every variant
    python3 bench/peers/torch_smallcard.py --variants resident,capped-offload,uncapped-offload \\
        --budget 8GiB --ckpt /tmp/llama13g --json /tmp/smallcard.json
    python3 bench/peers/torch_smallcard.py --smoke                   # an 8 MiB Llama: the control flow

--smoke caps the process at 1 GiB rather than a scaled-down budget: the CUDA runtime and
PyTorch need some device memory of their own whatever the model's size. Needs transformers
(without it, says so and exits 0) and ./build/spillway (make build); spillway is imported from
python/ in this repository.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch

import launcher  # same directory: a child process and its result line

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "python"))
SPILLWAY_CLI = ROOT / "build" / "spillway"

# The model is built by torch_offload.py's code for its workload b, so the two stay one shape.
_spec = importlib.util.spec_from_file_location("torch_offload", Path(__file__).with_name("torch_offload.py"))
torch_offload = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_offload)

VARIANTS = ["resident", "capped-alloc", "uncapped-alloc", "capped-offload", "uncapped-offload"]
TWIN = {"uncapped-alloc": "capped-alloc", "uncapped-offload": "capped-offload"}
SHAPE = torch_offload.B_SHAPE  # hidden, inter, layers, heads, kv, vocab, batch 8, prompt 512
SMOKE_SHAPE = dict(hidden=256, inter=704, layers=4, heads=4, kv=2, vocab=2048, batch=2, prompt=32)
NEW_TOKENS = {False: 64, True: 8}  # by --smoke
TARGET = 0.9
RESULT = "RESULT "
# What `spillway run --report` prints at exit for each device the process used.
CHARGED = re.compile(r"device \d+: budget [^,]*, peak charged (\d+) B")
GiB = 1 << 30
MiB = 1 << 20
# Children log on the parent's clock, so that the log reads as one timeline.
T0 = float(os.environ.setdefault("SMALLCARD_T0", repr(time.time())))


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f} s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# the checkpoint


def build_checkpoint(ckpt: Path, shape: Dict[str, int]) -> None:
    """Random weights made on the GPU, copied to the host, saved with save_pretrained. Written
    beside ckpt and renamed at the end, so that a directory at ckpt is always a whole one."""
    cfg = types.SimpleNamespace(b_shape=shape, smoke=False, dev=torch.device("cuda", 0))
    model, _ = torch_offload.build_b(cfg, torch.device("cpu"))
    partial = ckpt.with_name(ckpt.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    # transformers 5 writes safetensors only and no longer takes the argument.
    takes = "safe_serialization" in inspect.signature(model.save_pretrained).parameters
    safe = {"safe_serialization": True} if takes else {}
    model.save_pretrained(partial, **safe)
    os.replace(partial, ckpt)


# ----------------------------------------------------------------------------------------------
# the child: one variant


def weight_budget(text: Optional[str]) -> Union[int, str, None]:
    """--weight-budget as offload() and use_allocator() take it: bytes, or a size string."""
    if text is None:
        return None
    return int(text) if text.isdigit() else text


@contextlib.contextmanager
def placed(variant: str, model: torch.nn.Module, budget: Union[int, str, None]) -> Iterator[Optional[Any]]:
    """The model on the device as the variant puts it there; yields its Offload (None: resident).
    The capped variants give no budget: spillway's defaults read the device the cap shows."""
    if variant == "resident":
        model.to("cuda")
        yield None
        return
    import spillway.torch as spt

    if variant.endswith("-alloc"):
        with spt.use_allocator(budget=budget):  # before the first CUDA allocation
            yield spt.offload(model)
    else:
        yield spt.offload(model, budget=budget)


def generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, new: int) -> torch.Tensor:
    """The new tokens of a greedy generate() of exactly `new` tokens."""
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                         do_sample=False, use_cache=True, pad_token_id=0)  # nothing is padded: no warning
    return out[:, ids.shape[1]:]


def last_logits(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The logits at the prompt's last position of one forward over the prompt, on the host."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=False, logits_to_keep=1)
    return out.logits[:, -1].cpu()


def decode_trace(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, tokens: torch.Tensor,
                 steps: int) -> Dict[str, torch.Tensor]:
    """The decode with the KV cache driven by hand and fed `tokens` (the reference's, so that
    every variant computes the same steps whatever it would pick): per step the last position's
    logits and every layer's hidden state there, on the host. Where a variant's generate() parts
    from resident's, this says at which step and layer the numbers first differ, and by how much:
    an ulp at one layer is a kernel choice; a large difference, a wrong or torn weight."""
    logits, hidden = [], []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1].cpu())
        past = out.past_key_values
        for s in range(steps):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            out = model(input_ids=tokens[:, s:s + 1].to(ids.device), attention_mask=mask, past_key_values=past,
                        use_cache=True, output_hidden_states=True, logits_to_keep=1)
            past = out.past_key_values
            logits.append(out.logits[:, -1].cpu())
            hidden.append(torch.stack([h[:, -1] for h in out.hidden_states]).cpu())
    return dict(logits=torch.stack(logits), hidden=torch.stack(hidden))


def trace_diff(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """Where two decode_trace()s first differ: (step, logits' largest difference there) and, for
    a decode step, the first hidden state (0: the embeddings, i: layer i's output) that differs
    and its largest difference; {} when equal."""
    for s in range(want["logits"].shape[0]):
        a, b = got["logits"][s], want["logits"][s]
        if torch.equal(a, b):
            continue
        r: Dict[str, Any] = dict(trace_step=s, trace_logits_diff=float((a.float() - b.float()).abs().max()))
        if s > 0:
            for i, (x, y) in enumerate(zip(got["hidden"][s - 1], want["hidden"][s - 1])):
                if not torch.equal(x, y):
                    r.update(trace_layer=i, trace_hidden_diff=float((x.float() - y.float()).abs().max()),
                             trace_hidden_scale=float(y.float().abs().max()))
                    break
        return r
    return {}


def uploaded(off: Optional[Any]) -> Tuple[int, int]:
    """(bytes uploaded, forwards) so far by an Offload; (0, 0) for the resident model."""
    if off is None:
        return 0, 0
    return off.context.stats()["bytes_h2d"]["total"], off.steps


def timed(model: torch.nn.Module, off: Optional[Any], ids: torch.Tensor, mask: torch.Tensor, new: int,
          repeats: int) -> Dict[str, Any]:
    """Median seconds of `repeats` generate() calls of `new` tokens, the last call's tokens, and
    per call the forwards and the bytes uploaded per forward (None for the resident model)."""
    b0, f0 = uploaded(off)
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        tokens = generate(model, ids, mask, new)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    b1, f1 = uploaded(off)
    return dict(s=statistics.median(times), tokens=tokens.cpu(), forwards=(f1 - f0) / repeats,
                moved=(b1 - b0) / (f1 - f0) if off is not None and f1 > f0 else None)


def is_oom(e: BaseException) -> bool:
    """torch's out-of-memory error (spillway's is one), or a CUDA library that could not allocate
    under the cap and said so in a RuntimeError (cuBLAS, the driver)."""
    text = str(e)
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in text.lower() or "ALLOC_FAILED" in text


def child(args: argparse.Namespace, shape: Dict[str, int], new: int) -> int:
    """Runs one variant; prints its RESULT line. Exit status 3 after an out-of-memory error,
    1 after any other."""
    variant = args.one
    r: Dict[str, Any] = dict(variant=variant, capped=variant.startswith("capped"), oom=False)
    phase = "load"
    stack = contextlib.ExitStack()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        # Deterministic mode would also fill each new tensor with NaN; no result reads memory
        # before writing it, and a user's run does not pay for the fills.
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch_offload.leave_out_cudnn_attention()
        import transformers

        r.update(torch=torch.__version__, transformers=transformers.__version__)
        t = time.perf_counter()
        model = transformers.AutoModelForCausalLM.from_pretrained(args.ckpt, torch_dtype=torch.bfloat16)
        r["load_s"] = time.perf_counter() - t
        r["model_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        # ids from 3 up: 0, 1 and 2 are the special tokens of LlamaConfig's defaults
        ids = torch.randint(3, model.config.vocab_size, (shape["batch"], shape["prompt"]),
                            generator=torch.Generator().manual_seed(0))
        ref = torch.load(args.ref) if variant != "resident" and args.ref and os.path.exists(args.ref) else None
        phase = "placement"
        t = time.perf_counter()
        with placed(variant, model, weight_budget(args.weight_budget)) as off:
            r["place_s"] = time.perf_counter() - t
            r["device"] = torch.cuda.get_device_name()
            ids = ids.to("cuda")
            mask = torch.ones_like(ids)
            if off is not None:
                r.update(spillway_budget=off.context.stats()["budget"], budget_source=off.budget_source,
                         units=len(off.units), offloaded_bytes=sum(u.nbytes for u in off.units))
                log(f"{variant}: {r['units']} units, budget {r['spillway_budget'] / GiB:.2f} GiB "
                    f"({r['budget_source']}), loaded in {r['load_s']:.1f} s, offloaded in {r['place_s']:.1f} s")
            phase = "warm-up"
            generate(model, ids, mask, new)
            logits = last_logits(model, ids, mask)
            phase = "prefill"
            pre = timed(model, off, ids, mask, 1, args.repeats)
            phase = "generate"
            full = timed(model, off, ids, mask, new, args.repeats)
            r.update(prefill_ms=pre["s"] * 1e3, generate_s=full["s"], forwards_per_generate=full["forwards"],
                     moved_per_forward=full["moved"], moved_per_prefill=pre["moved"])
            if full["s"] > pre["s"]:
                r["decode_tok_s"] = shape["batch"] * (new - 1) / (full["s"] - pre["s"])
            phase = "trace"
            steps = min(args.trace_steps, new - 1)
            trace = None
            if steps > 0:
                forced = full["tokens"] if ref is None else ref["tokens"]
                trace = decode_trace(model, ids, mask, forced, steps)
                if variant == "resident":  # the reference against itself: deterministic in-process?
                    r["trace_self"] = trace_diff(decode_trace(model, ids, mask, forced, steps), trace)
            torch_peak = torch.cuda.max_memory_reserved()
            st = off.stats() if off is not None else None
            held_peak = st["held"]["peak"] if st is not None else 0
            r.update(torch_reserved_peak=torch_peak, spillway_held_peak=held_peak,
                     device_peak=held_peak if variant.endswith("-alloc") else torch_peak + held_peak)
            if st is not None:
                r.update(hook_us_median=st["offload"]["hook_us_median"], acquires=st["offload"]["acquires"],
                         stalls=st["stalls"]["total"])
                print(off.summary(), file=sys.stderr)
        tokens = full["tokens"]
        if variant == "resident" and args.ref:
            torch.save(dict(tokens=tokens, logits=logits, trace=trace), args.ref)
        elif ref is not None:
            want = ref["tokens"]
            if trace is not None and ref.get("trace") is not None:
                r["trace"] = trace_diff(trace, ref["trace"])
            r["equal"] = bool(torch.equal(tokens, want))
            # the prompt's forward alone: unequal logits there are a weight or a kernel that
            # differs, not a near tie amplified over the decode
            r["logits_equal"] = bool(torch.equal(logits, ref["logits"]))
            r["logits_max_diff"] = float((logits.float() - ref["logits"].float()).abs().max())
            if not r["equal"] and tokens.shape == want.shape:
                # where they part: a near tie of two logits flips late and takes the rest with it;
                # a wrong weight parts at the first token
                diff = (tokens != want).reshape(tokens.shape[0], -1)
                first = [int(row.nonzero()[0]) if bool(row.any()) else None for row in diff]
                r.update(differ_tokens=int(diff.sum()), first_differ=first, tokens_len=int(diff.shape[1]))
    except Exception as e:  # noqa: BLE001 - reported in the table; the other variants still run
        traceback.print_exc()
        r.update(failed=phase, oom=is_oom(e), error=f"{type(e).__name__}: {str(e).strip()[:600]}")
        print(RESULT + json.dumps(r), flush=True)
        return 3 if r["oom"] else 1
    finally:
        stack.close()
    print(RESULT + json.dumps(r), flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
# the parent: the checkpoint, one child per variant, the table


def launch(argv: List[str], env: Dict[str, str], timeout: float) -> Dict[str, Any]:
    """Runs one child, its output passed on to our stderr as it comes; returns its RESULT, with
    the interposer's peak charged bytes when it reported them (cap_peak)."""
    r, err = launcher.launch(argv, env, timeout, RESULT)
    charged = [int(m.group(1)) for m in map(CHARGED.search, err) if m]
    if charged:
        r["cap_peak"] = max(charged)
    return r


def save(path: Optional[str], what: Dict[str, Any]) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(what, f, indent=1)


def fmt(x: Optional[float], spec: str, scale: Optional[float] = None) -> str:
    if x is None:
        return "-"
    return format(x if scale is None else x / scale, spec)


def print_table(rows: List[Dict[str, Any]], budget: str, shape: Dict[str, int], new: int) -> Dict[str, Any]:
    """The table and the acceptance ratios; returns the ratios."""
    first = next((r for r in rows if r.get("device")), {})
    print(f"\n{first.get('device', '?')}; torch {first.get('torch', '?')}, "
          f"transformers {first.get('transformers', '?')}; "
          f"model {fmt(first.get('model_bytes'), '.2f', GiB)} GiB bf16; batch {shape['batch']} x {shape['prompt']} "
          f"prompt tokens + {new} new; cap {budget} (capped variants)")
    print(f"decode tok/s = {shape['batch']} x {new - 1} / (generate s - prefill s): new tokens per second "
          "across the batch after each sequence's first")
    print(f"{'variant':<18}{'budget GiB':>11}{'units':>6}{'prefill ms':>11}{'generate s':>11}{'decode tok/s':>13}"
          f"{'tokens':>11}{'peak GiB':>9}{'cap peak GiB':>13}{'moved MiB/fwd':>14}{'hook us':>8}")
    for r in rows:
        if r.get("error"):
            what = f"{'OOM' if r.get('oom') else 'ERROR'} in {r['failed']}" if r.get("failed") else "ERROR"
            rc = f" (exit {r['rc']})" if r.get("rc") is not None else ""
            print(f"{r['variant']:<18}{what}{rc}: {r['error']}")
            continue
        tokens = ("reference" if r["variant"] == "resident" else "no ref" if r.get("equal") is None
                  else "equal" if r["equal"] else "DIFFER")
        print(f"{r['variant']:<18}{fmt(r.get('spillway_budget'), '.2f', GiB):>11}{fmt(r.get('units'), 'd'):>6}"
              f"{r['prefill_ms']:>11.1f}{r['generate_s']:>11.3f}{fmt(r.get('decode_tok_s'), '.1f'):>13}{tokens:>11}"
              f"{fmt(r['device_peak'], '.2f', GiB):>9}{fmt(r.get('cap_peak'), '.2f', GiB):>13}"
              f"{fmt(r.get('moved_per_forward'), '.0f', MiB):>14}{fmt(r.get('hook_us_median'), '.1f'):>8}")
        if r.get("logits_equal") is not None:
            print(f"{'':<18}the prompt's last logits {'bitwise equal to' if r['logits_equal'] else 'differ from'} "
                  f"resident's (largest difference {r['logits_max_diff']:.3g})")
        for key, whose in (("trace_self", "resident's second run"), ("trace", "resident's")):
            d = r.get(key)
            if d is None:
                continue
            if not d:
                print(f"{'':<18}decode trace (fed the reference tokens): bitwise equal to {whose}")
                continue
            where = (f"; first at hidden state {d['trace_layer']} (0: embeddings), largest difference "
                     f"{d['trace_hidden_diff']:.3g} of {d['trace_hidden_scale']:.3g}") if "trace_layer" in d else ""
            print(f"{'':<18}decode trace (fed the reference tokens) parts from {whose} at step {d['trace_step']}: "
                  f"logits differ by up to {d['trace_logits_diff']:.3g}{where}")
        if r.get("differ_tokens"):
            print(f"{'':<18}{r['differ_tokens']} tokens differ; each sequence's first differing position "
                  f"(of {r.get('tokens_len', '?')}): {r['first_differ']}")
        if r.get("forwards_per_generate") not in (None, 0, new):
            print(f"{'':<18}{r['forwards_per_generate']:.0f} forwards per generate, not {new}")
    by = {r["variant"]: r for r in rows}
    ratios: Dict[str, Any] = {}
    print(f"\nacceptance: decode tok/s capped / uncapped at the same spillway budget (target >= {TARGET})")
    for uncapped, capped in TWIN.items():
        a, b = by.get(capped, {}).get("decode_tok_s"), by.get(uncapped, {}).get("decode_tok_s")
        name = f"{capped} / {uncapped}"
        if a is None or b is None:
            print(f"  {name:<36} -  (a variant is missing or failed)")
            continue
        ratios[name] = a / b
        print(f"  {name:<36} {a / b:.3f}  {'ok' if a / b >= TARGET else 'BELOW TARGET'}")
    return ratios


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ",".join(VARIANTS))
    p.add_argument("--budget", help="the cap of the capped variants, for spillway run (default 8GiB; --smoke 1GiB)")
    p.add_argument("--ckpt", type=Path, help="the checkpoint directory, made once (default under the temp directory)")
    p.add_argument("--weight-budget",
                   help="spillway's budget for an uncapped variant whose capped twin is not run (bytes or a size); "
                        "by default the one its twin resolved")
    p.add_argument("--repeats", type=int, default=1, help="timed generate() calls of each kind (the median)")
    p.add_argument("--child-timeout", type=float, default=480, help="seconds per variant process")
    p.add_argument("--trace-steps", type=int, default=16,
                   help="decode steps of the per-layer trace compared with resident's (0: none)")
    p.add_argument("--json", help="write the rows and ratios to this file")
    p.add_argument("--smoke", action="store_true", help="an 8 MiB Llama, 8 new tokens, a 1 GiB cap: control flow")
    p.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--build", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ref", help=argparse.SUPPRESS)
    args = p.parse_args()
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    new = NEW_TOKENS[args.smoke]
    budget = args.budget or ("1GiB" if args.smoke else "8GiB")
    ckpt = args.ckpt or Path(tempfile.gettempdir()) / ("spillway_smallcard_llama" + ("_smoke" if args.smoke else ""))
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.build:
        build_checkpoint(ckpt, shape)
        return 0
    if args.one:
        if args.one.startswith("uncapped") and args.weight_budget is None:
            p.error(f"--one {args.one} needs --weight-budget")
        return child(args, shape, new)

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    variants = [v for v in VARIANTS if v in variants]  # resident first: the others compare with it
    try:
        import transformers  # noqa: F401 - the children load the model with it
    except ImportError as e:
        print(f"transformers is not importable ({e}): nothing to measure")
        return 0
    me = [sys.executable, os.path.abspath(__file__)] + (["--smoke"] if args.smoke else [])
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")

    if ckpt.exists():
        log(f"checkpoint {ckpt}: there already")
    else:
        log(f"checkpoint {ckpt}: building")
        r = launch(me + ["--build", "--ckpt", str(ckpt)], env, args.child_timeout)
        if r["rc"] != 0 or not ckpt.exists():
            print(f"building the checkpoint failed (exit {r['rc']})")
            return 1
        log(f"checkpoint {ckpt}: built")

    # The reference tokens live beside the weights, so that a run without resident (the
    # variants split over several runs) compares with the last resident run's.
    ref = ckpt / "resident_reference.pt"
    if "resident" in variants:
        ref.unlink(missing_ok=True)
    elif ref.exists():
        log(f"reference tokens: {ref}, from an earlier resident run")
    rows: List[Dict[str, Any]] = []
    resolved: Dict[str, int] = {}  # capped variant -> the spillway budget it resolved
    for v in variants:
        argv = me + ["--one", v, "--ckpt", str(ckpt), "--ref", str(ref), "--repeats", str(args.repeats),
                     "--trace-steps", str(args.trace_steps)]
        if v in TWIN:
            wb = resolved.get(TWIN[v]) or args.weight_budget
            if wb is None:
                rows.append(dict(variant=v, rc=None, error=f"no budget: run {TWIN[v]} too, or give --weight-budget"))
                continue
            argv += ["--weight-budget", str(wb)]
        elif v.startswith("capped"):
            if not SPILLWAY_CLI.exists():
                rows.append(dict(variant=v, rc=None, error=f"{SPILLWAY_CLI} is missing: make build"))
                continue
            argv = [str(SPILLWAY_CLI), "run", "--budget", budget, "--report", "--"] + argv
        log(f"{v}: starting")
        r = launch(argv, env, args.child_timeout)
        r.setdefault("variant", v)
        if r.get("spillway_budget") is not None and v.startswith("capped"):
            resolved[v] = r["spillway_budget"]
        rows.append(r)
        log(f"{v}: done: " + (r["error"][:200] if r.get("error") else
                              f"prefill {r['prefill_ms']:.1f} ms, decode {fmt(r.get('decode_tok_s'), '.1f')} tok/s, "
                              f"tokens {'reference' if v == 'resident' else r.get('equal')}"))
        # Written after every variant: what has run survives a run cut short.
        save(args.json, dict(budget=budget, shape=shape, new_tokens=new, ckpt=str(ckpt), rows=rows))

    ratios = print_table(rows, budget, shape, new)
    save(args.json, dict(budget=budget, shape=shape, new_tokens=new, ckpt=str(ckpt), rows=rows, ratios=ratios))
    bad = [r for r in rows if r.get("error") or r.get("equal") is False]
    if bad:
        print(f"\n{len(bad)} variant(s) failed or differ from resident: {', '.join(r['variant'] for r in bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
