#!/usr/bin/env python3
"""transformers' own model classes offloaded on a CUDA device: each built from a small config of
its published architecture (random weights, fp32, on the device), offloaded at --fraction of its
bytes and compared with a resident twin:

  forward   logits of --steps calls bitwise equal, each call uploading at least what the budget
            cannot hold (a model that fits proves nothing)
  generate  greedy generate() with the model's cache (decoders, encoder-decoders) bitwise equal
  train     offload(model, optimizer=AdamW): every gradient of the first backward bitwise equal
            to resident's, then three steps whose losses stay within 1e-3 of resident's
            (the update runs in spillway's C AdamW on the host, resident's on the device)
  lora      peft LoRA on every linear layer of the frozen, offloaded base: three AdamW steps,
            losses and adapters bitwise equal
  removed   remove() gives the resident model back (logits bitwise equal again)

Decoders (Llama, Mistral, Qwen2/3, Gemma 2/3, Phi, Phi-3, Cohere, StableLM, StarCoder2, OLMo 2,
Granite, GPT-2's Conv1D, GPT-J, CodeGen, GPT-NeoX, Falcon, OPT, BLOOM's ALiBi, MPT), mixtures of
experts (Mixtral, Qwen3-MoE, DeepSeek-V3 with its latent attention, GPT-OSS), state-space and
hybrid models (Mamba, Mamba-2, Jamba), a vision-language model (LLaVA), encoder-decoders (T5,
BART, Whisper) and encoders (BERT, ViT, CLIP). transformers is not on Debian: this runs where it is installed (the GPU machine).

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \\
        python3 bench/dev/transformers_zoo.py [--checks forward,generate,train,lora]
            [--quant torchao-int8|bnb-nf4] [NAME ...]

--quant quantizes every model's linear layers before the twins part (torchao's int8 weight-only
tensors, wrapper subclasses; bitsandbytes' NF4 layers, a Parameter subclass): the budget is a
fraction of the quantized bytes, and the train check is left out.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Tuple

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: deterministic matmuls
import torch  # noqa: E402

import spillway.torch as spt  # noqa: E402
from spillway.torch import _wrapped  # noqa: E402

MiB = 1 << 20
DEV = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
VOCAB = 4096
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
DEC = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=8,
           num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=False, **IDS)


def ids(g: torch.Generator, b: int = 2, t: int = 64) -> torch.Tensor:
    return torch.randint(3, VOCAB, (b, t), device=DEV, generator=g)


def cases() -> Iterator[Tuple[str, str, Callable[[], Any], Callable[[torch.Generator], Dict[str, Any]], str]]:
    """(name, kind, config, inputs, auto class name). kind: causal, seq2seq, encoder."""
    import transformers as T

    def cfg(model_type: str, **kw) -> Callable[[], Any]:
        # GPT-OSS's attention sinks, and the older decoders: eager only
        attn = "eager" if model_type in ("gpt_oss", "gptj", "codegen", "bloom", "mpt") else "sdpa"
        return lambda: T.AutoConfig.for_model(model_type, attn_implementation=attn, **kw)

    text = lambda g: dict(input_ids=ids(g))  # noqa: E731
    image = VOCAB - 1  # the vision-language models' image token: one per patch of the image (8 x 8), then text

    def image_text(g: torch.Generator) -> Dict[str, Any]:
        """A vision-language model's inputs: an image's 8 x 8 patch tokens, then 16 of text."""
        t = ids(g, t=16).clamp_max(VOCAB - 2)
        return dict(input_ids=torch.cat([torch.full((2, 64), image, device=DEV), t], 1),
                    pixel_values=torch.randn(2, 3, 64, 64, device=DEV, generator=g))
    for mt, extra in (("llama", {}), ("mistral", {}), ("qwen2", {}), ("qwen3", dict(head_dim=64)),
                      ("gemma2", dict(head_dim=64, tie_word_embeddings=True)),
                      ("gemma3_text", dict(head_dim=64, sliding_window=32)), ("phi3", {}),
                      ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
                      ("qwen3_moe", dict(head_dim=64, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                         decoder_sparse_step=1, mlp_only_layers=[])),
                      ("gpt_oss", dict(head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=32)),
                      ("deepseek_v3", dict(num_hidden_layers=4, num_key_value_heads=8, moe_intermediate_size=256,
                                           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                                           first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=256,
                                           qk_rope_head_dim=32, v_head_dim=64, qk_nope_head_dim=32, n_group=2,
                                           topk_group=1))):
        yield mt, "causal", cfg(mt, **{**DEC, **extra}), text, "AutoModelForCausalLM"
    for mt, extra in (("cohere", {}), ("stablelm", {}), ("starcoder2", {}), ("olmo2", {}), ("granite", {}),
                      ("jamba", dict(num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                     attn_layer_period=3, attn_layer_offset=1, mamba_d_state=16, mamba_d_conv=4,
                                     mamba_expand=2, use_mamba_kernels=False))):
        yield mt, "causal", cfg(mt, **{**DEC, **extra}), text, "AutoModelForCausalLM"
    for mt, extra in (("nemotron", {}), ("smollm3", {}), ("glm", {}), ("glm4", {}), ("helium", dict(head_dim=64)), ("arcee", {}),
                      ("ernie4_5", {}), ("seed_oss", {}), ("hunyuan_v1_dense", dict(head_dim=64, rope_parameters=dict(rope_type="default", rope_theta=10000.0))), ("exaone4", dict(sliding_window=32)),
                      ("olmoe", dict(num_experts=8, num_experts_per_tok=2)),
                      ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2)),
                      ("phimoe", dict(num_local_experts=4, num_experts_per_tok=2)),
                      ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256,
                                         shared_expert_intermediate_size=512)),
                      ("llama4_text", dict(head_dim=64, num_local_experts=4, num_experts_per_tok=1,
                                           intermediate_size_mlp=1024, interleave_moe_layer_step=2,
                                           attention_chunk_size=32)),
                      ("recurrent_gemma", dict(lru_width=512, attention_window_size=32, num_key_value_heads=1,
                                               block_types=["recurrent", "recurrent", "attention"])),
                      ("zamba2", dict(mamba_d_state=16, mamba_headdim=64, n_mamba_heads=16, num_mem_blocks=1,
                                      use_mem_rope=True, num_hidden_layers=54)),  # its default layer types: 54
                      ("falcon_h1", dict(mamba_d_ssm=512, mamba_n_heads=8, mamba_d_head=64, mamba_d_state=16,
                                         mamba_n_groups=1, mamba_chunk_size=64, head_dim=64)),
                      ("bamba", dict(mamba_d_state=16, mamba_n_heads=16, mamba_d_head=64, mamba_n_groups=1,
                                     mamba_chunk_size=64, attn_layer_indices=[2])),
                      ("dbrx", dict(d_model=512, n_heads=8, n_layers=4, max_seq_len=1024, attn_config={"kv_n_heads": 4, "rope_theta": 10000.0, "clip_qkv": 8.0},
                                    ffn_config={"ffn_hidden_size": 1024, "moe_num_experts": 4, "moe_top_k": 2}))):
        yield mt, "causal", cfg(mt, **{**DEC, **extra}), text, "AutoModelForCausalLM"

    yield "paligemma", "causal", lambda: T.PaliGemmaConfig(
        vision_config=dict(model_type="siglip_vision_model", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, image_size=64, patch_size=8, projection_dim=512),
        text_config=dict(model_type="gemma", **{**DEC, "head_dim": 64}), image_token_index=image,
        projection_dim=512, attn_implementation="sdpa"), image_text, "AutoModelForImageTextToText"
    yield "phi", "causal", cfg("phi", vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=6,
                               num_attention_heads=8, **IDS), text, "AutoModelForCausalLM"
    yield "gptj", "causal", cfg("gptj", vocab_size=VOCAB, n_embd=512, n_layer=6, n_head=8, rotary_dim=32,
                                n_positions=1024, **IDS), text, "AutoModelForCausalLM"
    yield "codegen", "causal", cfg("codegen", vocab_size=VOCAB, n_embd=512, n_layer=6, n_head=8, rotary_dim=32,
                                   n_positions=1024, n_ctx=1024, **IDS), text, "AutoModelForCausalLM"
    yield "bloom", "causal", cfg("bloom", vocab_size=VOCAB, hidden_size=512, n_layer=6, n_head=8, **IDS), \
        text, "AutoModelForCausalLM"
    yield "mpt", "causal", cfg("mpt", vocab_size=VOCAB, d_model=512, n_layers=6, n_heads=8, max_seq_len=1024,
                               expansion_ratio=2, **IDS), text, "AutoModelForCausalLM"
    yield "mamba2", "causal", lambda: T.AutoConfig.for_model("mamba2", vocab_size=VOCAB, hidden_size=512,
                                                             num_hidden_layers=4, num_heads=16, head_dim=64, expand=2,
                                                             state_size=64, n_groups=1, chunk_size=64, **IDS), \
        text, "AutoModelForCausalLM"

    yield "llava", "causal", lambda: T.LlavaConfig(
        vision_config=dict(model_type="clip_vision_model", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                           num_attention_heads=4, image_size=64, patch_size=8),
        text_config=dict(model_type="llama", **DEC), image_token_index=image, attn_implementation="sdpa"), \
        image_text, "AutoModelForImageTextToText"
    yield "gpt2", "causal", cfg("gpt2", vocab_size=VOCAB, n_embd=512, n_layer=6, n_head=8, n_positions=1024, **IDS), \
        text, "AutoModelForCausalLM"
    yield "gpt_neox", "causal", cfg("gpt_neox", vocab_size=VOCAB, hidden_size=512, intermediate_size=2048,
                                    num_hidden_layers=6, num_attention_heads=8, tie_word_embeddings=False, **IDS), \
        text, "AutoModelForCausalLM"
    yield "falcon", "causal", cfg("falcon", vocab_size=VOCAB, hidden_size=512, num_hidden_layers=6,
                                  num_attention_heads=8, **IDS), text, "AutoModelForCausalLM"
    yield "opt", "causal", cfg("opt", vocab_size=VOCAB, hidden_size=512, ffn_dim=1024, num_hidden_layers=6,
                               num_attention_heads=8, word_embed_proj_dim=512, max_position_embeddings=1024,
                               **IDS), text, "AutoModelForCausalLM"
    yield "mamba", "causal", lambda: T.AutoConfig.for_model("mamba", vocab_size=VOCAB, hidden_size=512,
                                                            num_hidden_layers=6, state_size=16, **IDS), \
        text, "AutoModelForCausalLM"
    s2s = lambda g: dict(input_ids=ids(g), decoder_input_ids=ids(g, t=16))  # noqa: E731
    yield "t5", "seq2seq", cfg("t5", vocab_size=VOCAB, d_model=512, d_ff=1024, num_layers=4, num_decoder_layers=4,
                               num_heads=8, d_kv=64, decoder_start_token_id=0, pad_token_id=0, eos_token_id=2,
                               dropout_rate=0.0), s2s, "AutoModelForSeq2SeqLM"
    yield "umt5-encoder", "encoder", cfg("umt5", vocab_size=VOCAB, d_model=512, d_ff=1024, num_layers=4, num_heads=8,
                                          d_kv=64, dropout_rate=0.0, pad_token_id=0, eos_token_id=2), text, "UMT5EncoderModel"
    yield "bart", "seq2seq", cfg("bart", vocab_size=VOCAB, d_model=512, encoder_layers=3, decoder_layers=3,
                                 encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=1024,
                                 decoder_ffn_dim=1024, max_position_embeddings=256, decoder_start_token_id=2,
                                 forced_eos_token_id=None, dropout=0.0, **IDS), s2s, "AutoModelForSeq2SeqLM"
    yield "whisper", "encoder", cfg("whisper", vocab_size=VOCAB, d_model=512, encoder_layers=3, decoder_layers=3,
                                    encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=1024,
                                    decoder_ffn_dim=1024, num_mel_bins=80, max_source_positions=64,
                                    max_target_positions=128, decoder_start_token_id=1, dropout=0.0, **IDS), \
        lambda g: dict(input_features=torch.randn(2, 80, 128, device=DEV, generator=g), decoder_input_ids=ids(g, t=16)), \
        "AutoModelForSpeechSeq2Seq"
    yield "bert", "encoder", cfg("bert", vocab_size=VOCAB, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                                 intermediate_size=1024, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                 pad_token_id=0), text, "AutoModelForMaskedLM"
    yield "vit", "encoder", cfg("vit", hidden_size=512, num_hidden_layers=6, num_attention_heads=8, intermediate_size=1024,
                                image_size=64, patch_size=8, num_labels=10), \
        lambda g: dict(pixel_values=torch.randn(2, 3, 64, 64, device=DEV, generator=g)), "AutoModelForImageClassification"
    yield "clip", "encoder", lambda: T.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, max_position_embeddings=77),
        vision_config=dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                           image_size=64, patch_size=8), projection_dim=256), \
        lambda g: dict(input_ids=ids(g, t=32), pixel_values=torch.randn(2, 3, 64, 64, device=DEV, generator=g)), \
        "AutoModel"


def first(out: Any) -> torch.Tensor:
    for key in ("logits", "logits_per_image", "last_hidden_state"):
        if getattr(out, key, None) is not None:
            return getattr(out, key)
    return out[0]


def loss_of(out: Any) -> torch.Tensor:
    return first(out).float().square().mean()


QUANT: str = ""  # --quant: how build() quantizes each model's linear layers


def build(config: Callable[[], Any], auto: str) -> torch.nn.Module:
    import transformers as T
    torch.manual_seed(0)
    with torch.device(DEV):
        cls = getattr(T, auto)
        model = cls.from_config(config()) if auto.startswith("Auto") else cls(config())
    if QUANT:
        quantize(model.requires_grad_(False), QUANT)
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        # offloaded fused experts run the eager experts function (spillway.torch._experts): so do both twins
        model.set_experts_implementation("eager")
    return model.eval()


def quantize(model: torch.nn.Module, how: str) -> None:
    """torchao-int8: torchao's int8 weight-only quantize_ (wrapper subclasses); bnb-nf4:
    bitsandbytes' 4-bit layers (a Parameter subclass) in place of every Linear but the head."""
    if how == "torchao-int8":
        import torchao.quantization as ao
        cfg = getattr(ao, "Int8WeightOnlyConfig", None)
        ao.quantize_(model, cfg() if cfg is not None else ao.int8_weight_only())
        return
    import bitsandbytes as bnb
    for parent in list(model.modules()):
        for key, lin in list(parent._modules.items()):
            if type(lin) is not torch.nn.Linear or key == "lm_head":
                continue
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                  compute_dtype=lin.weight.dtype, quant_type="nf4")
            q.weight = bnb.nn.Params4bit(lin.weight.data.cpu(), requires_grad=False, quant_type="nf4")
            if lin.bias is not None:
                q.bias = torch.nn.Parameter(lin.bias.data.cpu(), requires_grad=False)
            parent._modules[key] = q.to(DEV)  # quantized by the move


def budget_of(model: torch.nn.Module, fraction: float) -> Tuple[int, int]:
    total = sum(map(_wrapped.nbytes, list(model.parameters()) + list(model.buffers())))
    return total, int(total * fraction) // (2 * MiB) * (2 * MiB)


def h2d(off) -> int:
    return off.context.stats()["bytes_h2d"]["total"]


def check_forward(name, kind, config, inputs, auto, args) -> Dict[str, Any]:
    ref = build(config, auto).requires_grad_(False)
    model = copy.deepcopy(ref)
    total, budget = budget_of(model, args.fraction)
    off = spt.offload(model, budget=budget)
    res: Dict[str, Any] = {"MiB": total / MiB, "units": len(off.units), "must": (total - budget) / MiB,
                           "fused": len(off._fused)}
    same, moved = True, []
    with torch.no_grad():
        for i in range(args.steps):
            kw = inputs(torch.Generator(device=DEV).manual_seed(i))
            before = h2d(off)
            a = first(model(**kw))
            moved.append(h2d(off) - before)
            same &= torch.equal(a, first(ref(**kw)))
    res.update(forward=same, moved=moved[-1] / MiB, moving=min(moved) >= total - budget)
    if kind in ("causal", "seq2seq") and "generate" in args.checks:
        kw = inputs(torch.Generator(device=DEV).manual_seed(99))
        kw.pop("decoder_input_ids", None)
        gk = dict(max_new_tokens=12, do_sample=False, min_new_tokens=12)
        with torch.no_grad():
            a, b = model.generate(**kw, **gk), ref.generate(**kw, **gk)
        res["generate"] = a.shape == b.shape and torch.equal(a, b)
    res["hook_us"] = off.hook_stats()["hook_us_median"]
    off.remove()
    with torch.no_grad():
        kw = inputs(torch.Generator(device=DEV).manual_seed(0))
        res["removed"] = torch.equal(first(model(**kw)), first(ref(**kw)))
    return res


def check_train(name, kind, config, inputs, auto, args) -> Dict[str, Any]:
    ref = build(config, auto)
    model = copy.deepcopy(ref)
    total, budget = budget_of(model, args.fraction)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-4, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
    off = spt.offload(model, budget=budget, optimizer=opt, train_on_device=0, activations=args.activations)
    res: Dict[str, Any] = {}
    worst = 0.0
    for step in range(3):
        kw = inputs(torch.Generator(device=DEV).manual_seed(step))
        before = h2d(off)
        la, lb = loss_of(model(**kw)), loss_of(ref(**kw))
        la.backward()
        lb.backward()
        if step == 0:
            res["moving"] = h2d(off) - before >= total - budget
            pairs = [(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters())]
            differ = [(n, float((a.to(DEV) - b).abs().max() / b.abs().max().clamp_min(1e-30)))
                      for (n, _), (a, b) in zip(model.named_parameters(), pairs)
                      if (a is None) != (b is None) or (a is not None and not torch.equal(a.to(DEV), b))]
            res["grads"] = not differ or f"{len(differ)} differ: " + ", ".join(f"{n} {r:.1e}" for n, r in differ[:4])
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        worst = max(worst, abs(la.item() - lb.item()) / max(abs(lb.item()), 1e-30))
    res["losses"] = worst
    off.remove()
    return res


def check_lora(name, kind, config, inputs, auto, args) -> Dict[str, Any]:
    import peft
    base = build(config, auto).requires_grad_(False)
    targets = {"mamba": ["in_proj", "x_proj", "dt_proj"], "mamba2": ["in_proj"]}.get(name, "all-linear")  # peft refuses the rest
    # peft's LoRA cannot wrap a router whose linear layer returns a tuple (PhiMoE, Llama 4) nor
    # Falcon-H1's Mamba mixers: those stay frozen
    skip = {"phimoe": r".*\.router$", "llama4_text": r".*\.router$", "falcon_h1": r".*\.mamba\..*"}.get(name)
    extra = {"exclude_modules": skip} if skip else {}
    ref = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, **extra))
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    model = copy.deepcopy(ref)
    frozen = sum(_wrapped.nbytes(p) for p in model.parameters() if not p.requires_grad)
    budget = int(frozen * args.fraction) // (2 * MiB) * (2 * MiB)
    off = spt.offload(model, budget=budget)
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-3) for m in (model, ref)]
    same, moving = True, True
    for step in range(3):
        kw = inputs(torch.Generator(device=DEV).manual_seed(step))
        before = h2d(off)
        la, lb = loss_of(model(**kw)), loss_of(ref(**kw))
        la.backward()
        lb.backward()
        moving &= h2d(off) - before >= frozen - budget
        same &= torch.equal(la, lb)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)
    adapters = all(torch.equal(p, q) for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
                   if p.requires_grad)
    off.remove()
    return {"lora": same and adapters, "lora_moving": moving}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*")
    ap.add_argument("--checks", default="forward,generate,train,lora")
    ap.add_argument("--fraction", type=float, default=0.4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--activations", default=None, type=lambda v: {"on": True, "off": False}[v],
                    help="offload()'s activations for the train check (on, off; default: its own)")
    ap.add_argument("--quant", default="", choices=["", "torchao-int8", "bnb-nf4"],
                    help="quantize each model's linear layers first (forward, generate and lora checks)")
    args = ap.parse_args()
    args.checks = set(args.checks.split(","))
    global QUANT
    QUANT = args.quant
    if QUANT:
        args.checks.discard("train")  # quantized weights are not trained
    import transformers
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.enable_cudnn_sdp(False)  # not deterministic run to run (bench/RESULTS.md)
    # CUDA's embedding backward sums repeated indices in no fixed order: T5's relative-position
    # bias (a few buckets repeated over every query and key) differs between two resident runs
    torch.use_deterministic_algorithms(True, warn_only=True)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.cuda.get_device_name()}, "
          f"budget {args.fraction:.0%} of each model, checks {','.join(sorted(args.checks))}")
    failed = 0
    for name, kind, config, inputs, auto in cases():
        if args.names and name not in args.names:
            continue
        res: Dict[str, Any] = {}
        t0 = time.perf_counter()
        for check, fn in (("forward", check_forward), ("train", check_train), ("lora", check_lora)):
            if check not in args.checks:
                continue
            try:
                res.update(fn(name, kind, config, inputs, auto, args))
            except Exception as e:  # report and go on with the next check
                traceback.print_exc(limit=-6)
                res[check] = f"{type(e).__name__}: {str(e)[:200]}"
        bad = [k for k in ("forward", "moving", "generate", "removed", "train", "grads", "lora", "lora_moving")
               if k in res and res[k] is not True]
        if "losses" in res and res["losses"] > 1e-3:
            bad.append("losses")
        failed += bool(bad)
        parts = " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())
        print(f"{name:12s} {'FAIL ' + ','.join(bad) if bad else 'ok'} ({time.perf_counter() - t0:.1f} s) {parts}",
              flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
