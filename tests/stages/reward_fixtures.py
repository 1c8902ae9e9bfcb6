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


def stall_when_asked(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """0.0 for every completion. With ALIGNFLOW_TEST_STALL_AT=N, call N of this process (iteration N) and
    later ones wait until the file ALIGNFLOW_TEST_RELEASE exists (if set; else 600 s), so a test can look at
    the stage, or kill it, at a known iteration however fast the iterations are. A release path with '{call}'
    in it names one file per call (release-{call}: release-3 lets iteration 3 go on and holds iteration 4)."""
    global _calls_in_this_process
    _calls_in_this_process += 1
    stall_at = int(os.environ.get("ALIGNFLOW_TEST_STALL_AT", "0"))
    if stall_at and _calls_in_this_process >= stall_at:
        release = os.environ.get("ALIGNFLOW_TEST_RELEASE", "").replace("{call}", str(_calls_in_this_process))
        deadline = time.monotonic() + 600
        while not (release and Path(release).exists()) and time.monotonic() < deadline:
            time.sleep(0.05)
    return [0.0 for _ in completions]
