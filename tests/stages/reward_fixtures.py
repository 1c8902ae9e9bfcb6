"""Reward functions used by the RL stage tests (importable as tests.stages.reward_fixtures:<name>)."""

from __future__ import annotations

import os
from pathlib import Path


def nan_on_second_call(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """0.0 on the first call of a process-independent counter, NaN from the second on."""
    counter = Path(os.environ["ALIGNFLOW_TEST_COUNTER"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    return [float("nan") if calls >= 2 else 0.0 for _ in completions]


def fail_once_on_third_call(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """Raise on the third call (iteration 3) the first time only: an injected crash after a checkpoint."""
    counter = Path(os.environ["ALIGNFLOW_TEST_COUNTER"])
    calls = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(calls))
    if calls == 3:
        raise RuntimeError("injected failure at iteration 3")
    return [0.0 for _ in completions]
