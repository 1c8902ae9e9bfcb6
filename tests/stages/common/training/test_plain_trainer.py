"""The plain-torch trainer makes DeepSpeed's update (one rank, ZeRO 0, CPU); its checkpoints:
tests/stages/common/training/test_trainer_state.py."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from alignflow.stages.common.training.deepspeed_setup import OptimSettings, initialize
from alignflow.stages.common.training.plain_trainer import (
    PlainTorchTrainer,
    clip_grad_norm,
    initialize_trainer,
    resolve_train_backend,
)

SETTINGS = OptimSettings(
    lr=1e-2,
    weight_decay=0.01,
    warmup_steps=0,
    total_steps=10,
    micro_batch_size=4,
    grad_accum=1,
    zero_stage=0,
    grad_clip=0.5,
    schedule="constant",
)


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=64,
            max_position_embeddings=32,
        )
    )


def train(engine, steps: int = 4) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, 64, (4, 12), generator=gen)
        loss = engine(input_ids=ids, labels=ids).loss * 10  # large gradients: clipping at 0.5 is active
        engine.backward(loss)
        engine.step()


def test_same_weights_as_deepspeed_after_clipped_steps():
    plain = PlainTorchTrainer(tiny_model(), SETTINGS)
    deep, _, _ = initialize(tiny_model(), SETTINGS)
    train(plain)
    train(deep)
    for (name, a), (_, b) in zip(
        plain.module.named_parameters(), deep.module.named_parameters(), strict=True
    ):
        # Same AdamW and clipping (fused here, DeepSpeed's torch AdamW there): another summation order, ~1e-8.
        assert torch.allclose(a, b, atol=1e-6, rtol=0), name


@pytest.mark.parametrize("max_norm", [1e-3, 1e6], ids=["clipped", "unclipped"])
def test_clip_grad_norm_gives_torchs_gradients_bit_for_bit(max_norm):
    model = tiny_model()
    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]
    want_total = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    want = [p.grad.clone() for p in params]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    total = clip_grad_norm(params, max_norm)
    assert torch.equal(total, want_total)
    for p, w, before in zip(params, want, grads, strict=True):
        assert torch.equal(p.grad, w)
        # clipped: every gradient scaled; unclipped: left as they were
        assert torch.equal(p.grad, before) == (max_norm == 1e6) or not before.any()



@pytest.mark.parametrize(
    ("setting", "zero", "world", "expected"),
    [
        ("auto", 0, "1", "torch"),
        ("auto", 2, "1", "deepspeed"),
        ("auto", 0, "2", "deepspeed"),
        ("deepspeed", 0, "1", "deepspeed"),
        ("torch", 0, "1", "torch"),
    ],
)
def test_backend_choice(monkeypatch, setting, zero, world, expected):
    monkeypatch.setenv("WORLD_SIZE", world)
    assert resolve_train_backend(setting, zero) == expected


def test_torch_backend_refuses_zero_and_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="one rank without ZeRO"):
        resolve_train_backend("torch", 3)


def test_settings_it_cannot_honour_are_errors():
    with pytest.raises(ValueError, match="grad_accum 1"):
        initialize_trainer(tiny_model(), OptimSettings(**{**SETTINGS.__dict__, "grad_accum": 2}), "torch")
    with pytest.raises(ValueError, match="no learning-rate schedule"):
        initialize_trainer(
            tiny_model(), OptimSettings(**{**SETTINGS.__dict__, "schedule": "cosine"}), "torch"
        )


def test_model_attributes_reach_through_like_deepspeed():
    engine = PlainTorchTrainer(tiny_model(), SETTINGS)
    assert engine.model is engine.module.model and engine.config.hidden_size == 32


def test_saving_a_torch_trained_model_does_not_import_deepspeed(tmp_path):
    """transformers' save_pretrained asks accelerate whether the model is a DeepSpeed engine, and accelerate
    imports deepspeed (and mlflow) to ask: seconds at the end of every plain-torch stage. Fresh interpreter,
    since this test session has imported deepspeed already."""
    import subprocess
    import sys

    script = f"""
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from alignflow.stages.common.training.lora import save_trained
from alignflow.stages.common.training.deepspeed_setup import OptimSettings
from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                     max_position_embeddings=32))
settings = OptimSettings(lr=1e-2, weight_decay=0.0, warmup_steps=0, total_steps=1, micro_batch_size=1,
                         grad_accum=1, zero_stage=0, grad_clip=1.0, schedule="constant")
save_trained(PlainTorchTrainer(model, settings), {str(tmp_path)!r})
assert 'deepspeed' not in sys.modules, 'save_trained imported deepspeed'
loaded = LlamaForCausalLM.from_pretrained({str(tmp_path)!r})
assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
print('ok')
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
