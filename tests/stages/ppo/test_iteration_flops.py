"""The RL iteration's model FLOPs per phase: against torch's count of a real model doing the least each phase
needs, one token at a time; and the rates and MFU made of them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import DynamicCache, GPT2Config, LlamaConfig, LlamaForCausalLM

from alignflow.stages.ppo.iteration_flops import (
    IterationModels,
    IterationShape,
    generate_flops,
    iteration_metrics,
    pass_flops,
    phase_flops,
    score_flops,
    spec_of,
    train_peak_tflops,
)

# Two distinct prompts (indices 7 and 2), the first drawn for two rows (a GRPO group); responses of 3, 1, 4.
PROMPTS = {7: [5, 9, 11, 4], 2: [8, 3]}
ROWS = [(7, [20, 21, 22]), (7, [30]), (2, [40, 41, 42, 43])]
SHAPE = IterationShape.of([i for i, _ in ROWS], [PROMPTS[i] for i, _ in ROWS], [len(r) for _, r in ROWS])


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, attn_implementation="eager",
    )).eval()


def counted(model, feed_last: bool, head: str) -> int:
    """What torch counts when `model` runs one token at a time with a KV cache: each distinct prompt once,
    then every row's response (all of it, or but its last token) from a copy of its prompt's cache. head: the
    LM head on each distinct prompt's last position and each fed token ('generate'), on the position before
    each response token ('logprobs'), or nowhere ('none')."""
    def step(token: int, cache: DynamicCache) -> torch.Tensor:
        return model.model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True).last_hidden_state

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        caches, last = {}, {}
        for index, prompt in PROMPTS.items():
            caches[index] = DynamicCache()
            for token in prompt:
                last[index] = step(token, caches[index])
            if head == "generate":
                model.lm_head(last[index])
        for index, response in ROWS:
            cache = copy.deepcopy(caches[index])
            if head == "logprobs":
                model.lm_head(last[index])
            for token in response if feed_last else response[:-1]:
                hidden = step(token, cache)
                if head != "none":
                    model.lm_head(hidden)
    return counter.get_total_flops()


def test_the_iteration_shape_keeps_each_distinct_prompt_once():
    assert SHAPE.prompt_lengths == [4, 2]
    assert SHAPE.completions == [(4, 3), (4, 1), (2, 4)]
    assert SHAPE.fed_spans() == [(4, 6), (2, 5)]  # the one-token response feeds nothing
    assert SHAPE.response_tokens == 8


def test_generation_prefills_each_prompt_once_and_feeds_every_token_but_the_last(model):
    assert generate_flops(spec_of(model.config), SHAPE) == counted(model, feed_last=False, head="generate")


def test_a_log_prob_pass_reads_the_head_before_every_response_token(model):
    spec = spec_of(model.config)
    assert pass_flops(spec, SHAPE) == counted(model, feed_last=False, head="logprobs")
    assert pass_flops(spec, SHAPE, lm_head=False) == counted(model, feed_last=False, head="none")


def test_a_reward_model_reads_every_completion_whole(model):
    assert score_flops(spec_of(model.config), SHAPE) == counted(model, feed_last=True, head="none")


def test_phases_add_up_the_models_they_run(model):
    actor = spec_of(model.config)
    critic = spec_of(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2, vocab_size=100))
    ppo = IterationModels(actor, critic, [critic, critic], has_critic=True)
    ran = {"generate", "score", "reference", "train"}
    flops = phase_flops(ppo, SHAPE, epochs=4, ran=ran)
    assert set(flops) == {"flops/generate", "flops/score", "flops/reference", "flops/train"}
    assert flops["flops/score"] == 2 * score_flops(critic, SHAPE)
    assert flops["flops/reference"] == pass_flops(actor, SHAPE)
    step = 3 * pass_flops(actor, SHAPE) + 3 * pass_flops(critic, SHAPE, lm_head=False)
    assert flops["flops/train"] == 4 * step
    # Stale old log-probs: their forward and every epoch again, inside the train phase.
    again = phase_flops(ppo, SHAPE, epochs=4, ran={"train"}, trained_twice=True)
    assert again["flops/train"] == 8 * step + pass_flops(actor, SHAPE)
    # GRPO: no critic, no reward model; recomputed old log-probs are a pass of their own.
    grpo = phase_flops(IterationModels(actor, None, [], has_critic=False), SHAPE, 1, {"generate", "train",
                                                                                        "old_logprobs"})
    assert grpo["flops/train"] == 3 * pass_flops(actor, SHAPE)
    assert grpo["flops/old_logprobs"] == pass_flops(actor, SHAPE)


def test_a_model_outside_the_llama_family_leaves_its_phases_uncounted(model):
    assert spec_of(GPT2Config()) is None
    actor = spec_of(model.config)
    flops = phase_flops(IterationModels(actor, None, [actor, None], has_critic=True), SHAPE, 1,
                        {"generate", "score", "values", "train"})
    # The critic and one reward model could not be counted: values, score and train are left out, not guessed.
    assert set(flops) == {"flops/generate"}


def test_rates_take_generation_over_the_engines_time_and_mfu_needs_a_peak(model):
    actor = spec_of(model.config)
    models = IterationModels(actor, None, [], has_critic=False)
    timings = {"timing/generate": 0.001, "timing/generate_engine": 0.5, "timing/train": 0.25}
    out = iteration_metrics(models, SHAPE, 1, {"generate", "train"}, timings, 1.0, train_peak=None)
    assert out["perf/tflops/generate"] == pytest.approx(out["flops/generate"] / 0.5 / 1e12)
    assert out["perf/tflops/train"] == pytest.approx(out["flops/train"] / 0.25 / 1e12)
    assert out["perf/tflops/iteration"] == pytest.approx((out["flops/generate"] + out["flops/train"]) / 1e12)
    assert "perf/mfu/train" not in out
    with_peak = iteration_metrics(models, SHAPE, 1, {"generate", "train"}, timings, 1.0, train_peak=2e-6,
                                  ranks=2)
    assert with_peak["perf/mfu/train"] == pytest.approx(out["perf/tflops/train"] / 4e-6)


def test_a_cpu_has_no_data_sheet_peak():
    assert train_peak_tflops(torch.device("cpu"), torch.float32) is None
