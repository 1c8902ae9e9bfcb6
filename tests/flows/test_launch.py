"""launch_local through a warm stage process: a cold `python -m` launch's result, and cold when it must be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from alignflow.contract import StageSpec
from alignflow.flows.launch import WarmStages, launch_local, stage_env
from alignflow.stages.common import warm


def data_spec(workdir: Path) -> StageSpec:
    """The data stage on a small demo set: seconds of work, a real manifest out."""
    config = {
        "data": {
            "demo": {"n_sft": 40, "n_preferences": 40, "n_prompts": 8, "n_eval_prompts": 4},
            "eval_fraction": 0.1,
        }
    }
    return StageSpec(
        stage="data", config=config, output_uri=str(workdir / "store" / "data"), workdir=str(workdir)
    )


def test_warm_launch_publishes_the_same_output_as_a_cold_launch(tmp_path, monkeypatch):
    import alignflow.flows.launch as launch

    cold_dir, warm_dir = tmp_path / "cold", tmp_path / "warm"
    for folder in (cold_dir, warm_dir):
        folder.mkdir()
    monkeypatch.setattr(launch, "WARM", WarmStages())
    cold, cold_code = launch_local(data_spec(cold_dir), "data", cold_dir, echo=False)

    launch.WARM.start(warm_dir)
    spare = launch.WARM._spare[0]
    warm_result, warm_code = launch_local(data_spec(warm_dir), "data", warm_dir, echo=False)

    assert launch.WARM._spare is None and spare.returncode == 0  # the spare process ran the stage
    assert cold_code == warm_code == 0 and cold.status == warm_result.status == "ok"
    assert warm_result.metrics == cold.metrics
    for name in ("sft_train.jsonl", "preferences_train.jsonl", "prompts.jsonl", "eval_prompts.jsonl"):
        assert (warm_dir / "store" / "data" / name).read_bytes() == (
            cold_dir / "store" / "data" / name
        ).read_bytes()


def test_warm_process_is_not_taken_for_another_folder_or_an_import_time_variable(tmp_path, monkeypatch):
    warm_stages = WarmStages()
    warm_stages.start(tmp_path)
    spare = warm_stages._spare[0]
    assert warm_stages.take(tmp_path / "elsewhere", stage_env()) is None
    assert spare.returncode is not None  # dismissed, not left running
    assert warm_stages._spare is None

    warm_stages.start(tmp_path)
    spare = warm_stages._spare[0]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read at torch's import: the spare one imported without it
    assert warm_stages.take(tmp_path, stage_env()) is None
    assert spare.returncode is not None

    monkeypatch.setenv("ALIGNFLOW_WARM_STAGES", "0")
    warm_stages.start(tmp_path)
    assert warm_stages._spare is None
    warm_stages.close()


def test_warm_process_is_given_the_variables_read_at_run_time(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_PROFILE", "gone-later")
    warm_stages = WarmStages()
    warm_stages.start(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///x.db")  # the flow sets it after the spawn
    monkeypatch.delenv("AWS_PROFILE")
    taken = warm_stages.take(tmp_path, stage_env())
    assert taken is not None
    proc, changes = taken
    assert changes == {"MLFLOW_TRACKING_URI": "sqlite:///x.db", "AWS_PROFILE": None}
    proc.kill()
    proc.wait()
    proc.stdin.close()
    proc.stdout.close()


def test_warm_process_applies_the_environment_changes_before_the_stage_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_PROFILE", "before")
    seen = {}

    def fake_main(argv):
        seen.update(
            argv=argv,
            uri=os.environ.get("MLFLOW_TRACKING_URI"),
            profile=os.environ.get("AWS_PROFILE"),
            launched=os.environ.get("ALIGNFLOW_LAUNCHED_AT"),
        )
        return 0

    monkeypatch.setattr("alignflow.stages.data.stage.main", fake_main)
    request = {
        "stage": "data",
        "argv": ["--spec", "s.json"],
        "env": {
            "MLFLOW_TRACKING_URI": "sqlite:///y.db",
            "AWS_PROFILE": None,
            "ALIGNFLOW_LAUNCHED_AT": "12.5",
        },
    }
    assert warm.run_request(json.dumps(request)) == 0
    assert seen == {
        "argv": ["--spec", "s.json"],
        "uri": "sqlite:///y.db",
        "profile": None,
        "launched": "12.5",
    }
    for name in ("MLFLOW_TRACKING_URI", "ALIGNFLOW_LAUNCHED_AT"):
        os.environ.pop(name, None)


def test_warm_process_reports_bad_requests_with_exit_code_2(capsys):
    assert warm.run_request("not json") == 2
    assert "bad request" in capsys.readouterr().err
    assert warm.run_request(json.dumps({"stage": "nope", "argv": []})) == 2
    err = capsys.readouterr().err
    assert "unknown stage 'nope'" in err and "ppo" in err


def test_warm_process_gives_the_stage_exit_code_and_error_like_a_cold_one(tmp_path):
    missing = str(tmp_path / "missing.json")
    env = {**os.environ, "ALIGNFLOW_WARM_STAGES": "0"}
    cold = subprocess.run(
        [sys.executable, "-m", "alignflow.stages.data", "--spec", missing],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    warm_run = subprocess.run(
        [sys.executable, "-m", "alignflow.stages.common.warm"],
        capture_output=True,
        text=True,
        env=env,
        input=json.dumps({"stage": "data", "argv": ["--spec", missing]}) + "\n",
        timeout=300,
    )
    assert cold.returncode == warm_run.returncode == 2
    assert f"spec '{missing}' not found" in warm_run.stderr
    cold_result, warm_result = (json.loads(run.stdout.strip().splitlines()[-1]) for run in (cold, warm_run))
    assert cold_result["status"] == warm_result["status"] == "failed"
    assert warm_result["message"] == cold_result["message"]
