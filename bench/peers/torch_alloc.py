"""spillway.torch.use_allocator against PyTorch's default caching allocator, on the acceptance
workloads (random weights from configs; nothing is downloaded):

  gpt2    HF GPT-2 medium training, batch 8 x 1024, bf16 autocast, AdamW
  bert    HF BERT-base masked-LM training, batch 32, a random length in 32..512 each step
  resnet  ResNet-50 training, batch 128, 224x224, SGD with momentum (torchvision's when importable,
          otherwise the same network written here: bottleneck blocks [3, 4, 6, 3], BatchNorm)
  llama   greedy generation, Llama-shaped (2048 hidden, 16 layers, fp16), batch 8, 128 + 256 tokens

Each (workload, allocator) runs in its own process: default | global | pool (or the list given
to --allocators; "global+vmm=off" is mode global with the spillway option vmm=off), with deterministic
kernels (torch.use_deterministic_algorithms, CUBLAS_WORKSPACE_CONFIG set before CUDA starts).
The default process runs the workload a second time from the same seed: "default repeats" says
whether the comparison can mean anything. Per row: losses (tokens) equal to the default's,
spillway's peak held bytes against PyTorch's max_memory_reserved under the default allocator, and
the median step time against the default's. "interleave" is the comparison without the noise
between processes (one process's generation speed differs from another's by up to 18%): one
process runs the workload with steps alternating between the default allocator and
use_allocator(mode="pool") (`with allocator:` around every other step, in the order default,
spillway, spillway, default, ...), after one untimed step of each; its losses (tokens) must equal
the default process's, and its row compares its own spillway steps with its own default steps
(medians, and the median of the ratios of neighbouring steps). Generation times its calls after --gen-warmup
untimed ones, training after the first min(5, steps / 5) steps: in every process the timed steps
find PyTorch's cache warm, as a long run would.

Per (workload, allocator) a diagnostic line ("diag") gives, per timed step: the step time, PyTorch's
segment allocations and frees (num_device_alloc/num_device_free; under spillway each one is a call
into spillway), num_alloc_retries, num_ooms, num_sync_all_streams, and under spillway its own
count of those calls with the host time spent in them, its backend maps/unmaps
(backend_allocs/backend_frees), the host waits of its trims (trim_syncs) and the calls of the
reclaim hook; then the same counts over the untimed warm-up steps.

Then the cap search: for each workload a cap C = static + 0.5 x (default reserved - static), with
static the parameter bytes (x4 with AdamW: parameters, gradients, two moments; x3 with SGD and
momentum; x1 for generation), so that the smallest batch of the ladder fits under C. Under C, the
largest batch of the ladder that runs --cap-steps steps with use_allocator(budget=C) against the
largest with torch.cuda.set_per_process_memory_fraction(C / total); one process per (workload,
allocator), ascending the ladder with the model built once, the cache emptied between batches
(a model that cannot even be built under C reports largest batch 0). These processes run at the
same time (their caps fit the device together), within --cap-secs; they time nothing.

    SPILLWAY_LIBRARY=build/libspillway.so PYTHONPATH=python python3 bench/peers/torch_alloc.py \\
        [--workloads gpt2,bert,resnet,llama] [--steps 50] [--gen-steps 6] [--gen-warmup 1]
        [--allocators default,global,pool] [--cap-workloads W,...] [--cap-steps 2] [--no-cap] [--json out.json]

--smoke runs the default allocator on the CPU with tiny models and 3 steps (a check of this script,
not a measurement); workloads that need transformers are skipped there when it is missing.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

GiB = 1 << 30
# The transformers models use eager attention: PyTorch's fused attention kernels (flash,
# memory-efficient) have nondeterministic backward passes, and with them the default allocator
# does not repeat its own losses from the same seed, so equality would say nothing.
ATTN = "eager"
MiB = 1 << 20
DEFAULT_BATCH = {"gpt2": 8, "bert": 32, "resnet": 128, "llama": 8}
LADDER = {"gpt2": [1, 2, 3, 4, 5, 6, 7, 8, 10, 12], "bert": [4, 8, 12, 16, 20, 24, 28, 32, 40, 48],
          "resnet": [8, 16, 32, 48, 64, 80, 96, 112, 128, 160], "llama": [1, 2, 4, 8, 12, 16, 24, 32, 48, 64]}
STATIC_FACTOR = {"gpt2": 4, "bert": 4, "resnet": 3, "llama": 1}
NEEDS_TRANSFORMERS = ("gpt2", "bert", "llama")


# ---------------------------------------------------------------- the workloads
class Workload:
    """build() makes the model and optimizer from a fixed seed; step(batch) runs one step and
    returns its loss (generation: a digest of the tokens)."""

    def __init__(self, torch, name: str, dev, smoke: bool) -> None:
        self.torch, self.name, self.dev, self.smoke = torch, name, dev, smoke
        self.param_bytes = 0

    def _make(self, fn, dtype=None):
        """The model from fn() with its parameters created in dtype (default: torch's), so that
        the build never holds a wider copy: the cap search builds it under the cap."""
        torch = self.torch
        torch.manual_seed(0)
        old = torch.get_default_dtype()
        if dtype is not None and dtype != old:
            torch.set_default_dtype(dtype)
        try:
            if self.dev.type == "cuda" and hasattr(torch.device, "__enter__"):
                with torch.device(self.dev):  # initialise on the device: seconds, not tens of seconds
                    m = fn()
            else:
                m = fn().to(self.dev)
        finally:
            torch.set_default_dtype(old)
        self.param_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
        return m

    def build(self) -> None:
        torch, dev = self.torch, self.dev
        g = torch.Generator(device=dev).manual_seed(1)
        if self.name == "gpt2":
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(n_embd=64, n_layer=2, n_head=2, n_positions=64, attn_implementation=ATTN) if self.smoke \
                else GPT2Config(n_embd=1024, n_layer=24, n_head=16, n_positions=1024, attn_implementation=ATTN)
            m = self._make(lambda: GPT2LMHeadModel(cfg)).train()
            seq = cfg.n_positions

            def loss(b):
                ids = torch.randint(0, cfg.vocab_size, (b, seq), device=dev, generator=g)
                return m(input_ids=ids, labels=ids).loss
            self._train(m, torch.optim.AdamW(m.parameters(), lr=1e-4), loss)
        elif self.name == "bert":
            from transformers import BertConfig, BertForMaskedLM

            cfg = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
                             attn_implementation=ATTN) if self.smoke else BertConfig(attn_implementation=ATTN)
            m = self._make(lambda: BertForMaskedLM(cfg)).train()
            lengths = torch.Generator().manual_seed(2)
            hi = 64 if self.smoke else 512

            def loss(b):
                n = int(torch.randint(32, hi + 1, (1,), generator=lengths))
                ids = torch.randint(0, cfg.vocab_size, (b, n), device=dev, generator=g)
                return m(input_ids=ids, labels=ids).loss
            self._train(m, torch.optim.AdamW(m.parameters(), lr=1e-4), loss)
        elif self.name == "resnet":
            m = self._make(resnet50).train()
            side = 64 if self.smoke else 224

            def loss(b):
                x = torch.randn(b, 3, side, side, device=dev, generator=g)
                y = torch.randint(0, 1000, (b,), device=dev, generator=g)
                return torch.nn.functional.cross_entropy(m(x), y)
            self._train(m, torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), loss)
        elif self.name == "llama":
            from transformers import LlamaConfig, LlamaForCausalLM

            cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                              num_key_value_heads=4, vocab_size=1000, max_position_embeddings=512,
                              attn_implementation=ATTN) if self.smoke else \
                LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
                            num_key_value_heads=16, vocab_size=32000, max_position_embeddings=4096,
                            attn_implementation=ATTN)
            dtype = torch.float32 if self.dev.type == "cpu" else torch.float16
            m = self._make(lambda: LlamaForCausalLM(cfg), dtype).eval()
            prompt, new = (8, 8) if self.smoke else (128, 256)
            self.tokens_per_step = new

            def step(b):
                ids = torch.randint(0, cfg.vocab_size, (b, prompt), device=dev, generator=g)
                with torch.no_grad():
                    toks = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0)
                return hashlib.sha1(json.dumps(toks.tolist()).encode()).hexdigest()[:16]
            self.step = step
        else:
            raise SystemExit(f"unknown workload {self.name}")

    def _train(self, m, opt, loss_fn) -> None:
        torch = self.torch

        def step(b):
            with torch.autocast(self.dev.type, dtype=torch.bfloat16):
                loss = loss_fn(b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss.item()
        self.step = step


def resnet50():
    """ResNet-50 as torchvision builds it (bottleneck blocks [3, 4, 6, 3], stride on the 3x3
    convolution), torchvision's own when importable."""
    try:
        import torchvision

        return torchvision.models.resnet50(weights=None)
    except ImportError:
        pass
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, inp: int, planes: int, stride: int) -> None:
            super().__init__()
            out = planes * 4
            self.conv1, self.bn1 = nn.Conv2d(inp, planes, 1, bias=False), nn.BatchNorm2d(planes)
            self.conv2, self.bn2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False), nn.BatchNorm2d(planes)
            self.conv3, self.bn3 = nn.Conv2d(planes, out, 1, bias=False), nn.BatchNorm2d(out)
            self.relu = nn.ReLU(inplace=True)
            self.downsample = None
            if stride != 1 or inp != out:
                self.downsample = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out))

        def forward(self, x):
            identity = x if self.downsample is None else self.downsample(x)
            y = self.relu(self.bn1(self.conv1(x)))
            y = self.relu(self.bn2(self.conv2(y)))
            return self.relu(self.bn3(self.conv3(y)) + identity)

    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    inp = 64
    for planes, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(inp, planes, stride if i == 0 else 1))
            inp = planes * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, 1000)]
    return nn.Sequential(*layers)


# ---------------------------------------------------------------- child: one process
def child(a: dict) -> dict:
    if a.get("cpus"):  # every process of a comparison on the same cores
        os.sched_setaffinity(0, a["cpus"])
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    # warn_only: a few backward kernels (adaptive pooling, index_add) have no deterministic CUDA
    # version; the default allocator's repeat below shows whether the losses still repeat
    torch.use_deterministic_algorithms(True, warn_only=True)
    import warnings

    warnings.filterwarnings("ignore")
    dev = torch.device("cpu" if a["smoke"] else "cuda")
    alloc = None
    mode, options = split_alloc(a["alloc"])
    if mode in ("global", "pool", "interleave"):
        import spillway.torch as spt

        alloc = spt.use_allocator(budget=a["budget"], mode="pool" if mode == "interleave" else mode, **options)
    elif a["alloc"] == "fraction":
        torch.cuda.set_per_process_memory_fraction(a["cap"] / torch.cuda.get_device_properties(0).total_memory)
    elif a["alloc"] != "default":
        raise SystemExit(f"unknown allocator {a['alloc']}")
    oom = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def empty():
        if alloc is not None:
            import spillway.torch as spt

            spt.empty_cache()
        elif dev.type == "cuda":
            torch.cuda.empty_cache()

    class Region:  # pool mode: the workload inside `with alloc:`; interleave: the steps choose
        def __init__(self, on: bool = True) -> None:
            self.on = on and alloc is not None and alloc.mode == "pool"

        def __enter__(self):
            if self.on:
                alloc.__enter__()

        def __exit__(self, *exc):
            if self.on:
                alloc.__exit__(*exc)

    interleave = mode == "interleave"

    out: dict = {}
    w = Workload(torch, a["workload"], dev, a["smoke"])
    try:
        with Region(not interleave):
            w.build()
    except oom as e:  # only the cap search builds under a cap below the model
        out.update(ok=a["what"] == "cap", error=f"OOM while building the model: {str(e)[:300]}", largest=0,
                   tried=[["build", "OOM"]], static_bytes=0)
        return out
    out["static_bytes"] = w.param_bytes * STATIC_FACTOR[a["workload"]]
    if a["what"] == "run":
        losses, times = [], []
        skip = a.get("warmup", min(5, a["steps"] // 5))
        if interleave:  # one untimed step with each allocator, then pairs
            skip = max(2, skip + skip % 2)
        # interleave: step i runs under spillway when True (warm-up: default, spillway; then
        # default, spillway, spillway, default, ...: each allocator equally often first)
        spw = [(i % 2 == 1) if i < skip else ((i - skip) % 4 in (1, 2)) for i in range(a["steps"])]
        marks = [counters(torch, dev, alloc)]
        try:
            with Region(not interleave):
                for i in range(a["steps"]):
                    if i == skip and i:
                        sync()
                        marks.append(counters(torch, dev, alloc))
                    sync()
                    t0 = time.perf_counter()
                    with Region(interleave and spw[i]):
                        losses.append(w.step(a["batch"]))
                    sync()
                    times.append(time.perf_counter() - t0)
            out["ok"] = True
        except oom as e:
            out.update(ok=False, error=f"OOM: {str(e)[:400]}")
        marks.append(counters(torch, dev, alloc))
        per = getattr(w, "tokens_per_step", 1)
        timed = times[skip:] or times
        out.update(losses=losses, step_s=statistics.median(timed) / per if timed else None,
                   step_ms=[round(1e3 * t, 3) for t in times], warmup_steps=min(skip, len(times)))
        if interleave:
            out.update(interleaved(times[skip:], spw[skip:len(times)], per))
        n_timed = max(1, len(times) - skip) if len(times) > skip else 0
        if len(marks) == 3:
            out["diag_warmup"] = diff(marks[1], marks[0], skip)
            out["diag_step"] = diff(marks[2], marks[1], n_timed)
        else:
            out["diag_step"] = diff(marks[-1], marks[0], max(1, len(times)))
        if dev.type == "cuda":
            out.update(torch_max_reserved=torch.cuda.max_memory_reserved(),
                       torch_max_allocated=torch.cuda.max_memory_allocated(),
                       segments=segment_sizes(torch))
        if alloc is not None:
            import spillway.torch as spt

            s = spt.memory_stats()
            out.update(spw_held_peak=s["held.peak"], spw_budget=s["budget"])
        if a["alloc"] == "default" and out["ok"]:
            # the same seed again in this process: the default allocator must repeat itself
            n = min(len(losses), a["repeat_steps"])
            w.build()
            out["repeat_equal"] = [w.step(a["batch"]) for _ in range(n)] == losses[:n]
            out["repeat_steps"] = n
        out["reclaims"] = reclaim_counts(alloc)
    else:  # cap: ascend the ladder with this model; stop at the first batch that does not fit
        out["largest"], out["tried"] = 0, []
        for b in a["ladder"]:
            empty()
            try:
                with Region():
                    for _ in range(a["steps"]):
                        w.step(b)
                sync()
            except oom as e:
                out["tried"].append([b, "OOM"])
                out["error"] = str(e)[:300]
                break
            out["tried"].append([b, "ok"])
            out["largest"] = b
        out["ok"] = True
        if alloc is not None:
            import spillway.torch as spt

            out["spw_held_peak"] = spt.memory_stats()["held.peak"]
    return out


def interleaved(times: list, spw: list, per: int) -> dict:
    """The interleaved process's own comparison: medians of its spillway and default steps, and
    the median over neighbouring (default, spillway) pairs of spillway / default."""
    s = [t for t, x in zip(times, spw) if x]
    d = [t for t, x in zip(times, spw) if not x]
    if not s or not d:
        return {}
    pairs = [times[i + 1] / times[i] if spw[i + 1] else times[i] / times[i + 1]
             for i in range(0, len(times) - 1, 2) if spw[i] != spw[i + 1]]
    return {"step_s": statistics.median(s) / per, "inter_default_step_s": statistics.median(d) / per,
            "inter_ratio": statistics.median(s) / statistics.median(d),
            "inter_paired": statistics.median(pairs) if pairs else None, "inter_pairs": len(pairs)}


def segment_sizes(torch) -> dict:
    """PyTorch's segments at the end of the run, by size: {"MiB": count}, largest first (what
    its caching allocator reserved, whichever memory source it used)."""
    sizes: dict = {}
    for seg in torch.cuda.memory_snapshot():
        k = f"{seg['total_size'] / (1 << 20):g}"
        sizes[k] = sizes.get(k, 0) + 1
    return dict(sorted(sizes.items(), key=lambda kv: -float(kv[0])))


def split_alloc(name: str):
    """"global+vmm=off+frag_slack=0.1" -> ("global", {"vmm": "off", "frag_slack": "0.1"})."""
    mode, *rest = name.split("+")
    return mode, dict(kv.split("=", 1) for kv in rest)


def reclaim_counts(alloc) -> dict:
    if alloc is None:
        return {}
    from spillway.torch import _alloc as spa

    return dict(spa._reclaims)


def counters(torch, dev, alloc) -> dict:
    """The cumulative counters the diagnostic compares: PyTorch's allocator events (its segments
    come from cudaMalloc, or from spillway when routed), then spillway's own."""
    c: dict = {}
    if dev.type == "cuda":
        m = torch.cuda.memory_stats()
        for k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms", "num_sync_all_streams"):
            c[k] = int(m.get(k, 0))
        c["reserved_bytes"] = int(m.get("reserved_bytes.all.current", 0))
    if alloc is not None and alloc.routed:
        import spillway.torch as spt

        s = spt.memory_stats()
        for k in ("torch_alloc_calls", "torch_alloc_ns", "torch_free_calls", "torch_free_ns"):
            c[k] = int(s.get(k, 0))
        for k in ("backend_allocs", "backend_frees", "trim_syncs", "cross_stream_waits", "ooms"):
            c[k] = int(s[f"{k}.total"])
        c["held_bytes"] = int(s["held.current"])
        c["reclaim_calls"] = reclaim_counts(alloc).get("calls", 0)
    return c


def diff(after: dict, before: dict, steps: int) -> dict:
    """Per step over `steps` steps; *_bytes are the change over all of them."""
    out = {"steps": steps}
    for k, v in after.items():
        d = v - before.get(k, 0)
        out[k] = d if k.endswith("_bytes") else round(d / max(1, steps), 3)
    return out


def diag_line(w: str, alloc: str, g: dict) -> str:
    """One line per (workload, allocator): what a step spent on segments, as the counters say."""
    def part(d):
        if not d or set(d) == {"steps"}:
            return "-"
        s = (f"PyTorch segments +{d.get('num_device_alloc', '-')} -{d.get('num_device_free', '-')} "
             f"retries {d.get('num_alloc_retries', '-')} ooms {d.get('num_ooms', '-')} "
             f"sync_all {d.get('num_sync_all_streams', '-')}, reserved {d.get('reserved_bytes', 0) / 1e9:+.2f} GB "
             f"over the {d['steps']} steps")
        if "torch_alloc_calls" in d:
            s += (f"; spillway calls alloc {d['torch_alloc_calls']} ({d['torch_alloc_ns'] / 1e6:.3f} ms) "
                  f"free {d['torch_free_calls']} ({d['torch_free_ns'] / 1e6:.3f} ms), maps {d['backend_allocs']} "
                  f"unmaps {d['backend_frees']} trim_syncs {d['trim_syncs']} cross_stream {d['cross_stream_waits']} "
                  f"reclaims {d['reclaim_calls']}")
        return s
    ms = g.get("step_ms") or []
    timed = ms[g.get("warmup_steps", 0):] or ms
    span = f"min {min(timed):.2f} max {max(timed):.2f} ms over {len(timed)}" if timed else "-"
    segs = g.get("segments")
    segs = ", ".join(f"{n} x {mib} MiB" for mib, n in segs.items()) if segs else "-"
    return (f"diag {w:6s} {alloc:7s} step {1e3 * (g.get('step_s') or 0):.2f} ms ({span}); per timed step: "
            f"{part(g.get('diag_step'))} | warm-up ({g.get('warmup_steps', 0)} steps), per step: "
            f"{part(g.get('diag_warmup'))} | segments at the end: {segs}")


# ---------------------------------------------------------------- parent
def spawn(args: dict) -> subprocess.Popen:
    env = dict(os.environ, CUBLAS_WORKSPACE_CONFIG=":4096:8")  # before CUDA starts in the child
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child", json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def collect(p: subprocess.Popen, timeout: float) -> dict:
    try:
        stdout, stderr = p.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return {"ok": False, "error": f"timeout after {timeout:.0f} s"}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        return {"ok": False, "error": f"rc {p.returncode}: {stderr[-600:]}"}
    return json.loads(lines[-1][7:])


def cpu_list(text: str) -> list:
    """"2-5,8" -> [2, 3, 4, 5, 8]."""
    out = []
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def gb(n) -> str:
    return f"{n / 1e9:.2f} GB" if n else "-"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(json.loads(sys.argv[2]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="gpt2,bert,resnet,llama")
    ap.add_argument("--steps", type=int, default=50, help="training steps per run")
    ap.add_argument("--gen-steps", type=int, default=6, help="generation calls (256 tokens each) per run: one process's calls differ by up to 6%%, so the median of five")
    ap.add_argument("--gen-warmup", type=int, default=1, help="untimed generation calls first, of --gen-steps")
    ap.add_argument("--allocators", default="default,global,pool",
                    help="compared with default, each in its own process; mode+option=value,... passes spillway "
                         "options (e.g. global+vmm=off)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every allocator this many times, in turn, the order reversed every other round "
                         "(default first, then last): step-time ratios are then medians over the rounds, so that a "
                         "slow process or a drift of the machine does not decide them")
    ap.add_argument("--repeat-steps", type=int, default=10, help="steps the default allocator repeats")
    ap.add_argument("--budget", default="90%", help="use_allocator budget of the comparison runs")
    ap.add_argument("--cap-steps", type=int, default=2, help="steps per batch in the cap search")
    ap.add_argument("--cap-workloads", help="workloads of the cap search (default: --workloads)")
    ap.add_argument("--cap-secs", type=float, default=200, help="time limit of the cap search (its processes run "
                    "at the same time)")
    ap.add_argument("--cap-scale", type=float, default=0.5, help="C = static + scale x (default reserved - static)")
    ap.add_argument("--no-cap", action="store_true", help="skip the cap search")
    ap.add_argument("--cpus", default="", help="run every process on these cores (e.g. 2-9): host-bound "
                    "workloads (generation) then do not depend on where the scheduler puts each process")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny models, default allocator: checks this script")
    ap.add_argument("--json")
    args = ap.parse_args()
    t_start = time.perf_counter()
    import torch

    if args.smoke:
        # the script's control flow on the CPU (use_allocator there: emu contexts, nothing routed)
        allocs = ("default", "interleave") if "interleave" in args.allocators else ("default",)
        steps, total, device = 3 * len(allocs), 0, "cpu (smoke)"
    else:
        allocs, steps = tuple(dict.fromkeys(["default"] + args.allocators.split(","))), args.steps
        total, device = torch.cuda.get_device_properties(0).total_memory, torch.cuda.get_device_name(0)
    try:
        import transformers  # noqa: F401
        have_tf = True
    except ImportError:
        have_tf = False
    results: dict = {"device": device, "torch": torch.__version__, "rows": [], "cap": [], "skipped": {}}
    ran = {}
    for w in args.workloads.split(","):
        if w in NEEDS_TRANSFORMERS and not have_tf:
            results["skipped"][w] = "transformers is not importable"
            print(f"{w}: transformers is not importable here: not run", flush=True)
            continue
        base = dict(workload=w, budget=args.budget, cpus=cpu_list(args.cpus), batch=DEFAULT_BATCH[w] if not args.smoke else 2,
                    steps=steps, repeat_steps=args.repeat_steps, smoke=args.smoke, what="run", cap=0)
        if w == "llama":
            gen = 1 if args.smoke else max(1, args.gen_steps)
            base.update(steps=gen, warmup=min(args.gen_warmup, gen - 1) if not args.smoke else 0, repeat_steps=1)
        rounds = []
        for r in range(max(1, args.rounds)):  # one process at a time: the step times are compared
            got = {}
            for alloc in (allocs if r % 2 == 0 else allocs[::-1]):
                got[alloc] = g = collect(spawn(dict(base, alloc=alloc)), 150)
                # one line per process, so that a run cut by its time limit still shows them
                print(f"{w:6s} round {r + 1} {alloc:7s} ok {g.get('ok')} step {1e3 * (g.get('step_s') or 0):.2f} ms "
                      f"per step {[round(x, 2) for x in g.get('step_ms') or []]}", flush=True)
            rounds.append(got)
        got = rounds[0]
        ref = got["default"]
        ran[w] = ref
        for alloc in allocs:
            g = got[alloc]
            row = {"workload": w, "allocator": alloc, "ok": g.get("ok"), "error": g.get("error"),
                   "equal": g.get("losses") == ref.get("losses") if g.get("ok") and ref.get("ok") else None,
                   "repeat_equal": ref.get("repeat_equal"), "repeat_steps": ref.get("repeat_steps"),
                   "default_max_reserved": ref.get("torch_max_reserved"), "spw_held_peak": g.get("spw_held_peak"),
                   "torch_max_reserved": g.get("torch_max_reserved"),
                   "step_s": g.get("step_s"), "default_step_s": ref.get("step_s"),
                   "step_ms": g.get("step_ms"), "warmup_steps": g.get("warmup_steps"),
                   "diag_step": g.get("diag_step"), "diag_warmup": g.get("diag_warmup"), "reclaims": g.get("reclaims")}
            if "inter_ratio" in g:  # its own default steps are the reference
                row.update({k: g[k] for k in ("inter_ratio", "inter_paired", "inter_default_step_s", "inter_pairs")})
                row["default_step_s"] = g["inter_default_step_s"]
            else:
                row.update(paired(g, ref))
            if len(rounds) > 1 and alloc != "default":
                row.update(over_rounds(rounds, alloc))
            results["rows"].append(row)
            print(f"{w:6s} {alloc:7s} ok {row['ok']} equal {row['equal']} (default repeats: {row['repeat_equal']}) "
                  f"held {gb(row['spw_held_peak'])} vs default reserved {gb(row['default_max_reserved'])} "
                  f"step {1e3 * (row['step_s'] or 0):.2f} ms vs {1e3 * (row['default_step_s'] or 0):.2f} ms"
                  + (f" (paired {row['paired_ratio']:.3f}, total {row['total_ratio']:.3f})" if "total_ratio" in row else "")
                  + (f" in one process, interleaved: ratio {row['inter_ratio']:.3f}, neighbours "
                     f"{row['inter_paired']:.3f} over {row['inter_pairs']} pairs" if "inter_ratio" in row else "")
                  + (f"  ERROR {row['error']}" if row["error"] else ""), flush=True)
        for alloc in allocs:
            if got[alloc].get("step_ms"):
                print(diag_line(w, alloc, got[alloc]), flush=True)
    if not args.no_cap and not args.smoke:
        procs = []
        cap_ws = args.cap_workloads.split(",") if args.cap_workloads else list(ran)
        for w, ref in ran.items():
            if not ref.get("ok") or w not in cap_ws:
                continue
            static, reserved = ref["static_bytes"], ref["torch_max_reserved"]
            cap = int(static + args.cap_scale * max(0, reserved - static)) // MiB * MiB
            for alloc in ("fraction", "global"):
                a = dict(workload=w, alloc=alloc, budget=str(cap), cap=cap, ladder=LADDER[w],
                         steps=1 if w == "llama" else args.cap_steps,
                         smoke=False, what="cap", batch=0, repeat_steps=0)
                procs.append((w, alloc, cap, reserved, spawn(a)))
        t0 = time.perf_counter()
        best: dict = {}
        for w, alloc, cap, reserved, p in procs:
            best[(w, alloc)] = collect(p, args.cap_secs - (time.perf_counter() - t0))
        for w in ran:
            if (w, "global") not in best:
                continue
            f, s = best[(w, "fraction")], best[(w, "global")]
            cap = next(c for ww, _, c, _, _ in procs if ww == w)
            entry = {"workload": w, "cap": cap, "default_max_reserved": ran[w]["torch_max_reserved"],
                     "largest_fraction": f.get("largest"), "largest_spillway": s.get("largest"),
                     "tried_fraction": f.get("tried"), "tried_spillway": s.get("tried"),
                     "spw_held_peak": s.get("spw_held_peak"), "error": f.get("error") if not f.get("ok") else
                     (s.get("error") if not s.get("ok") else None)}
            results["cap"].append(entry)
            print(f"{w:6s} cap {gb(cap)}: largest batch use_allocator {entry['largest_spillway']} vs "
                  f"set_per_process_memory_fraction {entry['largest_fraction']} (ladder {LADDER[w]})", flush=True)
    results["seconds"] = time.perf_counter() - t_start
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def step_ratio(step_s, default_step_s) -> float:
    """Median step time over the default's (0 where a run has none)."""
    return (step_s or 0) / max(1e-12, default_step_s or 1e-12)


def paired(g: dict, ref: dict) -> dict:
    """Step i of every run is the same work (same seed: same batch, same lengths), so runs compare
    step by step: the median of the per-step ratios to the default's, and the ratio of the timed
    steps' totals. With varying lengths the median step alone depends on which step lands in the
    middle; the paired figures do not."""
    a, b = g.get("step_ms") or [], ref.get("step_ms") or []
    k = g.get("warmup_steps") or 0
    a, b = a[k:], b[k:]
    if not a or len(a) != len(b) or g is ref:
        return {}
    return {"paired_ratio": statistics.median(x / y for x, y in zip(a, b)), "total_ratio": sum(a) / sum(b)}


def over_rounds(rounds: list, alloc: str) -> dict:
    """alloc against the default round by round: each round's median, paired and total ratios,
    and their medians over the rounds; equal only if every round was."""
    per = []
    for rg in rounds:
        g, ref = rg[alloc], rg["default"]
        one = {"median": g.get("inter_ratio") or step_ratio(g.get("step_s"), ref.get("step_s")),
               "equal": bool(g.get("ok") and ref.get("ok") and g.get("losses") == ref.get("losses"))}
        if "inter_ratio" in g:
            one["paired_ratio"] = g["inter_paired"]
        else:
            one.update(paired(g, ref))
        per.append(one)
    out = {"rounds": per, "equal": all(p["equal"] for p in per),
           "rounds_median": statistics.median(p["median"] for p in per)}
    if all("paired_ratio" in p for p in per):
        out["paired_ratio"] = statistics.median(p["paired_ratio"] for p in per)
        if all("total_ratio" in p for p in per):
            out["total_ratio"] = statistics.median(p["total_ratio"] for p in per)
    return out


def table(r: dict) -> str:
    """The markdown tables for bench/RESULTS.md."""
    what = {"gpt2": "GPT-2 medium training, batch 8 x 1024", "bert": "BERT-base training, batch 32, varlen 32-512",
            "resnet": "ResNet-50 training, batch 128", "llama": "Llama-shaped greedy generation, batch 8"}
    lines = [f"\n{r['device']}, torch {r['torch']}, {r['seconds']:.0f} s in all\n",
             "| workload | allocator | equal to default (default repeats) | spillway held peak / default max_reserved "
             "| step time vs default: median step (paired per step; total) |", "| --- | --- | --- | --- | --- |"]
    for x in r["rows"]:
        if x["allocator"] == "default":
            lines.append(f"| {what[x['workload']]} | default | repeats {x['repeat_equal']} over {x['repeat_steps']} "
                         f"steps | {gb(x['default_max_reserved'])} reserved | "
                         f"{1e3 * (x['step_s'] or 0):.2f} ms |")
            continue
        ratio = (x["spw_held_peak"] or 0) / max(1, x["default_max_reserved"] or 1)
        step = step_ratio(x["step_s"], x["default_step_s"])
        eq = {True: "yes", False: "no", None: "-"}[x["equal"]]
        lines.append(f"| {what[x['workload']]} | {x['allocator']} | {eq} ({x['repeat_equal']}) | "
                     f"{gb(x['spw_held_peak'])} / {gb(x['default_max_reserved'])} ({ratio:.3f}) | "
                     f"{step:.3f} ({1e3 * (x['step_s'] or 0):.2f} / {1e3 * (x['default_step_s'] or 0):.2f} ms)"
                     + (f" (paired {x['paired_ratio']:.3f}; total {x['total_ratio']:.3f})" if "total_ratio" in x else "")
                     + (f"; over {len(x['rounds'])} rounds: median {x['rounds_median']:.3f}" if "rounds" in x else "")
                     + (f" (its own default steps, interleaved; neighbours {x['inter_paired']:.3f} over "
                        f"{x['inter_pairs']} pairs)" if "inter_ratio" in x else "")
                     + (f" ERROR {x['error'][:120]}" if x["error"] else "") + " |")
    for w, why in r["skipped"].items():
        lines.append(f"| {what[w]} | - | not run: {why} | | |")
    if r["cap"]:
        lines += ["", "| workload | cap C | largest batch, use_allocator(budget=C) | largest batch, "
                  "set_per_process_memory_fraction | ladder tried (spillway; fraction) |", "| --- | --- | --- | --- | --- |"]
        for c in r["cap"]:
            lines.append(f"| {what[c['workload']]} | {gb(c['cap'])} | {c['largest_spillway']} | {c['largest_fraction']} | "
                         f"{c['tried_spillway']}; {c['tried_fraction']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
