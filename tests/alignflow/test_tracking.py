"""Stage runs in MLflow: metrics queued for the background sender all arrive, failures surface, and a new attempt at
an output supersedes the unfinished runs of earlier ones."""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient

from alignflow import tracking

OUTPUT = "file:///work/artifacts/ppo/0123456789abcdef"


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_queued_metrics_are_all_in_the_store_when_the_run_ends(store):
    with tracking.stage_run(store, "t", "ppo", None) as run:
        for step in range(1, 201):
            run.log_metrics_async({"rollout/score_mean": step / 10, "timing/iteration": 0.5}, step)
        run.log_history([{"iteration": 201.0, "rollout/score_mean": 20.1}])
    client = MlflowClient(store)
    assert client.get_run(run.run_id).info.status == "FINISHED"
    history = sorted((m.step, m.value) for m in client.get_metric_history(run.run_id, "rollout/score_mean"))
    assert history == [(step, step / 10) for step in range(1, 202)]
    assert "iteration" not in client.get_run(run.run_id).data.metrics


def test_a_failed_send_is_raised_and_the_run_ends_failed(store, monkeypatch):
    with pytest.raises(RuntimeError, match="logging metrics to MLflow run .* failed: .*store down"):
        with tracking.stage_run(store, "t", "ppo", None) as run:
            def broken(*args, **kwargs):
                raise OSError("store down")

            monkeypatch.setattr(run._client, "log_batch", broken)
            run.log_metrics_async({"a": 1.0}, 1)
    monkeypatch.undo()
    assert MlflowClient(store).get_run(run.run_id).info.status == "FAILED"


def test_a_new_attempt_supersedes_the_unfinished_runs_of_earlier_ones(store):
    client = MlflowClient(store)
    experiment = client.create_experiment("t")
    key = tracking.attempt_key(OUTPUT)
    killed = client.create_run(experiment, run_name="ppo", tags={tracking.ATTEMPT_KEY_TAG: key}).info.run_id
    crashed = client.create_run(experiment, run_name="ppo", tags={tracking.ATTEMPT_KEY_TAG: key}).info.run_id
    client.set_terminated(crashed, "FAILED")
    other = client.create_run(experiment, run_name="ppo",
                              tags={tracking.ATTEMPT_KEY_TAG: tracking.attempt_key(OUTPUT + "0")}).info.run_id
    with tracking.stage_run(store, "t", "ppo", None, attempt_of=OUTPUT) as run:
        pass
    assert client.get_run(killed).info.status == "KILLED"  # its process died without ending it
    assert client.get_run(crashed).info.status == "FAILED"
    for old in (killed, crashed):
        assert client.get_run(old).data.tags[tracking.SUPERSEDED_BY_TAG] == run.run_id
        assert client.get_run(old).info.run_name == "ppo (superseded)"
    assert set(client.get_run(run.run_id).data.tags["alignflow.supersedes"].split(",")) == {killed, crashed}
    assert client.get_run(other).info.status == "RUNNING", "another output's run is left alone"
    assert tracking.SUPERSEDED_BY_TAG not in client.get_run(other).data.tags
