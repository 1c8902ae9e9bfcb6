"""The summary's start-up sentence: startup/* metrics split into orchestration, process and setup."""

from __future__ import annotations

from alignflow.flows.report import startup_sentence


def test_startup_sentence_splits_the_time_before_the_first_iteration():
    rows = [
        {"key": "sft", "status": "skipped", "metrics": {}},
        {
            "key": "ppo",
            "status": "ok",
            "metrics": {
                "startup/since_run": 7.5,
                "startup/to_first_iteration": 3.0,
                "startup/process": 1.0,
                "startup/stage": 2.0,
            },
        },
    ]
    sentence = startup_sentence(rows)
    assert sentence.startswith("Start-up: ppo's first iteration began 7.5 s in: orchestration 4.5 s")
    assert "process start and imports 1.0 s" in sentence and "stage setup 2.0 s" in sentence


def test_startup_sentence_names_the_earlier_stages_that_ran_apart_from_orchestration():
    """A fresh run: SFT ran for 100 s before PPO started; that is work, not orchestration."""
    rows = [
        {"key": "sft", "status": "ok", "metrics": {}, "duration_s": 95.0, "finished_at_s": 100.0},
        {"key": "reward-rm", "status": "skipped", "metrics": {}, "duration_s": 0.1, "finished_at_s": 4.0},
        {
            "key": "ppo",
            "status": "ok",
            "duration_s": 20.0,
            "finished_at_s": 121.0,
            "metrics": {"startup/since_run": 110.0, "startup/to_first_iteration": 3.0, "startup/stage": 2.0},
        },
    ]
    sentence = startup_sentence(rows)
    assert sentence.startswith(
        "Start-up: ppo's first iteration began 110.0 s in: earlier stages that ran in this "
        "run, done 100.0 s into the flow, orchestration 7.0 s"
    )


def test_startup_sentence_without_the_command_start_or_an_rl_stage():
    only_stage = [{"key": "ppo", "status": "ok", "metrics": {"startup/stage": 2.0}}]
    assert startup_sentence(only_stage) == (
        "Start-up: ppo's first iteration began 2.0 s in: stage setup 2.0 s "
        "(inputs, models, trainer, engine load; see its profile.md)."
    )
    assert startup_sentence([{"key": "sft", "status": "ok", "metrics": {"sft/loss": 1.0}}]) is None
