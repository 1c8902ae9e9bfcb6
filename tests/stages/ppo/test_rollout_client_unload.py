"""engine.unload_during_training through the rollout client: what the engine freed (weights and KV cache) is
in the metrics the RL stage logs, the reload is timed, and the next rollout is the one a fresh engine would
generate."""

from __future__ import annotations

import pytest
import torch

from alignflow.stages.common.generation.interface import SamplingParams, UnloadStats, build_engine
from alignflow.stages.ppo.rollout_client import RanksRollouts, RolloutClient, RolloutRequest, heap_bytes
from alignflow.stages.ppo.rollout_workers import _merged
from tests.stages.common.generation.engine_test_models import engine_config, random_prompts, save_tiny_model


def request(prompts: list[list[int]]) -> RolloutRequest:
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, seeds=list(range(len(prompts))))
    return RolloutRequest(1, list(range(len(prompts))), list(range(len(prompts))), prompts, sampling)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("unload") / "m", "llama_mha_untied")


@pytest.mark.parametrize("offload", [True, False], ids=["weights_offloaded", "cpu_default"])
def test_unload_reports_the_weights_and_kv_cache_it_freed(checkpoint, device, offload):
    torch.set_num_threads(1)
    engine = build_engine(checkpoint, engine_config(backend="native"), device=device)
    if device == "cpu":
        engine.offload_weights = offload  # False: a CPU engine's default (its weights stay in host memory)
    elif not offload:
        pytest.skip("a GPU engine always offloads its weights on unload")
    client = RolloutClient(engine, unload_during_training=True)
    prompts = random_prompts(4, seed=2)
    want = client.result(client.submit(request(prompts))).generation
    weights, kv = engine.weights.nbytes(), engine.cache.nbytes()

    freed = client.unload()
    assert freed["perf/engine_freed_weight_bytes"] == (weights if offload else 0)
    assert freed["perf/engine_freed_kv_bytes"] == kv == 2 * 2 * 8 * 4 * 64 * 16 * 4  # 2 layers x (K, V), fp32
    assert freed["timing/engine_unload"] > 0
    if heap_bytes() is not None:  # the allocator sees at least the KV cache go (on a GPU, the weights too)
        assert freed["perf/engine_freed_bytes"] >= kv * 0.9 + (weights * 0.9 if device == "cuda" else 0)
    reloaded = client.reload()
    assert reloaded["timing/engine_reload"] > 0 and "perf/engine_freed_weight_bytes" not in reloaded
    if heap_bytes() is not None:
        assert reloaded["perf/engine_reloaded_bytes"] >= kv * 0.9
    assert (
        client.result(client.submit(request(prompts))).generation.response_token_ids
        == want.response_token_ids
    )


def test_ranks_pass_the_figures_of_rank_0_and_an_engine_without_stats_adds_none():
    class Engine:
        def unload(self, keep_weights=True):
            return UnloadStats(kv_cache_bytes=None, weight_bytes=1024, weights="offloaded")

        def reload(self):
            return None

    main = RanksRollouts(RolloutClient(Engine(), unload_during_training=True), True, share=lambda x: x)
    freed = main.unload()
    assert freed["perf/engine_freed_weight_bytes"] == 1024 and "perf/engine_freed_kv_bytes" not in freed
    assert RanksRollouts(None, False, share=lambda x: x).unload() == {}

    class Old:  # an engine whose unload returns nothing: only the timing and the allocator's figure
        def unload(self, keep_weights=True):
            return None

    assert not {"perf/engine_freed_weight_bytes", "perf/engine_freed_kv_bytes"} & set(
        RolloutClient(Old()).unload()
    )


def test_rollout_workers_sum_the_bytes_of_every_worker_and_keep_the_slowest_time():
    reports = [
        {
            "timing/engine_unload": 0.2,
            "perf/engine_freed_bytes": 10.0,
            "perf/engine_freed_weight_bytes": 100.0,
            "perf/engine_freed_kv_bytes": 7.0,
        },
        {
            "timing/engine_unload": 0.5,
            "perf/engine_freed_bytes": 12.0,
            "perf/engine_freed_weight_bytes": 100.0,
        },
    ]
    assert _merged("unload", reports) == {
        "timing/engine_unload": 0.5,
        "perf/engine_freed_bytes": 22.0,
        "perf/engine_freed_weight_bytes": 200.0,
    }  # no perf/engine_freed_kv_bytes: one worker only knew it, so no sum


@pytest.mark.cpu_only("rollout workers are CPU processes here (tests/stages/ppo/test_rollout_workers.py)")
def test_a_rollout_worker_reports_what_its_engine_freed(checkpoint, tmp_path):
    from alignflow.stages.ppo.rollout_workers import RolloutWorkers

    torch.set_num_threads(1)
    engine = build_engine(checkpoint, engine_config(backend="native"), device="cpu")
    saved = engine.save(tmp_path / "engine")
    with RolloutWorkers(saved, 1, chunk_size=4, threads=1, timeout_s=30, device="cpu") as workers:
        freed = workers.unload()
        # A CPU worker's engine keeps its weights (nothing to gain) and frees its KV cache.
        assert freed["perf/engine_freed_weight_bytes"] == 0
        assert freed["perf/engine_freed_kv_bytes"] == engine.cache.nbytes()
        assert workers.reload()["timing/engine_reload"] > 0
