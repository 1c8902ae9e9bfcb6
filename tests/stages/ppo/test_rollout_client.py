"""The rollout client: the same rollouts in line and overlapped, refit once the engine is idle, versions."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from alignflow.stages.common.generation.interface import SamplingParams, build_engine
from alignflow.stages.ppo.rollout_client import RolloutClient, RolloutRequest
from tests.stages.common.generation.engine_test_models import engine_config, random_prompts, save_tiny_model


def request(iteration: int, prompts: list[list[int]]) -> RolloutRequest:
    sampling = SamplingParams(
        temperature=1.0, max_new_tokens=6, seeds=[iteration * 100 + k for k in range(len(prompts))]
    )
    return RolloutRequest(iteration, list(range(len(prompts))), list(range(len(prompts))), prompts, sampling)


def test_overlapped_rollouts_equal_in_line_ones(tmp_path, device):
    torch.set_num_threads(1)
    engine = build_engine(
        save_tiny_model(tmp_path / "m", "llama_mha_untied"), engine_config(backend="native"), device=device
    )
    prompts = random_prompts(4, seed=5)
    inline = RolloutClient(engine)
    overlapped = RolloutClient(engine, overlap=True)
    try:
        a = inline.result(inline.submit(request(1, prompts)))
        b = overlapped.result(overlapped.submit(request(1, prompts)))
    finally:
        overlapped.close()
    assert a.generation.response_token_ids == b.generation.response_token_ids
    assert a.weights_version == b.weights_version == 0
    assert a.seconds > 0 and b.seconds > 0


class SlowEngine:
    """Records the order of generate and refit calls; generate takes 0.2 s."""

    def __init__(self):
        self.events: list[str] = []
        self.lock = threading.Lock()

    def generate(self, prompt_ids, sampling):
        with self.lock:
            self.events.append("generate-start")
        time.sleep(0.2)
        with self.lock:
            self.events.append("generate-end")
        return "generation"

    def refit(self, named_tensors, partial: bool = False):
        with self.lock:
            self.events.append("refit")
        return "report"


def test_refit_waits_for_the_generation_in_flight_and_bumps_the_version():
    engine = SlowEngine()
    client = RolloutClient(engine, overlap=True, weights_version=3)
    try:
        handle = client.submit(request(1, [[5, 6]]))
        with pytest.raises(RuntimeError, match="still being generated"):
            client.submit(request(2, [[5, 6]]))
        assert client.refit([]) == "report"
        assert engine.events == ["generate-start", "generate-end", "refit"]
        rollout = client.result(handle)
        assert rollout.weights_version == 3 and client.weights_version == 4
        assert client.result(client.submit(request(2, [[5, 6]]))).weights_version == 4
    finally:
        client.close()


def test_a_failed_background_generation_surfaces_at_result():
    class Broken(SlowEngine):
        def generate(self, prompt_ids, sampling):
            raise RuntimeError("out of KV cache")

    client = RolloutClient(Broken(), overlap=True)
    try:
        handle = client.submit(request(1, [[5]]))
        with pytest.raises(RuntimeError, match="out of KV cache"):
            client.result(handle)
    finally:
        client.close()
