"""The bottleneck advice: chosen by the phase's name, narrowed to the knobs the run's facts leave open."""

from __future__ import annotations

import pytest

from alignflow.stages.common.bottleneck_advice import GENERIC_ADVICE, RunFacts, advice_for

# A one-rank CPU GRPO run as the RL ladder's: plain torch trainer, fp32 on a CPU without bf16 arithmetic, one
# minibatch an epoch and one engine call an iteration, the native engine.
CPU_RUN = RunFacts(train_device="cpu", train_dtype="float32", bf16_arithmetic=False, zero_stage=0,
                   minibatches=1, engine_backend="native", generate_device="cpu", cuda_graphs=True,
                   generate_calls=1)
MINIBATCHES, LOWER_ZERO = "larger minibatches", "a lower ZeRO stage"


def test_advice_is_chosen_by_keyword_in_order():
    assert advice_for("refit").startswith("refit should copy weights in place")  # not the "ref" rule
    assert advice_for("ref_logprobs").startswith("run these no-grad forward passes")
    assert advice_for("write_rollouts").startswith("I/O:")  # I/O is checked before generation
    assert advice_for("rollout").startswith("try the native engine")
    assert advice_for("Generate").startswith("try the native engine")
    assert advice_for("critic_update").startswith("try larger minibatches")
    assert advice_for("score").startswith("score in larger batches")
    assert advice_for("mystery") == GENERIC_ADVICE


def test_unknown_facts_keep_every_suggestion():
    assert advice_for("train") == (
        "try larger minibatches (fewer optimizer steps), a lower ZeRO stage (less gather/scatter traffic) "
        "or bf16"
    )
    assert advice_for("train", RunFacts()) == advice_for("train")
    assert advice_for("generate") == (
        "try the native engine, larger rollout batches (engine.max_batch_size) or CUDA graphs on GPU"
    )


@pytest.mark.parametrize(
    ("change", "offered", "withheld"),
    [
        # bf16 only where the device computes in it and the run is not in it already
        (dict(bf16_arithmetic=True), ["try bf16"], [MINIBATCHES, LOWER_ZERO]),
        (dict(bf16_arithmetic=True, train_dtype="bfloat16"), [], ["bf16", MINIBATCHES, LOWER_ZERO]),
        # larger minibatches only where an epoch has more than one, saying how many
        (dict(minibatches=4), ["larger minibatches (fewer optimizer steps; 4 an epoch now)"],
         [LOWER_ZERO, "bf16"]),
        # a lower ZeRO stage only from ZeRO-2, whose gathers and scatters are the traffic
        (dict(zero_stage=1), [], [LOWER_ZERO]),
        (dict(zero_stage=3), [LOWER_ZERO], [MINIBATCHES]),
    ],
)
def test_training_advice_offers_only_the_open_knobs(change, offered, withheld):
    advice = advice_for("train", RunFacts(**{**vars(CPU_RUN), **change}))
    for text in offered:
        assert text in advice
    for text in withheld:
        assert text not in advice.replace("without bf16 arithmetic", "")
    if not offered:
        assert advice.startswith("the usual knobs are in place (") and advice.endswith(GENERIC_ADVICE)


def test_a_run_with_every_training_knob_in_place_says_so():
    assert advice_for("actor_update", CPU_RUN) == (
        "the usual knobs are in place (one minibatch an epoch, no ZeRO sharding, float32 on a cpu "
        f"without bf16 arithmetic): {GENERIC_ADVICE}"
    )


@pytest.mark.parametrize(
    ("change", "advice"),
    [
        (dict(engine_backend="hf"), "try the native engine"),
        (dict(generate_calls=3),
         "try larger rollout batches (engine.max_batch_size; 3 engine calls an iteration now)"),
        (dict(generate_device="cuda", cuda_graphs=False), "try CUDA graphs (engine.cuda_graphs)"),
        # vLLM and TensorRT-LLM capture their own graphs: engine.cuda_graphs is the native engine's
        (dict(generate_device="cuda", cuda_graphs=False, engine_backend="vllm"), "the vllm engine already"),
        ({}, "the native engine already takes every rollout in one call"),
    ],
)
def test_generation_advice_offers_only_the_open_knobs(change, advice):
    assert advice_for("generate", RunFacts(**{**vars(CPU_RUN), **change})).startswith(advice)
