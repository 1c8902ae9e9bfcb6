"""Refit copies new weights into the engine's own buffers, streaming, without rebuilding anything."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from engine_test_models import (
    engine_config,
    memory_in_use,
    perturbed_checkpoint,
    random_prompts,
    save_tiny_model,
)

from alignflow.stages.common.generation import EngineError, RefitError, SamplingParams, build_engine
from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native.weights import checkpoint_tensors

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


@pytest.fixture(scope="module")
def medium_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A ~5M-parameter Llama (big enough for memory to be measured) and a perturbed copy of it."""
    root = tmp_path_factory.mktemp("refit")
    base = save_tiny_model(root / "base", "llama_mha_untied", hidden_size=256, intermediate_size=688,
                           num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)
    return base, perturbed_checkpoint(base, root / "perturbed")


def test_refit_equals_fresh_build_streams_and_does_not_rebuild(medium_pair, device):
    base, perturbed = medium_pair
    engine = NativeEngine.build(base, engine_config(), device=device)
    prompts = random_prompts(6, seed=1, vocab=1024)
    before = engine.generate(prompts, GREEDY).response_token_ids
    pointers, builds = engine.weights.data_ptrs(), NativeEngine.builds
    model_bytes = engine.weights.nbytes()

    # the engine's own device: host heap on the CPU, the CUDA allocator on a GPU
    baseline = memory_in_use(device)
    peak = [0]

    def measured(stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for item in stream:
            yield item
            # Back here, the engine has copied the tensor and may still hold anything it kept.
            now = memory_in_use(device)
            if now is not None and baseline is not None:
                peak[0] = max(peak[0], now - baseline)

    stats = engine.refit(measured(checkpoint_tensors(perturbed)))

    assert engine.weights.data_ptrs() == pointers, "refit reallocated a weight buffer"
    assert NativeEngine.builds == builds, "refit rebuilt the engine"
    fresh = NativeEngine.build(perturbed, engine_config(), device=device)
    after = engine.generate(prompts, GREEDY).response_token_ids
    assert after == fresh.generate(prompts, GREEDY).response_token_ids
    assert after != before, "the perturbation should change greedy output; otherwise this test proves nothing"
    assert stats.tensors == 4 * 9 + 3 and stats.bytes == model_bytes
    if baseline is None:
        pytest.skip("no glibc mallinfo2: peak memory not measured")
    # safetensors hands out memory-mapped tensors, so the probe counts what the engine itself
    # allocates while streaming: ~0.1 MiB measured for a 13 MiB model on the CPU. An engine that kept a copy
    # of each tensor (or fused by torch.cat) would show >= 100%; the probe does see such memory:
    probe_start = memory_in_use(device)
    second_copy = torch.empty(model_bytes // 4, device=device)
    assert memory_in_use(device) - probe_start >= model_bytes
    del second_copy
    assert peak[0] < 0.05 * model_bytes, (
        f"refit peak extra memory {peak[0] / 2**20:.2f} MiB of {model_bytes / 2**20:.1f} MiB model"
    )


def test_refit_from_live_module_parameters(tiny_checkpoints, tmp_path, device):
    """The PPO path: named_parameters() of a trained model (tied: lm_head is not listed separately), on the
    trainer's device (here the engine's)."""
    from transformers import AutoModelForCausalLM

    base = tiny_checkpoints["llama_gqa_tied_llama3"]
    perturbed = perturbed_checkpoint(base, tmp_path / "p")
    model = AutoModelForCausalLM.from_pretrained(perturbed).to(device)
    engine = NativeEngine.build(base, engine_config(), device=device)
    engine.refit(model.named_parameters())
    prompts = random_prompts(4, seed=2)
    want = NativeEngine.build(perturbed, engine_config(), device=device).generate(prompts, GREEDY)
    assert engine.generate(prompts, GREEDY).response_token_ids == want.response_token_ids
    # state_dict() lists the tied lm_head.weight too: accepted, same buffer.
    engine.refit(model.state_dict().items())


def test_hf_backend_refit_equals_fresh_build(tiny_checkpoints, tmp_path, device):
    base = tiny_checkpoints["qwen2_bias_window"]
    perturbed = perturbed_checkpoint(base, tmp_path / "p")
    engine = build_engine(base, engine_config(backend="hf"), device=device)
    engine.refit(checkpoint_tensors(perturbed))
    prompts = random_prompts(3, seed=4)
    want = build_engine(perturbed, engine_config(backend="hf"), device=device).generate(prompts, GREEDY)
    assert engine.generate(prompts, GREEDY).response_token_ids == want.response_token_ids
    with pytest.raises(RefitError, match="did not cover"):
        engine.refit([("model.norm.weight", torch.ones(64))])


def test_refit_rejects_unknown_names_wrong_shapes_and_gaps(tiny_checkpoints, device):
    path = tiny_checkpoints["qwen2_bias_window"]
    engine = NativeEngine.build(path, engine_config(), device=device)
    with pytest.raises(RefitError, match="unknown parameter name 'model.layers.0.self_attn.qkv.weight'"):
        engine.refit([("model.layers.0.self_attn.qkv.weight", torch.zeros(3))])
    with pytest.raises(RefitError, match=r"shape \(64, 65\) but the engine expects \(64, 64\)"):
        engine.refit([("model.layers.1.self_attn.q_proj.weight", torch.zeros(64, 65))])
    with pytest.raises(RefitError, match="layer 7 but the model has 2 layers"):
        engine.refit([("model.layers.7.mlp.up_proj.weight", torch.zeros(128, 64))])
    # A gap: the engine now mixes old and new weights, so it refuses to generate until a full refit.
    with pytest.raises(RefitError, match=r"did not cover 26 of 27 parameters"):
        engine.refit([("model.norm.weight", torch.ones(64))])
    with pytest.raises(EngineError, match="no valid weights"):
        engine.generate([[5, 6]], GREEDY)
    engine.refit(checkpoint_tensors(path))
    assert engine.generate([[5, 6]], GREEDY).response_token_ids


def test_partial_refit_updates_only_what_it_is_given(tiny_checkpoints, device):
    path = tiny_checkpoints["llama_mha_untied"]
    engine = NativeEngine.build(path, engine_config(), device=device)
    qkv_before = engine.weights["qkv_w"].clone()
    gate_up_before = engine.weights["gate_up_w"].clone()
    # Host tensors (what the rollout workers receive), copied into the engine's buffers on its device.
    new_k = torch.randn(64, 64)
    new_up = torch.randn(128, 64)
    stats = engine.refit(
        [("model.layers.1.self_attn.k_proj.weight", new_k), ("model.layers.0.mlp.up_proj.weight", new_up)],
        partial=True,
    )
    assert stats.tensors == 2
    new_k, new_up = new_k.to(device), new_up.to(device)  # compared on the engine's device
    qkv, gate_up = engine.weights["qkv_w"], engine.weights["gate_up_w"]
    # k_proj is rows [64, 128) of the fused QKV buffer of layer 1; up_proj rows [128, 256) of gate_up.
    assert torch.equal(qkv[1, 64:128], new_k)
    assert torch.equal(qkv[1, :64], qkv_before[1, :64]) and torch.equal(qkv[1, 128:], qkv_before[1, 128:])
    assert torch.equal(qkv[0], qkv_before[0])
    assert torch.equal(gate_up[0, 128:], new_up) and torch.equal(gate_up[0, :128], gate_up_before[0, :128])
    assert torch.equal(gate_up[1], gate_up_before[1])
