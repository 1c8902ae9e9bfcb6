"""Reward functions used by the RL stage tests (importable as tests.stages.reward_fixtures:<name>)."""

from __future__ import annotations

import os
import time
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


_calls_in_this_process = 0


def stall_from_third_call_when_asked(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """0.0 for every completion; with ALIGNFLOW_TEST_STALL set, sleeps from the third call (iteration 3) on, so a
    test can kill the stage after its iteration-2 checkpoint however fast the iterations are."""
    global _calls_in_this_process
    _calls_in_this_process += 1
    if os.environ.get("ALIGNFLOW_TEST_STALL") and _calls_in_this_process >= 3:
        time.sleep(600)
    return [0.0 for _ in completions]
