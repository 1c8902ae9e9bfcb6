"""The MLflow server killed (SIGKILL) while the PPO stage runs its iterations, then started again on the same
port and database.

What must hold: a short outage (MLflow's client retries at their defaults, ~4 min) does not stop the stage,
and a long one (past ALIGNFLOW_TRACKING_OUTAGE_S) stops it with one line and no published output, after which
a re-run resumes. Either way the run the stage's result points at holds every iteration's metrics exactly
once, with the values in the stage's metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from alignflow.contract import StageResult, StageSpec, TrackingSpec, stage_program
from alignflow.manifest import find_published, materialize, output_uri
from tests.conftest import REPO, free_port

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.timeout(1800)]  # 2 loaded cores: minutes each
BIN = Path(sys.executable).parent
ITERATIONS = 16


class MlflowServer:
    """`mlflow server` on a fixed 127.0.0.1 port over one SQLite file,
    that a test can kill and start again."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> float:
        """Start it and wait until it answers; the seconds that took."""
        started = time.time()
        self.starts += 1
        log = open(self.home / f"server-{self.starts}.log", "w")  # noqa: SIM115 - the server process writes it
        self.proc = subprocess.Popen(
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--workers",
                "1",
                "--backend-store-uri",
                f"sqlite:///{self.home / 'mlflow.db'}",
                "--artifacts-destination",
                str(self.home / "artifacts"),
                "--serve-artifacts",
            ],
            cwd=self.home,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        while time.time() - started < 300:
            if self.proc.poll() is not None:
                raise AssertionError(f"mlflow server exited {self.proc.returncode}; see {log.name}")
            try:
                import urllib.request

                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:  # noqa: S310 - loopback
                    if response.status == 200:
                        return time.time() - started
            except OSError:
                pass
            time.sleep(0.5)
        raise AssertionError("mlflow server did not answer in 300 s")

    def kill(self) -> None:
        """SIGKILL the server's whole process group (uvicorn and its worker):
        no chance to finish a request."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture
def mlflow_server(tmp_path):
    server = MlflowServer(tmp_path)
    server.start()
    yield server
    server.kill()


class Stage:
    """The stage process, its stderr read line by line as it comes (to time the faults on its progress)."""

    def __init__(self, spec: StageSpec, workdir: Path, env: dict[str, str]):
        path = spec.dump(workdir / f"spec-{spec.output_uri.rsplit('/', 1)[1]}.json")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", stage_program(spec.stage), "--spec", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=workdir,
            env={**os.environ, "PYTHONPATH": str(REPO), **env},
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(
            target=lambda: self.lines.extend(iter(self.proc.stderr.readline, "")), daemon=True
        )
        self._reader.start()

    def iterations(self) -> int:
        done = [
            int(m.group(1)) for line in list(self.lines) if (m := re.match(r"ppo: iteration (\d+)/", line))
        ]
        return max(done, default=0)

    def wait_for(self, what: str, predicate, timeout_s: float = 600) -> None:
        deadline = time.time() + timeout_s
        while not predicate():
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"the stage exited {self.proc.returncode} before {what}:\n{self.stderr()[-3000:]}"
                )
            if time.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.stderr()[-3000:]}")
            time.sleep(0.05)

    def finish(self, timeout_s: float = 900) -> tuple[int, StageResult]:
        # Not communicate(): it reads stderr too, and took the last lines (the error line of a stage that says
        # nothing before it fails) from the reader thread.
        stdout: list[str] = []
        reader = threading.Thread(target=lambda: stdout.append(self.proc.stdout.read()), daemon=True)
        reader.start()
        self.proc.wait(timeout=timeout_s)
        reader.join(timeout=10)
        self._reader.join(timeout=10)
        return self.proc.returncode, StageResult.from_output("".join(stdout))

    def stderr(self) -> str:
        return "".join(self.lines)


def ppo_spec(clean, server: MlflowServer, name: str) -> tuple[Path, StageSpec]:
    """The clean run's PPO spec, with more iterations (time for an outage inside the loop),
    logging to `server`."""
    workdir, _, specs = clean
    spec = specs["ppo"]
    config = {**spec.config, "ppo": {**spec.config["ppo"], "iterations": ITERATIONS, "checkpoint_every": 2}}
    return workdir, spec.model_copy(
        update={
            "config": config,
            "tracking": TrackingSpec(uri=server.url, experiment=f"tracking-faults-{name}"),
            "output_uri": output_uri(f"file://{workdir}/tracking-faults", "ppo", {"test": name}, {}, "t"),
        }
    )


def assert_every_step_once(server: MlflowServer, run_id: str, folder: Path) -> None:
    """Each iteration's metrics in the run exactly once, equal to the stage's own metrics.jsonl."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(server.url)
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == list(range(1, ITERATIONS + 1))
    for key in ("rollout/score_mean", "losses/policy_loss", "timing/iteration"):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert [step for step, _ in history] == list(range(1, ITERATIONS + 1)), (
            f"{key}: a step lost or doubled"
        )
        assert [value for _, value in history] == pytest.approx([row[key] for row in rows], rel=1e-6), key
    assert client.get_run(run_id).info.status == "FINISHED"


def test_a_server_outage_mid_ppo_is_waited_out_and_every_step_is_in_the_run_once(clean, mlflow_server):
    """MLflow's client at its defaults: the sender's call waits in the client's retries, the loop goes on
    queueing (the outage covers >= 3 iterations), and once the server is back everything arrives, nothing
    twice."""
    workdir, spec = ppo_spec(clean, mlflow_server, "short")
    stage = Stage(spec, workdir, {})
    stage.wait_for("iteration 2", lambda: stage.iterations() >= 2)
    mlflow_server.kill()
    down_at = stage.iterations()
    stage.wait_for("3 iterations with the server down", lambda: stage.iterations() >= down_at + 3)
    mlflow_server.start()
    code, result = stage.finish()
    assert code == 0, stage.stderr()[-3000:]
    assert result.status == "ok" and "error:" not in stage.stderr()
    folder, _ = materialize(spec.output_uri, workdir / "cache")
    assert_every_step_once(mlflow_server, result.mlflow_run_id, folder)


def test_an_outage_past_the_limit_stops_the_stage_in_one_line_and_the_rerun_resumes(
    clean, mlflow_server, tmp_path
):
    """The client's own retries off and a 3 s limit: the stage stops with one line and publishes nothing; with
    the server back, the re-run resumes from the last checkpoint into a new run that has every step once and
    supersedes the stopped one.

    The outage is placed, not raced: a reward function (weight 0) holds each iteration from the 3rd in its
    scoring until the test releases it. The server dies while iteration 3 is held; iteration 3 then ends and
    its metrics fail to send while iteration 4 is held past the limit; iteration 4's metrics find the sender
    given up."""
    from mlflow.tracking import MlflowClient

    from alignflow import tracking

    workdir, spec = ppo_spec(clean, mlflow_server, "long")
    spec = spec.model_copy(
        update={
            "config": {
                **spec.config,
                "ppo": {
                    **spec.config["ppo"],
                    "reward_functions": ["tests.stages.reward_fixtures:stall_when_asked"],
                    "reward_function_weights": [0.0],
                },
            }
        }
    )
    release = tmp_path / "release-{call}"
    stage = Stage(
        spec,
        workdir,
        {
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
            tracking.OUTAGE_VAR: "3",
            "ALIGNFLOW_TEST_STALL_AT": "3",
            "ALIGNFLOW_TEST_RELEASE": str(release),
        },
    )
    stage.wait_for("iteration 2", lambda: stage.iterations() >= 2)  # iteration 3 is held in its scoring
    mlflow_server.kill()
    Path(str(release).format(call=3)).touch()  # iteration 3 ends and logs; iteration 4 is held
    stage.wait_for(
        "the sender's first failure", lambda: "MLflow unreachable while logging run" in stage.stderr()
    )
    # the limit and a margin, with the stage held: its next log call finds the sender given up
    time.sleep(3 + 2)
    Path(str(release).format(call=4)).touch()
    code, result = stage.finish()
    assert code == 1, stage.stderr()[-3000:]
    errors = [line for line in stage.lines if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stage.stderr(), stage.stderr()[-3000:]
    assert re.match(
        r"error: ppo: MLflow unreachable for \d+ s \(limit 3 s, ALIGNFLOW_TRACKING_OUTAGE_S\) while "
        r"logging run \w+: .*re-run",
        errors[0],
    ), errors[0]
    assert result.status == "failed" and result.message == errors[0].removeprefix("error: ppo: ").strip()
    assert find_published(spec.output_uri) is None, "published although its metrics were not all in MLflow"
    stopped_run = re.search(r"logging run (\w+)", errors[0]).group(1)

    mlflow_server.start()
    rerun = Stage(spec, workdir, {})
    code, result = rerun.finish()
    assert code == 0 and result.status == "ok", rerun.stderr()[-3000:]
    folder, _ = materialize(spec.output_uri, workdir / "cache")
    assert_every_step_once(mlflow_server, result.mlflow_run_id, folder)
    client = MlflowClient(mlflow_server.url)
    new = client.get_run(result.mlflow_run_id)
    assert int(new.data.tags["alignflow.resumed_at_iteration"]) >= 1, "the re-run resumed from a checkpoint"
    old = client.get_run(stopped_run)
    assert old.info.status == "KILLED" and old.data.tags[tracking.SUPERSEDED_BY_TAG] == result.mlflow_run_id


def test_a_server_down_when_the_stage_starts_stops_it_in_one_line_after_about_a_minute(clean, monkeypatch):
    """Nothing listens at the tracking URI when the stage starts. MLflow's client retries opening the run at
    this project's default (5 retries: 0 + 4 + 8 + 16 + 32 s of backoff; MLflow's own 7 take ~4 min), then the
    stage exits 1 with one line naming the server and the fix, without a traceback, and publishes nothing."""
    from alignflow import tracking

    # the default, not whatever this process was given
    monkeypatch.delenv(tracking.RETRIES_VAR, raising=False)
    url = f"http://127.0.0.1:{free_port()}"
    workdir, spec = ppo_spec(clean, type("NoServer", (), {"url": url})(), "down-at-start")
    started = time.time()
    stage = Stage(spec, workdir, {})
    code, result = stage.finish()
    elapsed = time.time() - started
    assert code == 1, stage.stderr()[-3000:]
    errors = [line for line in stage.lines if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stage.stderr(), stage.stderr()[-3000:]
    assert re.match(
        rf"error: ppo: MLflow tracking server {url} unreachable while opening the ppo stage's run \(.*"
        rf"after 5 retries, {tracking.RETRIES_VAR}\); start the server \(or fix tracking.uri\), then "
        "re-run",
        errors[0],
    ), errors[0]
    assert result.status == "failed" and find_published(spec.output_uri) is None
    # 60 s of backoff plus the stage's start (imports, model load: tens of seconds on a loaded machine);
    # MLflow's default: 244 s
    assert 60 <= elapsed < 180, f"{elapsed:.0f} s"


def test_a_server_lost_at_publish_time_fails_the_call_in_one_line_after_about_a_minute(
    mlflow_server, monkeypatch
):
    """The server dies between a stage's metrics and the output's tags at publish time (StageRun's synchronous
    calls, as StageContext.publish_output makes them): the call fails after ~1 min with one line, and leaving
    the run does not wait again (it is not ended FAILED: the re-run's attempt supersedes it)."""
    from alignflow import tracking
    from alignflow.contract import TrackingUnavailableError

    monkeypatch.delenv(tracking.RETRIES_VAR, raising=False)
    with pytest.raises(TrackingUnavailableError) as raised:
        with tracking.stage_run(
            mlflow_server.url, "publish-faults", "sft", None, attempt_of="file:///x/sft/1"
        ) as run:
            run.log_metrics({"perf/total_s": 1.0})  # the server answers
            mlflow_server.kill()
            started = time.time()
            run.set_tags({"alignflow.output_uri": "file:///x/sft/1"})
    elapsed = time.time() - started
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"MLflow tracking server {mlflow_server.url} unreachable while setting tags (run {run.run_id}) ("
    ), message
    assert f"after 5 retries, {tracking.RETRIES_VAR}); start the server" in message, message
    assert 60 <= elapsed < 120, f"{elapsed:.0f} s: MLflow's default 7 retries take ~244 s"
