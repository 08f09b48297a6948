"""Quantized weights offloaded on a real GPU: a wrapper subclass quantized on the device (its
Parameters then hold host copies, their device attribute with them), torchao's int8 weight-only
quantization of a transformers Llama, and bitsandbytes' 4-bit layers; each offloaded below its
bytes beside a resident twin: logits bitwise equal over three calls, the weights really moving,
then remove() giving the resident model back. Skipped without CUDA; the torchao and
bitsandbytes cases without those packages.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \\
        python -m pytest -q -s tests/gpu/test_quantized_gpu.py
"""
from __future__ import annotations

import copy
import os
import sys

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

import spillway.torch as spt  # noqa: E402
from spillway.torch import _wrapped  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
from models import WrappedInt8, moved, offloaded_bytes  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
MiB = 1 << 20


def _equal_over_calls(model, ref, off, call, calls: int = 3) -> None:
    with torch.no_grad():
        want = call(ref)
        for _ in range(calls):
            assert torch.equal(moved(off, lambda: call(model)), want)


def test_a_wrapper_subclass_quantized_on_the_device():
    torch.manual_seed(0)
    with torch.device(DEV):
        ref = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(16)]).requires_grad_(False)
    for lin in ref:
        lin.weight = nn.Parameter(WrappedInt8.quantize(lin.weight.detach()), requires_grad=False)
    model = copy.deepcopy(ref)
    host = model[5].weight
    off = spt.offload(model, budget=24 * MiB)
    assert 64 * MiB < offloaded_bytes(off) < 66 * MiB  # int8 and scales: not 256 MiB of float32
    assert model[5].weight is host and host.device.type == "cpu" and host.qdata.device.type == "cpu"
    x = torch.randn(8, 2048, device=DEV)
    _equal_over_calls(model, ref, off, lambda m: m(x))
    off.remove()
    assert model[5].weight is host and host.device == DEV and host.qdata.device == DEV
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))


def _llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=6,
                                   num_attention_heads=8, num_key_value_heads=4, vocab_size=2000,
                                   attn_implementation="sdpa", torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device(DEV):
        return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).requires_grad_(False)


def test_torchao_int8_weight_only_llama():
    ao = pytest.importorskip("torchao.quantization")
    ref = _llama()
    config = getattr(ao, "Int8WeightOnlyConfig", None)
    ao.quantize_(ref, config() if config is not None else ao.int8_weight_only())
    model = copy.deepcopy(ref)
    total = sum(_wrapped.nbytes(p) for p in model.parameters())
    off = spt.offload(model, budget=int(total * 0.4))
    ids = torch.randint(0, 2000, (2, 64), device=DEV)
    _equal_over_calls(model, ref, off, lambda m: m(input_ids=ids).logits)
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False),
                           ref.generate(ids, max_new_tokens=8, do_sample=False))
    off.remove()
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_bitsandbytes_4bit_layers():
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        lin = nn.Linear(2048, 2048, dtype=torch.bfloat16)
        q = bnb.nn.Linear4bit(2048, 2048, compute_dtype=torch.bfloat16, quant_type="nf4")
        q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4")
        q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
        layers.append(q)
    ref = nn.Sequential(*layers).to(DEV)  # quantized by the move
    model = copy.deepcopy(ref)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    off = spt.offload(model, budget=int(total * 0.4))
    x = torch.randn(8, 2048, device=DEV, dtype=torch.bfloat16)
    _equal_over_calls(model, ref, off, lambda m: m(x))
    off.remove()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
