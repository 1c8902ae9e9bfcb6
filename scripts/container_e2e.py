"""`make container-e2e`, once container_e2e.sh built the images: the pipeline, every stage in its container.

Starts on 127.0.0.1 a moto S3 server, an MLflow server with proxied artifacts on it, a Prefect server,
`podman system service` (the Docker API) and a Prefect docker worker on a pool created from
infra/work-pools/docker.json; `alignflow deploy`s configs/tiny.yaml with the pipeline flow in the worker
image and every stage (`deployment.stage_infra`) in the training or native-engine image on that pool;
triggers a run and checks: each stage ran in its own container (image, id, exit code, seconds from
`podman ps -a`), the run completed, every manifest verifies, MLflow has the parent and a nested run per
stage, no credential in any container's environment, logs or MLflow params; a re-trigger skips every
stage without a stage container; a stage container that fails (evaluate without S3 credentials)
fails the flow run with the stage's one-line reason, and a retry of that run after the fix resumes.
Prints the stage-to-container table; everything lands in --build-dir (report.json, logs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
STAGES = ("data", "base", "sft", "reward", "engine", "ppo", "evaluate")
ENGINE_STAGES = ("engine", "ppo", "evaluate")  # the native-engine image; the others the training image
POOL = "alignflow-docker-e2e"
BUCKET = "e2e"
# Dummy credentials of the local S3 server: the checks look for these values everywhere they must not be.
ACCESS_KEY, SECRET_KEY = "e2e-access-key-id", "e2e-secret-access-key-0123456789"


def log(message: str) -> None:
    print(f"[container-e2e] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: Any = None, attempts: int = 5) -> Any:
    """One REST call; 503/429 (a busy SQLite behind the Prefect server) are retried with backoff."""
    data = json.dumps(body).encode() if body is not None else None
    for attempt in range(attempts):
        request = urllib.request.Request(
            url, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - loopback only
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code not in (429, 503) or attempt == attempts - 1:
                raise
            time.sleep(2**attempt)
    raise AssertionError("unreachable")


def wait(predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise SystemExit(f"error: timed out after {timeout_s:.0f} s waiting for {what}")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310
            return response.status == 200
    except OSError:
        return False


class Services:
    """The processes this driver starts; each in its own session, stopped (by pid) in reverse order."""

    def __init__(self, build: Path):
        self.build = build
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.Popen:
        out = open(self.build / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.procs.append((name, proc))
        return proc

    def stop(self) -> None:
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def podman(*args: str) -> str:
    return subprocess.run(["podman", *args], check=True, capture_output=True, text=True).stdout


def pool_template(aws_dir: Path, s3: str, mlflow: str, shm: str) -> dict:
    """infra/work-pools/docker.json with this site's defaults: host network (the services listen on
    127.0.0.1), the credentials file mounted read-only, ulimits this host's hard limits allow, local
    images."""
    template = json.loads((ROOT / "infra" / "work-pools" / "docker.json").read_text())
    props = template["variables"]["properties"]
    props["networks"]["default"] = []
    props["network_mode"]["default"] = "host"
    props["volumes"]["default"] = [f"{aws_dir}:/run/alignflow/aws:ro"]
    # PREFECT_HOME: the worker passes its own settings on, and the host's PREFECT_HOME is no path in the
    # image.
    props["env"]["default"] = {
        **props["env"]["default"],
        "MLFLOW_TRACKING_URI": mlflow,
        "AWS_ENDPOINT_URL_S3": s3,
        "PREFECT_HOME": "/home/alignflow/.prefect",
    }
    props["shm_size"]["default"] = shm
    # memlock -1 and a 64 MiB stack exceed this host's hard limits (runc: "error setting rlimit");
    # any ulimit in the request replaces podman's containers.conf defaults, so restate them.
    props["ulimits"]["default"] = [
        {"name": "nofile", "soft": 1024, "hard": 1024},
        {"name": "nproc", "soft": 4096, "hard": 4096},
    ]
    props["image_pull_policy"]["default"] = "Never"  # local images only: no registry to pull from
    props["auto_remove"]["default"] = False  # kept for `podman ps -a` (exit code, times); removed at the end
    return template


def pipeline_config(tag: str, s3: str, mlflow: str) -> dict:
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    config.update(name="container-e2e", workdir="/workspace")
    config["storage"] = {"root": f"s3://{BUCKET}/runs", "endpoint_url": s3}
    config["tracking"] = {"uri": mlflow, "experiment": "container-e2e"}
    # Registry off: the first run's promotion makes its policy the champion, so a second run's evaluate
    # gets a champion input, a new output, and runs again (by design); the re-run check wants every stage
    # reused.
    config["registry"] = {"enabled": False}
    training, engine = f"localhost/alignflow-training:{tag}", f"localhost/alignflow-engine-native:{tag}"
    config["deployment"] = {
        "name": "e2e",
        "work_pool": POOL,
        "work_pool_type": "docker",
        "image": f"localhost/alignflow-worker:{tag}",
        "stage_retries": 0,  # the injected failure must fail the run at once, not after backoff
        "stage_infra": {
            s: {"work_pool": POOL, "image": engine if s in ENGINE_STAGES else training, "gpus": 0}
            for s in STAGES
        },
    }
    return config


def containers() -> list[dict]:
    """Every container the docker worker made (`podman ps -a`), with its inspect data."""
    ids = podman("ps", "-a", "--filter", "label=io.prefect.flow-run-id", "--format", "{{.ID}}").split()
    return json.loads(podman("inspect", *ids)) if ids else []


def exited(flow_run_id: str, timeout_s: float = 120.0) -> None:
    """Wait until no container the docker worker made is still running (after a run's final state)."""
    deadline = time.monotonic() + timeout_s
    while any(i["State"]["Status"] != "exited" for i in containers()):
        if time.monotonic() > deadline:
            raise AssertionError(
                f"containers still running {timeout_s:.0f} s after flow run {flow_run_id} ended"
            )
        time.sleep(2)


def seconds(info: dict) -> float:
    def parse(stamp: str) -> datetime:
        head, _, frac = stamp.partition(".")
        tail = frac.lstrip("0123456789")
        return datetime.fromisoformat(f"{head}.{frac[:6].ljust(6, '0')}{tail}" if frac else stamp)

    state = info["State"]
    if state["Status"] != "exited":
        return float("nan")  # the pipeline's own container is still running while it is listed
    return (parse(state["FinishedAt"]) - parse(state["StartedAt"])).total_seconds()


def stage_of(info: dict) -> str:
    deployment = info["Config"]["Labels"].get("io.prefect.deployment-name", "")
    return deployment.removeprefix("e2e-") if deployment.startswith("e2e-") else "pipeline"


def trigger(api: str, deployment_id: str, timeout_s: float) -> dict:
    run = http("POST", f"{api}/deployments/{deployment_id}/create_flow_run", {})
    return finish(api, run["id"], timeout_s)


def finish(api: str, run_id: str, timeout_s: float) -> dict:
    final = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
    return wait(
        lambda: (r := http("GET", f"{api}/flow_runs/{run_id}"))["state_type"] in final and r,
        timeout_s,
        f"flow run {run_id}",
        3,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", type=Path, default=ROOT / "build" / "container-e2e")
    parser.add_argument("--tag", default="e2e")
    parser.add_argument("--timeout", type=float, default=2400, help="Seconds a pipeline run may take.")
    parser.add_argument("--skip-failure", action="store_true", help="Leave out the failure/retry check.")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Override a config value (YAML value), e.g. --set ppo.iterations=2.",
    )
    parser.add_argument(
        "--local-reference",
        action="store_true",
        help="Also run the same config as local processes (`alignflow run`) and compare stage times.",
    )
    args = parser.parse_args()
    build: Path = args.build_dir.resolve()
    run_dir = build / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    for old in podman("ps", "-a", "--filter", "label=io.prefect.flow-run-id", "--format", "{{.ID}}").split():
        podman("rm", "-f", old)
    services = Services(run_dir)
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    moto = None
    try:
        from moto.server import ThreadedMotoServer

        os.environ.update(
            {
                "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
                "AWS_DEFAULT_REGION": "us-east-1",
            }
        )
        s3_port = free_port()
        moto = ThreadedMotoServer(ip_address="127.0.0.1", port=s3_port, verbose=False)
        moto.start()
        s3 = f"http://127.0.0.1:{s3_port}"
        import boto3

        boto3.client("s3", endpoint_url=s3).create_bucket(Bucket=BUCKET)
        # The containers get the credentials as a read-only file (the pool's volume), never as env or a
        # variable.
        aws_dir = run_dir / "aws"
        aws_dir.mkdir()
        (aws_dir / "credentials").write_text(
            f"[default]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
        )
        (aws_dir / "config").write_text("[default]\nregion = us-east-1\n")
        for path in (aws_dir, aws_dir / "credentials", aws_dir / "config"):
            path.chmod(0o755 if path.is_dir() else 0o644)  # read by the images' uid 10001

        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
        ml_port = free_port()
        mlflow = f"http://127.0.0.1:{ml_port}"
        services.start(
            "mlflow",
            [
                str(BIN / "mlflow"),
                "server",
                "--host",
                "127.0.0.1",
                "--port",
                str(ml_port),
                "--backend-store-uri",
                f"sqlite:///{run_dir / 'mlflow.db'}",
                "--artifacts-destination",
                f"s3://{BUCKET}/mlflow",
                "--serve-artifacts",
                "--workers",
                "1",
            ],
            {**base_env, "AWS_ENDPOINT_URL_S3": s3, "MLFLOW_S3_ENDPOINT_URL": s3},
            run_dir,
        )
        pf_port = free_port()
        api = f"http://127.0.0.1:{pf_port}/api"
        prefect_env = {
            **base_env,
            "PREFECT_HOME": str(run_dir / "prefect-home"),
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(pf_port),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "INFO",
        }
        services.start("prefect-server", [str(BIN / "prefect"), "server", "start"], prefect_env, run_dir)
        sock = run_dir / "podman.sock"
        services.start(
            "podman-service", ["podman", "system", "service", "--time=0", f"unix://{sock}"], base_env, run_dir
        )
        started = time.time()
        wait(lambda: healthy(f"{api}/health"), 240, "the Prefect server")
        wait(lambda: healthy(f"{mlflow}/health"), 240, "the MLflow server")
        wait(sock.exists, 60, "podman's Docker API socket")
        report["services_start_s"] = round(time.time() - started, 1)
        client_env = {
            **prefect_env,
            "PREFECT_API_URL": api,
            "DOCKER_HOST": f"unix://{sock}",
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            "PREFECT_RUNNER_POLL_FREQUENCY": "2",
        }

        template = run_dir / "docker-pool.json"
        template.write_text(json.dumps(pool_template(aws_dir, s3, mlflow, "1g"), indent=2))
        subprocess.run(
            [
                str(BIN / "prefect"),
                "work-pool",
                "create",
                POOL,
                "--type",
                "docker",
                "--base-job-template",
                str(template),
            ],
            env=client_env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        services.start(
            "docker-worker",
            [str(BIN / "prefect"), "worker", "start", "--pool", POOL, "--type", "docker", "--limit", "4"],
            client_env,
            run_dir,
        )
        config_path = run_dir / "pipeline.yaml"
        config = pipeline_config(args.tag, s3, mlflow)
        for item in args.set:
            key, _, value = item.partition("=")
            *path, last = key.split(".")
            node = config
            for part in path:
                node = node.setdefault(part, {})
            node[last] = yaml.safe_load(value)
        config_path.write_text(yaml.safe_dump(config))
        out = subprocess.run(
            [str(BIN / "alignflow"), "deploy", str(config_path)],
            env=client_env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        if out.returncode != 0:
            raise SystemExit(f"error: alignflow deploy failed:\n{out.stderr[-3000:]}")
        deployed = dict(
            line.removeprefix("deployed ").rstrip(")").split(" (")
            for line in out.stdout.splitlines()
            if line.startswith("deployed ")
        )
        log(f"deployed {len(deployed)} deployments: {sorted(deployed)}")
        pipeline_id = deployed["alignflow-pipeline/e2e"]

        # --- run 1: every stage in a container --------------------------------------------------
        t0 = time.time()
        first = trigger(api, pipeline_id, args.timeout)
        report["run_s"] = round(time.time() - t0, 1)
        if first["state_type"] != "COMPLETED":
            raise SystemExit(
                f"error: the pipeline run ended {first['state_type']}: {first['state']['message']}; "
                f"logs in {run_dir}"
            )
        made = containers()
        table = []
        for info in made:
            table.append(
                {
                    "stage": stage_of(info),
                    "image": info["ImageName"],
                    "id": info["Id"][:12],
                    "exit_code": info["State"]["ExitCode"],
                    "seconds": round(seconds(info), 1),
                    "flow_run": info["Config"]["Labels"]["io.prefect.flow-run-id"],
                }
            )
        by_stage = {row["stage"]: row for row in table}
        assert set(by_stage) == {"pipeline", *STAGES}, f"containers: {sorted(r['stage'] for r in table)}"
        assert len(table) == len(STAGES) + 1, f"{len(table)} containers for one run: {table}"
        assert all(row["exit_code"] == 0 for row in table), table
        for stage in STAGES:
            want = "engine-native" if stage in ENGINE_STAGES else "training"
            assert f"alignflow-{want}:" in by_stage[stage]["image"], (stage, by_stage[stage]["image"])
        assert "alignflow-worker:" in by_stage["pipeline"]["image"]
        report["containers"] = table
        report["stage_task_s"] = stage_task_seconds(api, first["id"])  # what the pipeline waited per stage
        checks = verify_outputs(mlflow, run_dir, first["id"], s3)
        report["checks"] = checks
        secret_check(made, api, first["id"], mlflow, run_dir)
        report["checks"]["no_credential"] = True

        # --- run 2: a re-trigger skips every stage -------------------------------------------------
        before = {info["Id"] for info in made}
        t0 = time.time()
        second = trigger(api, pipeline_id, args.timeout)
        report["rerun_s"] = round(time.time() - t0, 1)
        assert second["state_type"] == "COMPLETED", second["state"]
        new = [info for info in containers() if info["Id"] not in before]
        assert [stage_of(i) for i in new] == ["pipeline"], (
            f"re-run started stage containers: {[stage_of(i) for i in new]}"
        )
        skipped = stage_runs(mlflow, second["id"])
        # A reused stage's run is tagged with its call key (reward-rm), a fresh one with its stage (reward).
        cached = {
            s.split("-")[0] for s, r in skipped.items() if r.data.tags.get("alignflow.cached") == "true"
        }
        assert cached == set(STAGES), {s: r.data.tags for s, r in skipped.items()}
        report["checks"]["rerun_skips_all"] = True

        if args.local_reference:
            report["overhead"] = local_reference(
                api, first["id"], client_env, config_path, run_dir, args.timeout
            )
        if not args.skip_failure:
            report["failure"] = failure_and_retry(
                api, deployed, pipeline_id, client_env, config_path, args.timeout, mlflow
            )
        print_table(report)
        return 0
    finally:
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        (build / "report.json").write_text(json.dumps(report, indent=2, default=str))
        services.stop()
        if moto is not None:
            moto.stop()
        for info_id in podman(
            "ps", "-a", "--filter", "label=io.prefect.flow-run-id", "--format", "{{.ID}}"
        ).split():
            podman("rm", "-f", info_id)


def stage_runs(mlflow: str, flow_run_id: str) -> dict[str, Any]:
    """The MLflow parent run of one Prefect flow run and its nested stage runs ({stage: run})."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(mlflow)
    experiment = client.get_experiment_by_name("container-e2e")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parent = next(
        r
        for r in runs
        if r.data.tags.get("alignflow.kind") == "pipeline"
        and r.data.tags.get("prefect.flow_run_id") == flow_run_id
    )
    children = {
        r.data.tags.get("alignflow.stage"): r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id
    }
    children["__parent__"] = parent
    return children


def verify_outputs(mlflow: str, run_dir: Path, flow_run_id: str, s3: str) -> dict[str, Any]:
    """Every stage's MLflow run finished under the parent, with artifacts;
    its manifest verifies (sizes, sha256)."""
    from mlflow.tracking import MlflowClient

    from alignflow.config import StorageConfig
    from alignflow.manifest import materialize

    runs = stage_runs(mlflow, flow_run_id)
    parent = runs.pop("__parent__")
    assert parent.info.status == "FINISHED", parent.info.status
    assert set(runs) >= set(STAGES), f"nested runs: {sorted(runs)}"
    client = MlflowClient(mlflow)
    storage = StorageConfig(endpoint_url=s3)
    verified = {}
    for stage in STAGES:
        run = runs[stage]
        assert run.info.status == "FINISHED", (stage, run.info.status)
        assert client.list_artifacts(run.info.run_id), f"{stage}: no MLflow artifacts"
        uri = run.data.tags["alignflow.output_uri"]
        _, manifest = materialize(uri, run_dir / "cache" / stage, storage)
        assert manifest is not None, f"{stage}: no manifest at {uri}"
        verified[stage] = {
            "uri": uri,
            "files": len(manifest.files),
            "mlflow_run": run.info.run_id,
            "duration_s": round((run.info.end_time - run.info.start_time) / 1000, 1),
        }
    return {"parent_run": parent.info.run_id, "stages": verified}


def secret_check(made: list[dict], api: str, flow_run_id: str, mlflow: str, run_dir: Path) -> None:
    """No credential in any container's environment or output, the flow run's logs,
    or any MLflow param/tag."""
    from mlflow.tracking import MlflowClient

    for info in made:
        env = info["Config"]["Env"]
        leaked = [
            e.split("=")[0]
            for e in env
            if e.startswith(("AWS_ACCESS_KEY_ID=", "AWS_SECRET_ACCESS_KEY="))
            or ACCESS_KEY in e
            or SECRET_KEY in e
        ]
        assert not leaked, f"container {info['Id'][:12]} ({stage_of(info)}): credentials in env: {leaked}"
        output = podman("logs", info["Id"])
        assert SECRET_KEY not in output and ACCESS_KEY not in output, (
            f"container {info['Id'][:12]}: credential logged"
        )
    logs = http("POST", f"{api}/logs/filter", {"limit": 200})
    assert all(SECRET_KEY not in json.dumps(entry) for entry in logs), "credential in Prefect logs"
    client = MlflowClient(mlflow)
    experiment = client.get_experiment_by_name("container-e2e")
    for run in client.search_runs([experiment.experiment_id], max_results=1000):
        text = json.dumps({**run.data.params, **run.data.tags})
        assert SECRET_KEY not in text and ACCESS_KEY not in text, (
            f"credential in MLflow run {run.info.run_id}"
        )


def failure_and_retry(
    api: str,
    deployed: dict[str, str],
    pipeline_id: str,
    env: dict[str, str],
    config_path: Path,
    timeout_s: float,
    mlflow: str,
) -> dict[str, Any]:
    """Break the evaluate stage's container (no S3 credentials), see the run fail with the stage's reason;
    fix it and retry the same flow run: it resumes (the published stages are skipped, evaluate runs)."""
    evaluate_id = deployed["alignflow-stage/e2e-evaluate"]
    deployment = http("GET", f"{api}/deployments/{evaluate_id}")
    job_variables = dict(deployment["job_variables"] or {})
    pool = http("GET", f"{api}/work_pools/{POOL}")
    env_default = pool["base_job_template"]["variables"]["properties"]["env"]["default"]
    broken = {
        **job_variables,
        "env": {**env_default, "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/credentials"},
    }
    http("PATCH", f"{api}/deployments/{evaluate_id}", {"job_variables": broken})
    # A new evaluate spec (another seed) so the published evaluation is not simply reused.
    config = yaml.safe_load(config_path.read_text())
    config["evaluate"]["n_prompts"] = 64
    before_failure = {i["Id"] for i in containers()}
    run = http("POST", f"{api}/deployments/{pipeline_id}/create_flow_run", {"parameters": {"config": config}})
    failed = finish(api, run["id"], timeout_s)
    message = failed["state"]["message"] or ""
    assert failed["state_type"] in ("FAILED", "CRASHED"), failed["state"]
    assert "evaluate" in message, message
    # The stage's reason once, not wrapped again by the pipeline ("stage 'evaluate' failed: ... stage
    # 'evaluate' failed").
    assert message.count("stage 'evaluate' failed") == 1, message
    # The images' entrypoint runs `prefect flow-run execute` through alignflow.flows.execute, which exits 1
    # for a Failed run (Prefect's command exits 0), so Kubernetes/Docker restart policies see the failure.
    exited(run["id"])  # the API has the Failed state a moment before the containers exit
    bad = [i for i in containers() if stage_of(i) == "evaluate" and i["Id"] not in before_failure]
    assert bad, "no evaluate container ran in the failing run"
    assert [i["State"]["ExitCode"] for i in bad] == [1], [(i["Id"][:12], i["State"]["ExitCode"]) for i in bad]
    failed_pipeline = [
        i for i in containers() if i["Config"]["Labels"].get("io.prefect.flow-run-id") == run["id"]
    ]
    assert [i["State"]["ExitCode"] for i in failed_pipeline] == [1], (
        "the failed pipeline container did not exit 1"
    )
    http("PATCH", f"{api}/deployments/{evaluate_id}", {"job_variables": job_variables})  # the fix
    # The docker worker names a flow run's container after the run, so the failed attempt's pipeline container
    # (kept until now for its record) would block the retry's: "the container name ... is already in use".
    attempt = [
        i["Id"] for i in containers() if i["Config"]["Labels"].get("io.prefect.flow-run-id") == run["id"]
    ]
    if attempt:
        podman("rm", *attempt)
    before = {i["Id"] for i in containers()}
    http(
        "POST",
        f"{api}/flow_runs/{run['id']}/set_state",
        {
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "retry after the fix"},
            "force": True,
        },
    )
    retried = finish(api, run["id"], timeout_s)
    assert retried["state_type"] == "COMPLETED", retried["state"]
    new = sorted(stage_of(i) for i in containers() if i["Id"] not in before)
    assert new == ["evaluate", "pipeline"], f"the retry ran these containers: {new}"
    runs = stage_runs(mlflow, run["id"])
    reused = sorted(
        s.split("-")[0]
        for s, r in runs.items()
        if s != "__parent__" and r.data.tags.get("alignflow.cached") == "true"
    )
    return {
        "flow_run": run["id"],
        "failed_state": failed["state_type"],
        "message": message,
        "failed_container_exit_codes": [i["State"]["ExitCode"] for i in bad],
        "failed_pipeline_exit_codes": [i["State"]["ExitCode"] for i in failed_pipeline],
        "retry_state": retried["state_type"],
        "retry_containers": new,
        "reused_on_retry": reused,
    }


def stage_task_seconds(api: str, flow_run_id: str) -> dict[str, float]:
    """How long the pipeline waited for each stage (data, base, ...):
    its task run's start to end (Prefect API)."""
    runs = http(
        "POST", f"{api}/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200}
    )
    seconds: dict[str, float] = {}
    # a stage's task is named after its key ("reward-rm"); one stage's reward models run side by side
    for r in runs:
        stage = r["name"].split("-")[0]
        if r["state_type"] == "COMPLETED" and stage in STAGES:
            seconds[stage] = max(seconds.get(stage, 0.0), round(r["total_run_time"], 1))
    return seconds


def local_reference(
    api: str, flow_run_id: str, env: dict[str, str], config_path: Path, run_dir: Path, timeout_s: float
) -> dict[str, Any]:
    """The same config as local processes (`alignflow run`, a fresh storage prefix so nothing is reused),
    recorded by the same Prefect server: per stage, the task run's seconds in containers and locally."""
    config = yaml.safe_load(config_path.read_text())
    work = run_dir / "local"
    work.mkdir()
    config.update(workdir=str(work))
    config["storage"]["root"] = f"s3://{BUCKET}/local"
    config.pop("deployment")
    local_path = run_dir / "pipeline-local.yaml"
    local_path.write_text(yaml.safe_dump(config))
    started = time.time()
    with open(run_dir / "local-run.log", "w") as out:
        subprocess.run(
            [str(BIN / "alignflow"), "run", str(local_path)],
            env=env,
            cwd=work,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
            timeout=timeout_s,
        )
    wall = round(time.time() - started, 1)
    # The local run is the one flow run without a deployment.
    local_run = http(
        "POST",
        f"{api}/flow_runs/filter",
        {"flow_runs": {"deployment_id": {"is_null_": True}}, "limit": 1, "sort": "START_TIME_DESC"},
    )[0]
    container_s, local_s = stage_task_seconds(api, flow_run_id), stage_task_seconds(api, local_run["id"])
    return {
        "local_run_s": wall,
        "stages": {s: {"container_s": container_s.get(s), "local_s": local_s.get(s)} for s in STAGES},
    }


def print_table(report: dict[str, Any]) -> None:
    stages = report["checks"]["stages"]
    # task s: the pipeline's wait for the stage (worker pickup + container + flow run); container s: the
    # container's start to exit; stage s: the stage's own MLflow run inside it.
    tasks = report.get("stage_task_s", {})
    print(
        "\nstage      image                                   container     exit  task s  container s  stage "
        "s"
    )
    for row in sorted(report["containers"], key=lambda r: ["pipeline", *STAGES].index(r["stage"])):
        inner = stages.get(row["stage"], {}).get("duration_s", "")
        task = tasks.get(row["stage"], "")
        print(
            f"{row['stage']:<10} {row['image']:<39} {row['id']}  {row['exit_code']:>4}  {task!s:>6}  "
            f"{row['seconds']:>11}  {inner!s:>7}"
        )
    print(
        f"\nrun {report['run_s']} s; re-run (every stage skipped, no stage container) {report['rerun_s']} s; "
        f"manifests verified: {len(stages)}; MLflow parent {report['checks']['parent_run']} with "
        f"{len(stages)} nested stage runs; no credential in container env/logs, Prefect logs or MLflow"
    )
    if "overhead" in report:
        print(
            f"\nstage      task s in a container   task s as a local process   difference "
            f"(local run {report['overhead']['local_run_s']} s, container run {report['run_s']} s)"
        )
        for stage, row in report["overhead"]["stages"].items():
            c, loc = row["container_s"], row["local_s"]
            diff = round(c - loc, 1) if c is not None and loc is not None else ""
            print(f"{stage:<10} {c!s:>21}   {loc!s:>25}   {diff!s:>10}")
    if "failure" in report:
        f = report["failure"]
        print(
            f"failure: {f['failed_state']}: {f['message']}\n  evaluate container exit codes "
            f"{f['failed_container_exit_codes']}; retry {f['retry_state']}, ran {f['retry_containers']}, "
            f"reused {f['reused_on_retry']}"
        )


if __name__ == "__main__":
    sys.exit(main())
