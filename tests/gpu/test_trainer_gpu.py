"""transformers' Trainer over a model trained through spillway.torch.offload(model, budget,
optimizer=opt), the optimizer handed to the Trainer (optimizers=(opt, None)) as its
documentation allows: the Trainer places the model on the device (.to(), which leaves the
offloaded weights in their packs), wraps the optimizer, clips the gradients (max_grad_norm) and
schedules the learning rate, and the loop is its own. Against the same Trainer over the
resident model: every logged loss within 1e-3 relative (the C AdamW on the host against
torch's on the device), the weights moved every step. Skipped without CUDA or transformers.

    SPILLWAY_LIBRARY=$PWD/build/libspillway.so PYTHONPATH=$PWD/python \
        python -m pytest -q -s tests/gpu/test_trainer_gpu.py
"""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
transformers = pytest.importorskip("transformers")

import spillway.torch as spt  # noqa: E402

DEV = torch.device("cuda", torch.cuda.current_device())
STEPS = 6


def _losses(model, opt, tmp_path, name):
    args = transformers.TrainingArguments(output_dir=str(tmp_path / name), max_steps=STEPS,
                                          per_device_train_batch_size=4, learning_rate=1e-3, max_grad_norm=1.0,
                                          logging_steps=1, save_strategy="no", report_to=[], seed=0,
                                          dataloader_num_workers=0, disable_tqdm=True)
    g = torch.Generator().manual_seed(7)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 1000, (STEPS * 4, 32), generator=g)]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None))
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_an_offloaded_model(tmp_path):
    cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=1000)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).to(DEV)
    model = copy.deepcopy(ref).cpu()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    off = spt.offload(model, budget="8MiB", optimizer=opt, backend="cuda")
    assert sum(u.nbytes for u in off.units) > off.context.budget
    want = _losses(ref, opt_ref, tmp_path, "resident")
    got = _losses(model, opt, tmp_path, "offloaded")
    print(f"\nresident losses {want}\noffloaded losses {got}")
    assert len(got) == len(want) == STEPS
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-3 * abs(b), (got, want)
    s = off.stats()
    assert s["offload"]["optimizer_steps"] == STEPS
    assert s["bytes_h2d"]["total"] >= STEPS * (sum(u.nbytes for u in off.units) - off.context.budget)
    assert any(p.device.type == "cpu" for p in model.parameters())  # still offloaded after the Trainer's .to()
    off.remove()
