"""engine.cuda_graph_loop: the in-graph decode loop (graphed_loop.py) generates what the per-step loop does.

Under --device cuda the loop is captured as CUDA graphs; under --device cpu the same static-shape body runs
eagerly (engine._use_graphs set by hand, as test_engine_lifecycle.py's static-path test does), which checks
every buffer and in-graph update: the sampler's step, the outputs' column, finished rows and lengths, the
next token, position and slot, and the masks under sliding windows."""

from __future__ import annotations

import pytest
import torch
from engine_test_models import ARCHITECTURES, engine_config, random_prompts

from alignflow.stages.common.generation import SamplingParams
from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native.weights import checkpoint_tensors

# 20 new tokens: past both test models' sliding windows (6 and 8 slots), so the window's update runs.
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7, ignore_eos=True)
TRUNCATED = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=20, seed=8, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)


def static_engine(path, device, *, loop: bool) -> NativeEngine:
    """An engine on the static-shape (CUDA-graph) decode path, with or without the in-graph loop."""
    engine = NativeEngine.build(path, engine_config(cuda_graphs=True, cuda_graph_loop=loop), device=device)
    engine._use_graphs = True  # on CPU: the static step and loop run eagerly (only the capture needs a GPU)
    return engine


def assert_same_generation(got, want) -> None:
    assert got.response_token_ids == want.response_token_ids
    assert got.logprobs == want.logprobs  # the same step and sampler: the same bits
    assert got.finish_reasons == want.finish_reasons


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_the_in_graph_loop_generates_what_the_per_step_loop_does(tiny_checkpoints, arch, device):
    path = tiny_checkpoints[arch]
    looped = static_engine(path, device, loop=True)
    per_step = static_engine(path, device, loop=False)
    eager = NativeEngine.build(path, engine_config(), device=device)
    for batch, seed, sampling in ((3, 1, SAMPLED), (5, 2, TRUNCATED), (1, 3, GREEDY), (3, 4, SAMPLED)):
        prompts = random_prompts(batch, seed=seed)
        got = looped.generate(prompts, sampling)
        assert_same_generation(got, per_step.generate(prompts, sampling))
        # and the eager (dynamic-shape) loop's tokens: the static step attends over every slot behind its mask
        assert got.response_token_ids == eager.generate(prompts, sampling).response_token_ids
    # one loop per batch bucket and sampling mode (their sampler branches differ), reused across calls
    assert sorted((bucket, flags.all_greedy, flags.any_top_k) for bucket, flags in looped._loops) == [
        (1, True, False), (4, False, False), (8, False, True)
    ]
    assert not per_step._loops


def test_rows_that_end_stop_and_an_all_finished_batch_stops_early(tiny_checkpoints, device):
    path = tiny_checkpoints["qwen2_bias_window"]
    looped = static_engine(path, device, loop=True)
    per_step = static_engine(path, device, loop=False)
    prompts = random_prompts(4, seed=5)
    free = per_step.generate(prompts, SAMPLED)
    # Stop at tokens the free run drew: row 0's 3rd and row 2's 7th token end those rows there (or earlier).
    stops = [free.response_token_ids[0][2], free.response_token_ids[2][6]]
    stopping = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7, ignore_eos=True,
                              stop_token_ids=stops)
    got = looped.generate(prompts, stopping)
    assert_same_generation(got, per_step.generate(prompts, stopping))
    assert len(got.response_token_ids[0]) <= 3 and len(got.response_token_ids[2]) <= 7
    assert "stop" in got.finish_reasons
    # Every row ends at its first token: the loop stops at its next check (every token off a GPU).
    first_tokens = sorted({ids[0] for ids in free.response_token_ids})
    ending = SamplingParams(temperature=1.0, max_new_tokens=20, seed=7, ignore_eos=True,
                            stop_token_ids=first_tokens)
    got = looped.generate(prompts, ending)
    assert_same_generation(got, per_step.generate(prompts, ending))
    assert all(len(ids) == 1 for ids in got.response_token_ids)
    if device == "cpu":
        assert got.metrics["perf/decode_steps"] == 1


def test_the_loop_follows_refits_and_is_captured_again_after_a_reload(tiny_checkpoints, device, tmp_path):
    from engine_test_models import perturbed_checkpoint

    path = tiny_checkpoints["llama_gqa_tied_llama3"]
    looped = static_engine(path, device, loop=True)
    prompts = random_prompts(3, seed=9)
    before = looped.generate(prompts, SAMPLED)
    perturbed = perturbed_checkpoint(path, tmp_path / "p")
    looped.refit(checkpoint_tensors(perturbed))  # in place: the captured loop reads the new weights
    want = static_engine(perturbed, device, loop=False).generate(prompts, SAMPLED)
    assert want.response_token_ids != before.response_token_ids  # the refit has something to show
    assert_same_generation(looped.generate(prompts, SAMPLED), want)
    captured = dict(looped._loops)
    looped.offload_weights = True  # the GPU's unload: weights and cache at new addresses after reload
    looped.unload()
    assert not looped._loops
    looped.reload()
    assert_same_generation(looped.generate(prompts, SAMPLED), want)
    assert looped._loops and all(looped._loops[key] is not captured[key] for key in looped._loops)


def test_return_logits_decodes_per_step(tiny_checkpoints, device):
    looped = static_engine(tiny_checkpoints["llama_mha_untied"], device, loop=True)
    got = looped.generate(random_prompts(2, seed=3), SAMPLED, return_logits=True)
    assert got.logits is not None and not looped._loops
    assert all(torch.isfinite(logits).all() for logits in got.logits)
