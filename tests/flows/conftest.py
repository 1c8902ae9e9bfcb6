"""Fixtures for flow tests: one Prefect test harness per session and a small, fast pipeline config."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from alignflow.config import PipelineConfig, validate_config


@pytest.fixture(scope="session")
def prefect_harness():
    """One ephemeral Prefect API for the whole session (a fresh one costs 10-30 s on 2 cores)."""
    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    with prefect_test_harness(server_startup_timeout=120):
        yield


def small_config(workdir: Path, stages: list[str] | None = None, **sections: Any) -> PipelineConfig:
    """A pipeline small enough for a test: ~0.1M-parameter model, a few hundred examples, one epoch."""
    data: dict[str, Any] = {
        "name": "test",
        "workdir": str(workdir),
        "stages": stages or ["data", "base", "sft", "reward"],
        "tracking": {"experiment": "test"},
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 320,
                           "max_position_embeddings": 128}},
        "data": {"demo": {"n_sft": 160, "n_preferences": 160, "n_prompts": 16, "n_eval_prompts": 8},
                 "eval_fraction": 0.1},
        "sft": {"epochs": 1, "batch_size": 16, "micro_batch_size": 8, "max_length": 64, "eval_every": 5,
                "warmup_steps": 2},
        "reward": {"epochs": 1, "batch_size": 16, "micro_batch_size": 16, "max_length": 64, "eval_every": 5,
                   "warmup_steps": 2},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return validate_config(data)
