#!/usr/bin/env python3
"""Where do greedy-decoded tokens of an offloaded Llama-shaped model part from the resident
model's? Four layers of the benchmark's shape (hidden 4096, 14336, 32/8 heads, vocab 32000,
bf16, random weights), batch 8, prompt 512, 16 tokens with the KV cache:

  resident twice            is the reference itself deterministic?
  resident, realigned       the same weights copied to addresses 256 bytes past a 512-byte
                            boundary (where offload's packed views can land): does cuBLAS pick
                            other kernels by alignment?
  spillway offload (plan)   budget of two layers and 600 MiB (the whole is 2.1 GiB)

Prints, for each, whether the tokens are bitwise equal and the first step whose logits differ.
    SPILLWAY_LIBRARY=build/libspillway.so PYTHONPATH=python python3 bench/dev/decode_equal.py
"""
import copy

import torch
import transformers

torch.manual_seed(0)
dev = torch.device("cuda")
cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
with torch.device(dev):
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
ids = torch.randint(0, 32000, (8, 512), device=dev)
host = copy.deepcopy(model).cpu().requires_grad_(False)  # the offloaded copy, before realigning


def greedy(m, n=16):
    logits, toks = [], []
    with torch.no_grad():
        out = m(input_ids=ids, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        for _ in range(n):
            last = out.logits[:, -1, :]
            logits.append(last.float().cpu())
            toks.append(last.argmax(-1, keepdim=True))
            out = m(input_ids=toks[-1], past_key_values=past, use_cache=True, logits_to_keep=1)
            past = out.past_key_values
    return torch.cat(toks, 1).cpu(), logits


def report(name, got, ref):
    toks, logits = got
    first = next((i for i, (a, b) in enumerate(zip(logits, ref[1])) if not torch.equal(a, b)), None)
    print(f"{name:<28} tokens equal {torch.equal(toks, ref[0])}; first step with other logits: {first}",
          flush=True)


ref = greedy(model)
report("resident again", greedy(model), ref)

keep = []
for p in model.parameters():  # realign: each weight 256 B past a 512-B boundary
    raw = torch.empty(p.numel() * p.element_size() + 1024, dtype=torch.uint8, device=dev)
    off = (-raw.data_ptr()) % 512 + 256
    view = raw[off:off + p.numel() * p.element_size()].view(p.dtype).view(p.shape)
    view.copy_(p.data)
    keep.append(raw)
    p.data = view
print("weights at 256 mod 512:", all(p.data_ptr() % 512 == 256 for p in model.parameters()))
report("resident, realigned", greedy(model), ref)

import spillway.torch as spt  # noqa: E402

layer_bytes = sum(p.numel() * p.element_size() for p in host.model.layers[0].parameters())
off = spt.offload(host, budget=2 * layer_bytes + (600 << 20), policy="plan", backend="cuda")
report("spillway offload, plan", greedy(host), ref)

off.remove()
