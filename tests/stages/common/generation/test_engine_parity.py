"""The native engine agrees with transformers: logits at every position, greedy tokens, sampled log-probs.

The engine runs on the session's device (--device); the transformers reference runs on the CPU in fp32, the
yardstick every engine path is held to on either device."""

from __future__ import annotations

import pytest
import torch
from engine_test_models import ARCHITECTURES, EOS_ID, TOLERANCES, engine_config, random_prompts

from alignflow.stages.common.generation import SamplingParams, build_engine
from alignflow.stages.common.generation.native import NativeEngine

NEW_TOKENS = 24  # longer than both sliding windows (6, 8) and past llama3's original length (16)


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").eval()


def hf_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers generate on the left-padded batch, cut after the first EOS (EOS kept)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                             eos_token_id=EOS_ID, pad_token_id=0)
    rows = []
    for row in out[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t == EOS_ID), len(row))
        rows.append(row[:end])
    return rows


def hf_logits(model, sequence: list[int]) -> torch.Tensor:
    """Logits [len, V] of one unpadded sequence: the reference every engine path is held to."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([sequence])).logits[0].float()


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_tokens_and_logits_match_hf(tiny_checkpoints, arch, batch, device):
    path = tiny_checkpoints[arch]
    model = hf_model(path)
    engine = NativeEngine.build(path, engine_config(), device=device)
    prompts = random_prompts(batch, seed=batch)

    gen = engine.generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS), return_logits=True
    )

    assert gen.response_token_ids == hf_greedy(model, prompts, NEW_TOKENS)
    worst_decode = worst_prefill = 0.0
    full_sequences = [p + r for p, r in zip(prompts, gen.response_token_ids, strict=True)]
    prefill_logits = engine.forward_logits(full_sequences)
    for prompt, decode_logits, sequence, all_logits in zip(
        prompts, gen.logits, full_sequences, prefill_logits, strict=True
    ):
        reference = hf_logits(model, sequence)
        # Logits that predicted each response token: positions len(prompt)-1 ... len(sequence)-2.
        at_responses = reference[len(prompt) - 1 : len(sequence) - 1]
        assert decode_logits.shape == at_responses.shape
        worst_decode = max(worst_decode, (decode_logits - at_responses).abs().max().item())
        worst_prefill = max(worst_prefill, (all_logits - reference).abs().max().item())
    assert worst_decode <= TOLERANCES["logits_fp32"], (
        f"decode-path logits differ from hf by {worst_decode:.2e}"
    )
    assert worst_prefill <= TOLERANCES["logits_fp32"], f"prefill logits differ from hf by {worst_prefill:.2e}"


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_sampled_logprobs_match_hf_forward(tiny_checkpoints, arch, batch, device):
    path = tiny_checkpoints[arch]
    model = hf_model(path)
    engine = NativeEngine.build(path, engine_config(), device=device)
    prompts = random_prompts(batch, seed=10 + batch)
    for sampling in (
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=NEW_TOKENS, seed=1),
        SamplingParams(temperature=1.3, max_new_tokens=NEW_TOKENS, seed=2),
        SamplingParams(temperature=0.0, max_new_tokens=8),  # greedy: log-probs at temperature 1
    ):
        gen = engine.generate(prompts, sampling)
        temperature = sampling.temperature or 1.0
        worst = 0.0
        for prompt, response, logprobs in zip(prompts, gen.response_token_ids, gen.logprobs, strict=True):
            assert len(logprobs) == len(response) >= 1
            logits = hf_logits(model, prompt + response)[len(prompt) - 1 : len(prompt) + len(response) - 1]
            # Full-vocabulary distribution at the sampling temperature, not the top-k/top-p renormalised one.
            want = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(response)[:, None])[
                :, 0
            ]
            worst = max(worst, (torch.tensor(logprobs) - want).abs().max().item())
        assert worst <= TOLERANCES["logprobs_fp32"], f"{sampling}: log-probs differ from hf by {worst:.2e}"


@pytest.mark.parametrize("arch", ["llama_gqa_tied_llama3", "qwen2_bias_window"])
def test_hf_backend_agrees_with_native(tiny_checkpoints, arch, device):
    """Both backends share the sampler, so the same seeds give the same tokens (greedy and sampled)."""
    path = tiny_checkpoints[arch]
    native = build_engine(path, engine_config(backend="native"), device=device)
    hf = build_engine(path, engine_config(backend="hf"), device=device)
    prompts = random_prompts(5, seed=3)
    for sampling in (
        SamplingParams(temperature=0.0, max_new_tokens=16),
        SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=16, seeds=[5, 6, 7, 8, 9]),
    ):
        a, b = native.generate(prompts, sampling), hf.generate(prompts, sampling)
        assert a.response_token_ids == b.response_token_ids
        assert a.finish_reasons == b.finish_reasons
        worst = max(
            abs(x - y)
            for ra, rb in zip(a.logprobs, b.logprobs, strict=True)
            for x, y in zip(ra, rb, strict=True)
        )
        assert worst <= TOLERANCES["logprobs_fp32"]


def test_parity_models_exercise_what_they_claim(tiny_checkpoints):
    """Guard the test matrix: each variant really has the feature it is there to test."""
    from transformers import AutoConfig

    from alignflow.stages.common.generation.native.spec import spec_from_hf_config

    specs = {n: spec_from_hf_config(AutoConfig.from_pretrained(p), 64) for n, p in tiny_checkpoints.items()}
    assert specs["llama_mha_untied"].num_kv_heads == specs["llama_mha_untied"].num_heads
    assert not specs["llama_mha_untied"].tie_word_embeddings
    assert (
        specs["llama_gqa_tied_llama3"].tie_word_embeddings
        and specs["llama_gqa_tied_llama3"].rope_type == "llama3"
    )
    assert specs["qwen2_bias_window"].qkv_bias and specs["qwen2_bias_window"].sliding_windows == (None, 6)
    assert specs["mistral_linear_window"].rope_type == "linear"
    assert specs["mistral_linear_window"].sliding_windows == (8, 8)
    assert specs["mistral_linear_window"].head_dim * 4 != 64  # head_dim not hidden / heads
    assert specs["llama_bias_yarn"].o_bias and specs["llama_bias_yarn"].rope_type == "yarn"
