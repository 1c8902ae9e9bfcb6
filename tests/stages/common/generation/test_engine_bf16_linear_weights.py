"""engine.cpu_linear_weights=bfloat16: the float32 engine of the bf16-rounded model, each path, refit."""

from __future__ import annotations

import pytest
import torch
from engine_test_models import (
    TOLERANCES,
    engine_config,
    perturbed_checkpoint,
    random_prompts,
    save_tiny_model,
)
from pydantic import ValidationError
from transformers import AutoModelForCausalLM

from alignflow.kernels import skinny_linear
from alignflow.stages.common.generation import SamplingParams
from alignflow.stages.common.generation.native import NativeEngine, prepack
from alignflow.stages.common.generation.native.prepack import current_blocked
from alignflow.stages.common.generation.native.weights import checkpoint_tensors
from alignflow.stages.engine import logit_error, round_linear_weights

pytestmark = pytest.mark.cpu_only("bfloat16 blocked weights are the CPU engine's")

STOPPING = SamplingParams(temperature=1.0, max_new_tokens=20, seed=11, stop_token_ids=list(range(3, 12)))


@pytest.fixture(autouse=True)
def _kernel_builds_here():
    if not skinny_linear.available():
        pytest.skip(f"no skinny_linear here: {skinny_linear.unavailable_reason()}")


def _half(path, loop: bool = True) -> NativeEngine:
    """The float32 engine with bfloat16 blocked weights, on the C++ loop or the torch step."""
    return NativeEngine.build(
        path, engine_config(cpu_decode_loop=loop, cpu_linear_weights="bfloat16"), device="cpu"
    )


def _rounded_checkpoint(source, dest):
    """`source` with every linear weight (the LM head too) rounded to bfloat16, saved in float32."""
    model = AutoModelForCausalLM.from_pretrained(source)
    assert not model.config.tie_word_embeddings  # a tied head cannot be rounded alone in a checkpoint
    round_linear_weights(model)
    model.save_pretrained(dest)
    return dest


def _assert_same_generation(got, want) -> None:
    assert got.response_token_ids == want.response_token_ids
    assert got.finish_reasons == want.finish_reasons
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=TOLERANCES["logprobs_fp32"])


@pytest.mark.parametrize("loop", [True, False], ids=["C++ loop", "torch step"])
@pytest.mark.parametrize("arch", ["llama_mha_untied", "qwen2_bias"])
def test_the_engine_generates_what_the_float32_engine_of_the_rounded_model_does(
    tiny_checkpoints, tmp_path, arch, loop
):
    if arch == "qwen2_bias":  # a nonzero QKV bias, which stays float32; no window, so the loop takes it
        path = save_tiny_model(tmp_path / arch, "qwen2_bias_window", bias_std=0.5, use_sliding_window=False)
    else:
        path = tiny_checkpoints[arch]
    half = _half(path, loop)
    assert (half._decode_loop is not None) == loop and half.linear_weights_dtype == torch.bfloat16
    rounded_path = _rounded_checkpoint(path, tmp_path / "rounded")
    rounded = NativeEngine.build(rounded_path, engine_config(cpu_decode_loop=loop), device="cpu")
    exact = NativeEngine.build(path, engine_config(cpu_decode_loop=loop), device="cpu")
    # 8 prompts: a prefill of more rows than skinny_linear's row limit too
    prompts = _past_the_row_limit()
    got = half.generate(prompts, STOPPING, return_logits=True)
    want = rounded.generate(prompts, STOPPING, return_logits=True)
    _assert_same_generation(got, want)
    worst = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
    assert worst <= TOLERANCES["logits_fp32"]
    # ...and not the unrounded model's: the rounding is there to see in every step's logits.
    unrounded = exact.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4), return_logits=True)
    greedy = half.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4), return_logits=True)
    gap = max((a - b).abs().max().item() for a, b in zip(greedy.logits, unrounded.logits, strict=True))
    assert gap > 10 * TOLERANCES["logits_fp32"]


def _past_the_row_limit() -> list[list[int]]:
    """8 prompts of more tokens in all than the skinny kernel's row limit on this CPU (128 rows on AVX-512,
    256 on AVX2), none over 44 tokens: room for STOPPING's 20 new ones in the test engines' 64-slot cache."""
    return random_prompts(8, seed=3, lengths=(skinny_linear.max_rows() // 8 + 1, 45))


def test_every_blocked_copy_is_bfloat16_shared_with_the_loop_and_follows_a_refit(tiny_checkpoints, tmp_path):
    path = tiny_checkpoints["llama_mha_untied"]
    half = _half(path)
    loop = half._decode_loop
    for (name, layer), blocked in loop._blocked.items():
        assert blocked.dtype == torch.bfloat16 and current_blocked(half.weights[name][layer]) is blocked
    assert loop._lm_head.dtype == torch.bfloat16
    # A prefill of more rows than the kernel takes runs F.linear, on the rounded weights: the first decode
    # step's logits are the rounded model's (the prefill's keys and values too).
    prepack.calls.update(packed=0, fallback=0, plain=0)
    prompts = _past_the_row_limit()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2)
    got = half.generate(prompts, greedy, return_logits=True)
    assert prepack.calls["plain"] > 0 and prepack.calls["fallback"] == 0 and prepack.calls["packed"] > 0
    rounded = NativeEngine.build(_rounded_checkpoint(path, tmp_path / "r"), engine_config(), device="cpu")
    want = rounded.generate(prompts, greedy, return_logits=True)
    worst = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
    assert worst <= TOLERANCES["logits_fp32"]
    prompts = random_prompts(4, seed=7)
    before = half.generate(prompts, STOPPING)
    perturbed = perturbed_checkpoint(path, tmp_path / "p")
    half.refit(checkpoint_tensors(perturbed))
    want = _half(perturbed)
    after = want.generate(prompts, STOPPING)
    assert after.response_token_ids != before.response_token_ids  # the refit has something to show
    _assert_same_generation(half.generate(prompts, STOPPING), after)
    assert half.weights["qkv_w"].dtype == torch.float32  # the source of refit and save stays float32


def test_a_tied_head_is_rounded_alone_and_the_parity_reference_does_the_same(tiny_checkpoints):
    """With tied embeddings the engine rounds the head's blocked copy and keeps the embedding rows float32;
    the engine stage's parity reference (round_linear_weights) unties the head to compute that too."""
    path = tiny_checkpoints["llama_gqa_tied_llama3"]
    half = _half(path)
    prompts = random_prompts(5, seed=2)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    before = logit_error(half, model, prompts, 8)
    embedding = model.get_input_embeddings().weight.detach().clone()
    round_linear_weights(model)
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    assert not torch.equal(model.get_output_embeddings().weight, embedding)
    after = logit_error(half, model, prompts, 8)
    assert after <= TOLERANCES["logits_fp32"] < before


def test_where_bfloat16_blocks_do_not_apply(tiny_checkpoints):
    with pytest.raises(ValidationError, match="cpu_linear_weights=bfloat16 rounds the blocked copies"):
        engine_config(cpu_linear_weights="bfloat16", cpu_prepack=False)
    with pytest.raises(ValidationError, match="cpu_linear_weights=bfloat16 rounds the blocked copies"):
        engine_config(cpu_linear_weights="bfloat16", cpu_kernels=False)
    path = tiny_checkpoints["llama_mha_untied"]
    config = engine_config(cpu_linear_weights="bfloat16")
    bf16 = NativeEngine.build(path, config, dtype="bfloat16", device="cpu")
    assert bf16.linear_weights_dtype == torch.float32  # a bf16 engine's weights are bf16 already
    assert bf16.execution_paths()["cpu_linear_weights"].startswith("bfloat16 not applied")
    half = NativeEngine.build(path, config, device="cpu")
    assert "cpu_linear_weights" not in half.execution_paths()
    assert "bfloat16 blocks up to" in half.execution_paths()["linear"]
