#!/usr/bin/env python3
"""Which kernel makes a resident Llama-shaped model decode differently twice in a row?

Two layers of the small-card model's shape (hidden 4096, intermediate 14336, 32/8 heads, vocab
32000, bf16, random weights), batch 8, prompt 512 with an all-ones attention mask (as
generate() passes it), then 8 decode steps with the KV cache fed fixed tokens. Each
configuration runs that twice in one process, under torch.use_deterministic_algorithms and
CUBLAS_WORKSPACE_CONFIG=:4096:8 (set here), and prints the first decode step and the first
sub-operation of the layers whose output differs between the two: q_proj's output, the
attention's (o_proj's input), o_proj's, the MLP's, the layer's. Configurations: SDPA as torch
picks it, then each SDPA backend alone; with and without the mask.

    python3 bench/dev/decode_determinism.py
"""
import contextlib
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import transformers  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

torch.use_deterministic_algorithms(True, warn_only=True)
torch.manual_seed(0)
dev = torch.device("cuda")
cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
                               attn_implementation="sdpa")
with torch.device(dev):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
ids = torch.randint(3, 32000, (8, 512), device=dev)
feed = torch.randint(3, 32000, (8, 8), device=dev)

seen = []  # (name, output) of the hooked sub-operations, in call order


def hook(name, take_input=False):
    def f(mod, args, out):
        seen.append((name, (args[0] if take_input else out).detach().clone()))
    return f


for i, layer in enumerate(model.model.layers):
    layer.self_attn.q_proj.register_forward_hook(hook(f"L{i}.q_proj"))
    layer.self_attn.o_proj.register_forward_hook(hook(f"L{i}.attention", take_input=True))
    layer.self_attn.o_proj.register_forward_hook(hook(f"L{i}.o_proj"))
    layer.mlp.register_forward_hook(hook(f"L{i}.mlp"))
    layer.register_forward_hook(hook(f"L{i}.out"))


def run(with_mask):
    """[(step, name, tensor)] of the decode steps (step 0: the prefill)."""
    rec = []
    mask = torch.ones_like(ids)
    with torch.no_grad():
        seen.clear()
        out = model(input_ids=ids, attention_mask=mask if with_mask else None, use_cache=True, logits_to_keep=1)
        rec += [(0, n, t) for n, t in seen]
        past = out.past_key_values
        for s in range(feed.shape[1]):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            seen.clear()
            out = model(input_ids=feed[:, s:s + 1], attention_mask=mask if with_mask else None,
                        past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
            rec += [(s + 1, n, t) for n, t in seen]
            rec.append((s + 1, "logits", out.logits.clone()))
    return rec


def compare(name, ctx, with_mask):
    try:
        with ctx():
            a, b = run(with_mask), run(with_mask)
    except RuntimeError as e:
        print(f"{name:<34} unavailable: {str(e).splitlines()[0][:100]}", flush=True)
        return
    for (s, n, x), (_, _, y) in zip(a, b):
        if not torch.equal(x, y):
            d = float((x.float() - y.float()).abs().max())
            print(f"{name:<34} parts at step {s}, {n}: largest difference {d:.3g}", flush=True)
            return
    print(f"{name:<34} bitwise equal over {feed.shape[1]} decode steps", flush=True)


configs = [("sdpa as torch picks", contextlib.nullcontext)]
for b in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
    if hasattr(SDPBackend, b):
        configs.append((b.lower(), lambda b=b: sdpa_kernel(getattr(SDPBackend, b))))
print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
for with_mask in (True, False):
    for name, ctx in configs:
        compare(f"{name}, mask {'ones' if with_mask else 'None'}", ctx, with_mask)
