"""flows/stage_forks.py with stages/common/fork_server.py: stages forked from a kept process with the ML stack
imported give a cold launch's result; launches it must not serve start their own process."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from alignflow.flows import launch
from alignflow.flows.kept_server import KEEP_VAR, alive
from alignflow.flows.launch import WarmStages, launch_local, stage_env
from alignflow.flows.stage_forks import StageForks, import_time_env, private_folder
from tests.flows.test_launch import data_spec

pytestmark = pytest.mark.skipif(private_folder() is None, reason="no private temporary folder for the socket")


def _wait_gone(pid: int, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


@pytest.fixture
def forks(tmp_path, monkeypatch):
    """WarmStages that fork from a fork server kept 2 s after the test lets go of it."""
    monkeypatch.setenv(KEEP_VAR, "2")
    monkeypatch.setattr(launch, "WARM", WarmStages())
    launch.WARM.start(tmp_path)
    stage_forks = launch.WARM._forks
    assert stage_forks is not None and launch.WARM._spare is None  # no warm process as well
    yield stage_forks
    launch.WARM.close()
    state = stage_forks.kept.read_state()
    if state is not None and not _wait_gone(state["pid"]):
        stage_forks.kept.stop()


def test_forked_launches_publish_a_cold_launchs_output_and_the_server_exits_once_unused(tmp_path, forks):
    cold_dir = tmp_path / "cold"
    cold_dir.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "WARM", WarmStages())  # nothing started: a cold process
        cold, cold_code = launch_local(data_spec(cold_dir), "data", cold_dir, echo=False)
    results = []
    for attempt in ("first", "second"):  # two launches, two forks of one server
        store = tmp_path / "store" / attempt
        spec = data_spec(tmp_path).model_copy(update={"output_uri": str(store)})
        results.append((launch_local(spec, "data", tmp_path, echo=False), store))
    state = forks.kept.read_state()
    assert state is not None and state["workdir"] == str(tmp_path.resolve()) and alive(state["pid"])
    assert forks.process is not None and forks.process.pid == state["pid"]  # started by this run, once
    for (result, code), store in results:
        assert code == cold_code == 0 and result.status == cold.status == "ok"
        assert result.metrics == cold.metrics
        for name in ("sft_train.jsonl", "preferences_train.jsonl", "prompts.jsonl", "eval_prompts.jsonl"):
            assert (store / name).read_bytes() == (cold_dir / "store" / "data" / name).read_bytes()
    launch.WARM.close()  # the run lets go: the server exits after its 2 s, withdrawing its state and socket
    assert _wait_gone(state["pid"])
    assert forks.kept.read_state() is None and not Path(state["socket"]).exists()


def test_a_forked_stage_gives_a_cold_ones_exit_code_and_error(tmp_path, forks):
    missing = str(tmp_path / "missing.json")
    forked = forks.fork(tmp_path, "data", ["--spec", missing], stage_env())
    assert forked is not None
    with forked:
        output = forked.stdout.read()
        assert forked.wait() == 2
    assert f"spec '{missing}' not found" in output and '"status":"failed"' in output


def test_another_folder_or_import_time_variable_is_not_forked(tmp_path, forks, monkeypatch):
    assert forks.fork(tmp_path / "elsewhere", "data", [], stage_env()) is None
    assert forks.fork(tmp_path, "data", [], {**stage_env(), "OMP_NUM_THREADS": "1"}) is None
    # Read at run time, or set by the shell per command: the same server.
    assert import_time_env({**stage_env(), "MLFLOW_TRACKING_URI": "x", "_": "/bin/env", "SHLVL": "3"}) == (
        import_time_env(stage_env())
    )


def test_a_stage_whose_launcher_went_away_is_stopped(tmp_path, forks):
    fifo = tmp_path / "spec.fifo"
    os.mkfifo(fifo)  # the stage blocks opening its spec until a writer comes: only a signal ends it
    forked = forks.fork(tmp_path, "data", ["--spec", str(fifo)], stage_env())
    assert forked is not None
    time.sleep(1)
    assert alive(forked.pid)
    forked.__exit__(None, None, None)  # the launcher's ends close, as when the CLI is killed
    assert _wait_gone(forked.pid, 10)


def test_runs_that_keep_nothing_get_the_warm_stage_process(tmp_path, monkeypatch):
    monkeypatch.setenv(KEEP_VAR, "0")
    warm_stages = WarmStages()
    warm_stages.start(tmp_path)
    try:
        assert warm_stages._forks is None and warm_stages._spare is not None
        assert warm_stages.fork(tmp_path, "data", [], stage_env()) is None
    finally:
        warm_stages.close()


def test_the_servers_environment_lacks_the_runs_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "canary-secret")
    monkeypatch.setenv(KEEP_VAR, "1")
    stage_forks = StageForks(tmp_path, stage_env(), 1.0, private_folder())
    try:
        assert stage_forks.process is not None
        environ = Path(f"/proc/{stage_forks.process.pid}/environ").read_bytes()
        assert b"canary-secret" not in environ and b"PATH=" in environ
    finally:
        stage_forks.close()
        stage_forks.process.kill()
        stage_forks.process.wait()
