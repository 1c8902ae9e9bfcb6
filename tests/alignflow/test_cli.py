"""The `alignflow` command's run clock: a run publishes its own start to the stages it starts, and only while
it runs."""

from __future__ import annotations

import os

import pytest

from alignflow import cli
from alignflow.contract import RUN_STARTED_AT_VAR


@pytest.mark.parametrize("before", [None, "12.5"])
def test_run_clock_sets_the_start_and_restores_what_was_there(monkeypatch, before):
    if before is None:
        monkeypatch.delenv(RUN_STARTED_AT_VAR, raising=False)
    else:
        monkeypatch.setenv(RUN_STARTED_AT_VAR, before)
    with cli.run_clock(1000.25):
        assert os.environ[RUN_STARTED_AT_VAR] == "1000.250000"
    assert os.environ.get(RUN_STARTED_AT_VAR) == before


def test_run_clock_restores_after_an_error(monkeypatch):
    monkeypatch.delenv(RUN_STARTED_AT_VAR, raising=False)
    with pytest.raises(RuntimeError, match="boom"), cli.run_clock(5.0):
        raise RuntimeError("boom")
    assert RUN_STARTED_AT_VAR not in os.environ


def test_each_run_in_one_process_reports_its_own_start(main, monkeypatch, tmp_path):
    """Two runs in one process: each stage sees its own run's start (an inherited or earlier value is not
    kept, as setdefault kept it), and nothing is left behind."""
    monkeypatch.setenv(RUN_STARTED_AT_VAR, "1.0")  # a parent's, inherited: not this run's
    seen: list[str] = []

    def fake_run(args) -> int:
        seen.append(os.environ[RUN_STARTED_AT_VAR])
        return 0

    monkeypatch.setattr(cli, "_run", fake_run)
    config = str(tmp_path / "config.yaml")
    assert main(["run", config], started_at=100.0) == 0
    assert main(["run", config], started_at=200.0) == 0
    assert seen == ["100.000000", "200.000000"]
    assert os.environ[RUN_STARTED_AT_VAR] == "1.0"


def test_a_run_without_a_start_is_timed_from_main(main, monkeypatch, tmp_path):
    monkeypatch.delenv(RUN_STARTED_AT_VAR, raising=False)
    monkeypatch.setattr(cli.time, "time", lambda: 4242.0)
    seen: list[str] = []
    monkeypatch.setattr(cli, "_run", lambda args: seen.append(os.environ[RUN_STARTED_AT_VAR]) or 0)
    assert main(["run", str(tmp_path / "config.yaml")]) == 0
    assert seen == ["4242.000000"]
    assert RUN_STARTED_AT_VAR not in os.environ


def test_a_bad_config_leaves_no_start_behind(main, monkeypatch, tmp_path, capsys):
    monkeypatch.delenv(RUN_STARTED_AT_VAR, raising=False)
    missing = tmp_path / "missing.yaml"
    assert main(["run", str(missing)]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert RUN_STARTED_AT_VAR not in os.environ
