"""Orchestration faults on a real Prefect server and process worker on 127.0.0.1, running a deployed pipeline
(data -> base -> sft).

- The worker killed mid-pipeline (SIGKILL of the worker and everything under it: the flow-run process and the
  running stage, as when its machine dies). The zombie automation `alignflow deploy` sets up (flows/deploy.py)
  marks the run Crashed once its heartbeats stop (30 s apart here, so 90 s). Then `prefect flow-run retry`
  runs it again on a new worker: the finished stages are reused, the killed one runs again, nothing is
  published twice.
- The Prefect server restarted (SIGKILL, then started again on its port and database) while a stage runs.
- The running stage's process SIGKILLed inside a flow run: the flow's own task retry runs it again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from alignflow.config import StorageConfig
from alignflow.manifest import read_manifest
from alignflow.storage import normalize_root
from tests.conftest import free_port, small_config
from tests.faults.published import manifests_under, unlisted_objects, verify_all
from tests.flows.test_production import _deploy, _healthy, _http, _wait, _wait_run

pytestmark = [pytest.mark.slow, pytest.mark.faults, pytest.mark.timeout(1800)]  # 2 loaded cores: minutes each
BIN = Path(sys.executable).parent
STAGES = ["data", "base", "sft"]


class PrefectStack:
    """A Prefect server (SQLite under `home`, fixed port: it can be killed and started again) and process
    workers on the pipeline's pool."""

    def __init__(self, home: Path):
        self.home, self.port = home, free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_API_HOST": "127.0.0.1",
                    "PREFECT_SERVER_API_PORT": str(self.port), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_LOGGING_LEVEL": "WARNING", "PREFECT_API_URL": self.api,
                    "PREFECT_WORKER_QUERY_SECONDS": "2"}
        self.server: subprocess.Popen | None = None
        self.worker: subprocess.Popen | None = None
        self._logs = 0

    def _log(self, name: str):
        self._logs += 1
        return open(self.home / f"{name}-{self._logs}.log", "w")  # noqa: SIM115 - the child process writes it

    def start_server(self) -> float:
        started = time.time()
        env = {k: v for k, v in self.env.items() if k != "PREFECT_API_URL"}
        self.server = subprocess.Popen(
            [str(BIN / "prefect"), "server", "start"],
            env=env,
            cwd=self.home,
            stdout=self._log("server"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        _wait(lambda: _healthy(f"{self.api}/health"), 300, "the Prefect server")
        return time.time() - started

    def start_worker(self) -> None:
        self.worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", "alignflow-process"],
            env=self.env,
            cwd=self.home,
            stdout=self._log("worker"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill_worker_tree(self) -> list[str]:
        """SIGKILL the worker and every process under it at once; the command lines killed."""
        root = psutil.Process(self.worker.pid)
        procs = [root, *root.children(recursive=True)]
        for proc in procs:
            proc.suspend()  # nobody reacts to a sibling's death before all are gone
        killed = [" ".join(proc.cmdline()[:4]) for proc in procs]
        for proc in procs:
            proc.send_signal(signal.SIGKILL)
        psutil.wait_procs(procs, timeout=30)
        self.worker.wait()
        return killed

    def kill_server(self) -> None:
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.wait()

    def close(self) -> None:
        for proc in (self.worker, self.server):
            if proc is not None and proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.worker = self.server = None


@pytest.fixture
def prefect(tmp_path):
    stack = PrefectStack(tmp_path / "prefect")
    stack.home.mkdir()
    try:
        stack.start_server()
        subprocess.run(
            [str(BIN / "prefect"), "work-pool", "create", "alignflow-process", "--type", "process"],
            env=stack.env,
            check=True,
            capture_output=True,
            timeout=300,
        )
        stack.start_worker()
        yield stack
    finally:
        stack.close()


def deployed_run(
    prefect: PrefectStack, tmp_path: Path, name: str, stage_retries: int = 0
) -> tuple[dict, str, StorageConfig]:
    """Deploy the data -> base -> sft pipeline and start a run of it; (config, flow run id, storage)."""
    config = small_config(
        tmp_path / "work",
        stages=STAGES,
        sft={"epochs": 6},
        deployment={"name": name, "stage_retries": stage_retries, "retry_delay_s": 2},
    ).model_dump(mode="json")
    ids = _deploy(config, tmp_path / "pipeline.yaml", prefect.env)
    run = _http(
        "POST",
        f"{prefect.api}/deployments/{ids[f'alignflow-pipeline/{name}']}/create_flow_run",
        {"parameters": {"config": config}},
    )
    return config, run["id"], StorageConfig.model_validate(config["storage"])


def storage_root(config: dict) -> str:
    return normalize_root(config["storage"]["root"], config["workdir"])


def published_by_stage(root: str, storage: StorageConfig) -> dict[str, list[str]]:
    """The top-level outputs under `root` by stage (a checkpoint inside an output is not one)."""
    outputs: dict[str, list[str]] = {}
    for uri in manifests_under(root, storage):
        manifest = read_manifest(uri, storage)
        if not any(uri.startswith(other + "/") for other in manifests_under(root, storage) if other != uri):
            outputs.setdefault(manifest.stage, []).append(uri)
    return outputs


def command(proc: psutil.Process) -> str:
    """Its command line; "" for one that exited meanwhile (a zombie until its parent reaps it)."""
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


def stage_running(work: Path, stage: str) -> bool:
    """The flow has launched `stage` (its spec is written just before its process starts)."""
    return any((work / ".alignflow" / "specs").glob(f"{stage}-*.json"))


def test_worker_killed_mid_pipeline_then_retried_reuses_finished_stages(prefect, tmp_path):
    from alignflow.flows.deploy import ZOMBIE_AUTOMATION

    # Heartbeats every 30 s (Prefect's minimum; 180 s by default) for the deploy (the automation's 3 x 30 s)
    # and the worker's flow runs: the fixture's worker, which has not run anything yet, is replaced by one
    # that has them.
    prefect.env["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] = "30"
    prefect.kill_worker_tree()
    prefect.start_worker()
    config, run_id, storage = deployed_run(prefect, tmp_path, "worker-kill")
    work, root = tmp_path / "work", storage_root(config)
    _wait(lambda: stage_running(work, "sft"), 900, "the flow to start SFT", 0.2)
    before = published_by_stage(root, storage)
    assert sorted(before) == ["base", "data"], before
    digests = {stage: read_manifest(uris[0], storage).digest for stage, uris in before.items()}
    time.sleep(3)  # inside SFT's process start-up or training (it runs ~20 s here)
    killed = prefect.kill_worker_tree()
    assert any("alignflow.stages" in line for line in killed), killed
    killed_at = time.time()
    prefect.start_worker()
    # The automation, and nothing else, marks the run Crashed: 90 s without a heartbeat, plus the triggers
    # service's evaluation and the load (the new worker polls every 2 s and does not touch another worker's
    # run).
    crashed = _wait(
        lambda: (r := _http("GET", f"{prefect.api}/flow_runs/{run_id}"))["state_type"] != "RUNNING" and r,
        420,
        "the zombie automation to mark the run Crashed",
        2,
    )
    marked_after = time.time() - killed_at
    assert crashed["state_type"] == "CRASHED", crashed["state"]
    assert "no heartbeat for 90 s" in (crashed["state"]["message"] or ""), crashed["state"]
    assert 60 <= marked_after <= 420, f"{marked_after:.0f} s after the kill"
    automation = _http(
        "POST", f"{prefect.api}/automations/filter", {"automations": {"name": {"any_": [ZOMBIE_AUTOMATION]}}}
    )
    assert len(automation) == 1, automation
    print(f"zombie run marked Crashed {marked_after:.0f} s after the worker was killed")
    assert "sft" not in published_by_stage(root, storage)

    # The retry a user runs:
    retry = subprocess.run(
        [str(BIN / "prefect"), "flow-run", "retry", run_id],
        env=prefect.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert retry.returncode == 0, retry.stdout + retry.stderr
    final = _wait_run(prefect.api, run_id, 900)
    assert final["state_type"] == "COMPLETED", final["state"]
    assert final["run_count"] >= 2

    after = published_by_stage(root, storage)
    assert {stage: len(uris) for stage, uris in after.items()} == {"data": 1, "base": 1, "sft": 1}, after
    assert {stage: read_manifest(after[stage][0], storage).digest for stage in digests} == digests, (
        "a finished stage was run again"
    )
    verify_all(root, storage)
    assert unlisted_objects(root, storage) == [], "leftovers of the killed attempt, or files published twice"
    rows = _stage_rows(work)
    assert [rows[s]["status"] for s in STAGES] == ["skipped", "skipped", "ok"], rows


def _stage_rows(work: Path) -> dict[str, dict]:
    """The last pipeline run's stage table, from MLflow: its stage runs, reused or not."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("test")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time DESC"])
    parent = next(r for r in runs if r.data.tags.get("alignflow.kind") == "pipeline")
    rows = {}
    for run in runs:
        if run.data.tags.get("mlflow.parentRunId") == parent.info.run_id:
            cached = run.data.tags.get("alignflow.cached") == "true"
            rows[run.data.tags["alignflow.stage"]] = {
                "status": "skipped" if cached else "ok",
                "run": run.info.status,
            }
    return rows


def test_prefect_server_restarted_mid_run_the_run_completes(prefect, tmp_path):
    config, run_id, storage = deployed_run(prefect, tmp_path, "server-restart")
    work, root = tmp_path / "work", storage_root(config)
    _wait(lambda: stage_running(work, "sft"), 900, "the flow to start SFT", 0.2)
    prefect.kill_server()
    down = time.time()
    time.sleep(5)
    restart_s = prefect.start_server()
    print(f"Prefect server down {time.time() - down:.0f} s (its start {restart_s:.0f} s)")
    final = _wait_run(prefect.api, run_id, 900)
    assert final["state_type"] == "COMPLETED", final["state"]
    after = published_by_stage(root, storage)
    assert {stage: len(uris) for stage, uris in after.items()} == {"data": 1, "base": 1, "sft": 1}, after
    verify_all(root, storage)
    assert unlisted_objects(root, storage) == []


def test_stage_process_killed_inside_a_flow_run_is_retried_by_the_flow(prefect, tmp_path):
    """SIGKILL of the SFT stage process while the deployed flow runs it: the flow's task retry (stage_retries
    1) launches it again, the flow run completes, SFT is published once and whole."""
    # a worker whose flow runs launch cold stage processes, so the SFT process is the one named so
    prefect.close()
    prefect.env["ALIGNFLOW_WARM_STAGES"] = "0"
    prefect.start_server()
    prefect.start_worker()
    config, run_id, storage = deployed_run(prefect, tmp_path, "stage-kill", stage_retries=1)
    root = storage_root(config)

    def sft_process():
        procs = psutil.Process(prefect.worker.pid).children(recursive=True)
        return next((p for p in procs if "alignflow.stages.sft" in command(p)), None)

    sft = _wait(sft_process, 900, "the SFT stage process", 0.2)
    time.sleep(3)  # inside its start-up or training (it runs ~20 s here)
    sft.send_signal(signal.SIGKILL)
    final = _wait_run(prefect.api, run_id, 900)
    assert final["state_type"] == "COMPLETED", final["state"]
    tasks = _http("POST", f"{prefect.api}/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    assert {t["name"]: t["run_count"] for t in tasks}["sft"] == 2, "the flow retried the killed stage once"
    after = published_by_stage(root, storage)
    assert {stage: len(uris) for stage, uris in after.items()} == {"data": 1, "base": 1, "sft": 1}, after
    verify_all(root, storage)
    assert unlisted_objects(root, storage) == []
