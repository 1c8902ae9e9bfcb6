"""The run summary's start-up sentence: the RL stage's startup/* metrics split into orchestration, process and setup."""

from __future__ import annotations

from alignflow.flows.report import startup_sentence


def test_startup_sentence_splits_the_time_before_the_first_iteration():
    rows = [{"key": "sft", "status": "skipped", "metrics": {}},
            {"key": "ppo", "status": "ok", "metrics": {"startup/since_run": 7.5, "startup/to_first_iteration": 3.0,
                                                       "startup/process": 1.0, "startup/stage": 2.0}}]
    sentence = startup_sentence(rows)
    assert sentence.startswith("Start-up: ppo's first iteration began 7.5 s in: orchestration 4.5 s")
    assert "process start and imports 1.0 s" in sentence and "stage setup 2.0 s" in sentence


def test_startup_sentence_without_the_command_start_or_an_rl_stage():
    only_stage = [{"key": "ppo", "status": "ok", "metrics": {"startup/stage": 2.0}}]
    assert startup_sentence(only_stage) == ("Start-up: ppo's first iteration began 2.0 s in: stage setup 2.0 s "
                                            "(inputs, models, trainer, engine load; see its profile.md).")
    assert startup_sentence([{"key": "sft", "status": "ok", "metrics": {"sft/loss": 1.0}}]) is None
