"""Stage runs in MLflow: metrics queued for the background sender all arrive, failures surface, an unreachable
server is waited out without losing or doubling a step, and a new attempt at an output supersedes the
unfinished runs of earlier ones."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import requests
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.tracking import MlflowClient

from alignflow import tracking
from alignflow.contract import TrackingUnavailableError
from tests.conftest import free_port

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
            def broken(*args, **kwargs):  # a 4xx: the caller's fault, raised at once, not waited out
                raise MlflowException("run is not active: store down", error_code=INVALID_PARAMETER_VALUE)

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


def _refused() -> None:
    """What MLflow's REST client raises once its own retries against a stopped server are spent."""
    try:
        raise requests.exceptions.ConnectionError(
            "HTTPConnectionPool(host='127.0.0.1', port=5000): Max retries exceeded (Connection refused)"
        )
    except requests.exceptions.ConnectionError as exc:
        raise MlflowException(
            f"API request to http://127.0.0.1:5000/api/2.0/mlflow/runs/log-batch failed with exception {exc}"
        ) from None


class Outage:
    """A real store's log_batch behind a server that is down for calls `first`..`last` (1-based); call `cut`
    is stored and then its reply lost, as when the server dies between its commit and its answer."""

    def __init__(self, log_batch, first: int, last: int, cut: int):
        self._log_batch, self.first, self.last, self.cut, self.calls = log_batch, first, last, cut, 0

    def __call__(self, run_id, metrics=(), **kwargs):
        self.calls += 1
        if self.first <= self.calls <= self.last:
            _refused()
        self._log_batch(run_id, metrics=metrics, **kwargs)
        if self.calls == self.cut:
            _refused()


def test_an_unreachable_server_is_waited_out_with_every_step_once(store, monkeypatch, capsys):
    monkeypatch.setattr(tracking, "_RETRY_FIRST_S", 0.01)
    with tracking.stage_run(store, "t", "ppo", None) as run:
        outage = Outage(run._client.log_batch, first=2, last=6, cut=8)
        monkeypatch.setattr(run._client, "log_batch", outage)
        for step in range(1, 41):
            run.log_metrics_async({"rollout/score_mean": step / 10, "timing/iteration": 0.5}, step)
            if step % 5 == 0:
                # spreads the steps over several calls, so the outage and the cut reply fall in the loop
                run.flush()
    client = MlflowClient(store)
    assert client.get_run(run.run_id).info.status == "FINISHED"
    for key, value in (
        ("rollout/score_mean", lambda step: step / 10),
        ("timing/iteration", lambda step: 0.5),
    ):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.run_id, key))
        assert history == [(step, value(step)) for step in range(1, 41)], key
    assert outage.calls > outage.cut, "the outage and the lost reply happened"
    err = capsys.readouterr().err
    assert "MLflow unreachable while logging run" in err and "MLflow reachable again after" in err


def test_an_outage_past_the_limit_is_one_line_and_the_rerun_supersedes_the_run(store, monkeypatch):
    monkeypatch.setattr(tracking, "_RETRY_FIRST_S", 0.01)
    monkeypatch.setenv(tracking.OUTAGE_VAR, "0.2")
    with pytest.raises(TrackingUnavailableError) as raised:
        with tracking.stage_run(store, "t", "ppo", None, attempt_of=OUTPUT) as run:
            monkeypatch.setattr(
                run._client, "log_batch", Outage(run._client.log_batch, first=1, last=10**9, cut=0)
            )
            run.log_metrics_async({"a": 1.0}, 1)
            run.flush()
    message = str(raised.value)
    assert "\n" not in message and "MLflow unreachable for" in message and tracking.OUTAGE_VAR in message
    assert "re-run" in message
    monkeypatch.undo()
    client = MlflowClient(store)
    assert client.get_run(run.run_id).info.status == "RUNNING", "not ended: the server was down"
    with tracking.stage_run(store, "t", "ppo", None, attempt_of=OUTPUT) as rerun:
        pass
    assert client.get_run(run.run_id).info.status == "KILLED"
    assert client.get_run(run.run_id).data.tags[tracking.SUPERSEDED_BY_TAG] == rerun.run_id


def test_the_outage_limit_is_read_from_the_environment(monkeypatch):
    monkeypatch.setenv(tracking.OUTAGE_VAR, "60")
    assert tracking.outage_limit_s() == 60.0
    monkeypatch.setenv(tracking.OUTAGE_VAR, "ten")
    with pytest.raises(ValueError, match="ALIGNFLOW_TRACKING_OUTAGE_S='ten' is not a number of seconds"):
        tracking.outage_limit_s()
    monkeypatch.delenv(tracking.OUTAGE_VAR)
    assert tracking.outage_limit_s() == 900.0


def test_a_server_that_is_down_when_the_stage_starts_is_one_line_naming_it(monkeypatch):
    """Nothing listens on the port: opening the stage's run fails at once (retries off here; the default's
    ~1 min is timed in tests/faults/test_tracking_outage.py) with one line that names the server and the
    fix."""
    monkeypatch.setenv(tracking.RETRIES_VAR, "0")
    uri = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TrackingUnavailableError) as raised:
        with tracking.stage_run(uri, "t", "sft", None):
            raise AssertionError("the run opened without a server")
    message = str(raised.value)
    assert "\n" not in message, message
    assert message.startswith(
        f"MLflow tracking server {uri} unreachable while opening the sft stage's run ("
    ), message
    assert (
        f"after 0 retries, {tracking.RETRIES_VAR}); start the server (or fix tracking.uri), then re-run"
        in message
    )


def test_a_server_lost_at_publish_time_is_one_line_and_leaves_the_run_running(store, monkeypatch):
    """A synchronous call at publish time (the output's tags) to a server that stopped answering: one line,
    and the run is not ended FAILED (that call would wait out the same retries); the re-run's attempt
    supersedes it."""
    with pytest.raises(
        TrackingUnavailableError,
        match=r"unreachable while setting tags \(run \w+\) \(MlflowException: API request",
    ):
        with tracking.stage_run(store, "t", "sft", None, attempt_of=OUTPUT) as run:
            run._uri = "http://127.0.0.1:5000"
            monkeypatch.setattr(run._client, "set_tag", lambda *args, **kwargs: _refused())
            run.set_tags({"alignflow.output_uri": OUTPUT})
    monkeypatch.undo()
    assert MlflowClient(store).get_run(run.run_id).info.status == "RUNNING"


def test_a_local_store_error_is_not_called_an_unreachable_server(store, monkeypatch):
    """With a local store an OSError is the disk's (full, read-only): raised as it is,
    not as a server outage."""
    with tracking.stage_run(store, "t", "sft", None) as run:

        def disk_full(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(run._client, "log_artifact", disk_full)
        with pytest.raises(OSError, match="No space left on device"):
            run.log_artifact(Path("profile.md"), "reports")


def test_mlflow_retries_default_to_about_a_minute_and_a_user_value_is_kept(store, monkeypatch):
    monkeypatch.delenv(tracking.RETRIES_VAR, raising=False)
    tracking.start_parent_run(store, "t", "p", {}, {})
    # backoff 0 + 4 + 8 + 16 + 32 s: ~1 min (tracking.RETRIES_VAR)
    assert os.environ[tracking.RETRIES_VAR] == "5"
    monkeypatch.setenv(tracking.RETRIES_VAR, "2")
    tracking.start_parent_run(store, "t", "p", {}, {})
    assert os.environ[tracking.RETRIES_VAR] == "2"
