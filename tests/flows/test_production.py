"""Production path: a real Prefect server and process worker, `alignflow deploy`, REST-triggered and
scheduled runs; the pipeline on a local S3 server with an `mlflow server` (proxied artifacts); the
registry. Both servers run with authentication on, as the production stack does (infra/compose.yaml): every
client here authenticates from the environment."""

from __future__ import annotations

import base64
import configparser
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.conftest import free_port, small_config

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]

# The servers' credentials. Passwords are at least 12 characters: MLflow refuses shorter ones.
PREFECT_AUTH_STRING = "alignflow:prefect-test-auth-string"
MLFLOW_ADMIN = ("admin", "mlflow-test-admin-password")
MLFLOW_PIPELINE = ("alignflow-pipeline", "mlflow-test-pipeline-password")
MLFLOW_VIEWER = ("alignflow-viewer", "mlflow-test-viewer-password")


def basic_auth_header(credentials: str) -> dict[str, str]:
    """The Authorization header of HTTP Basic for `user:password`."""
    return {"Authorization": "Basic " + base64.b64encode(credentials.encode()).decode()}


def _http(
    method: str,
    url: str,
    body: dict | None = None,
    attempts: int = 5,
    auth: str | None = PREFECT_AUTH_STRING,
) -> dict | list:
    """One REST call; 503 and 429 are retried with backoff, as Prefect's own client does: the server
    answers 503 when its SQLite database is busy (it can be, on 2 cores under a full test run). A GET (safe
    to repeat; a POST is not) is retried on a read timeout too: a poll of a flow run's state can wait past
    the timeout while the flow's stages run beside the server on the same cores."""
    data = json.dumps(body).encode() if body is not None else None
    for attempt in range(attempts):
        headers = {"Content-Type": "application/json", **(basic_auth_header(auth) if auth else {})}
        request = urllib.request.Request(url, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=30) as response:  # noqa: S310 - loopback only
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code not in (429, 503) or attempt == attempts - 1:
                raise
            time.sleep(2**attempt)
        except (TimeoutError, urllib.error.URLError):
            if method != "GET" or attempt == attempts - 1:
                raise
            time.sleep(2**attempt)
    raise AssertionError("unreachable")


def _wait(predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310
            return response.status == 200
    except OSError:
        return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:  # a worker may need a second signal
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """A Prefect server on 127.0.0.1 that requires PREFECT_AUTH_STRING, and a process worker polling the
    pipeline's pool; yields the API URL and the clients' environment (which holds the auth string)."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_SERVER_API_AUTH_STRING": PREFECT_AUTH_STRING,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "5",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start"],
        env=env,
        cwd=home,
        stdout=open(home / "server.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    api = f"http://127.0.0.1:{port}/api"
    worker = None
    try:
        _wait(lambda: _healthy(f"{api}/health"), 180, "the Prefect server")
        client_env = {
            **{k: v for k, v in env.items() if k != "PREFECT_SERVER_API_AUTH_STRING"},
            "PREFECT_API_URL": api,
            "PREFECT_API_AUTH_STRING": PREFECT_AUTH_STRING,
            "PREFECT_WORKER_QUERY_SECONDS": "2",
            # The flow runs this worker starts track to mlflow_server as the pipeline user, as the stack's do.
            "MLFLOW_TRACKING_USERNAME": MLFLOW_PIPELINE[0],
            "MLFLOW_TRACKING_PASSWORD": MLFLOW_PIPELINE[1],
        }
        subprocess.run(
            [str(BIN / "prefect"), "work-pool", "create", "alignflow-process", "--type", "process"],
            env=client_env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", "alignflow-process"],
            env=client_env,
            cwd=home,
            stdout=open(home / "worker.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        yield api, client_env
    finally:
        if worker is not None:
            _stop(worker)
        _stop(server)


def _deploy(config_dict: dict, path: Path, env: dict, with_console: bool = False):
    """`alignflow deploy` of the config; returns {flow/deployment name: id} (and its console output)."""
    path.write_text(yaml.safe_dump(config_dict))
    out = subprocess.run(
        [str(BIN / "alignflow"), "deploy", str(path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ids = dict(
        line.removeprefix("deployed ").rstrip(")").split(" (")
        for line in out.stdout.splitlines()
        if line.startswith("deployed ")
    )
    return (ids, out.stdout + out.stderr) if with_console else ids


def _wait_run(api: str, run_id: str, timeout_s: float, auth: str = PREFECT_AUTH_STRING) -> dict:
    final = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
    run = _wait(
        lambda: (r := _http("GET", f"{api}/flow_runs/{run_id}", auth=auth))["state_type"] in final and r,
        timeout_s,
        f"flow run {run_id}",
        3,
    )
    return run


# Heavy: CI's heavy subset triggers a deployment over REST (the secret canary) and with overrides from the
# Prefect UI's form (the browser run); this one adds the parameter schema's descriptions and enums.
@pytest.mark.heavy
def test_deploy_then_trigger_over_rest_with_overrides(prefect_server, tmp_path):
    from mlflow.tracking import MlflowClient

    api, env = prefect_server
    config = small_config(
        tmp_path / "work", stages=["data", "base", "sft"], sft={"epochs": 0.5}, deployment={"name": "rest"}
    ).model_dump(mode="json")
    ids = _deploy(config, tmp_path / "pipeline.yaml", env)
    deployment_id = ids["alignflow-pipeline/rest"]
    deployment = _http("GET", f"{api}/deployments/{deployment_id}")
    schema = deployment["parameter_openapi_schema"]
    definitions = schema.get("definitions") or schema.get("$defs")
    assert definitions["SFTConfig"]["properties"]["lr"]["description"] == "Peak learning rate (AdamW)."
    assert definitions["EngineConfig"]["properties"]["backend"]["enum"] == [
        "native",
        "hf",
        "vllm",
        "tensorrt-llm",
    ]

    config["sft"]["lr"] = 2e-3                    # two config fields overridden at trigger time
    config["data"]["demo"]["n_sft"] = 120
    run = _http(
        "POST", f"{api}/deployments/{deployment_id}/create_flow_run", {"parameters": {"config": config}}
    )
    final = _wait_run(api, run["id"], 600)
    assert final["state_type"] == "COMPLETED", final["state"]

    client = MlflowClient(f"sqlite:///{tmp_path / 'work' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("test")
    runs = client.search_runs([experiment.experiment_id])
    parent = next(r for r in runs if r.data.tags.get("alignflow.kind") == "pipeline")
    assert parent.data.params["sft.lr"] == "0.002" and parent.data.params["data.demo.n_sft"] == "120"
    assert parent.data.tags["prefect.flow_run_id"] == run["id"]
    sft = next(r for r in runs if r.data.tags.get("alignflow.stage") == "sft")
    manifest = Path(sft.data.tags["alignflow.output_uri"].removeprefix("file://")) / "manifest.json"
    assert json.loads(manifest.read_text())["config"]["sft"]["lr"] == 0.002


def test_interval_schedule_produces_a_completed_run(prefect_server, tmp_path):
    api, env = prefect_server
    config = small_config(
        tmp_path / "work",
        stages=["data"],
        deployment={"name": "every-minute", "schedules": [{"interval_s": 60}]},
    )
    ids = _deploy(config.model_dump(mode="json"), tmp_path / "scheduled.yaml", env)
    deployment_id = ids["alignflow-pipeline/every-minute"]

    def completed_scheduled_run():
        # Filter on the state: an interval schedule also creates many future SCHEDULED runs.
        runs = _http(
            "POST",
            f"{api}/flow_runs/filter",
            {
                "flow_runs": {
                    "deployment_id": {"any_": [deployment_id]},
                    "state": {"type": {"any_": ["COMPLETED"]}},
                },
                "limit": 10,
            },
        )
        return next((r for r in runs if r["state_type"] == "COMPLETED" and r.get("auto_scheduled")), None)

    run = _wait(completed_scheduled_run, 480, "a scheduled run to complete", 5)
    assert run["auto_scheduled"] is True


def mlflow_auth_config(home: Path) -> Path:
    """The stack's MLflow auth settings (infra/mlflow/basic_auth.ini) with the users' database in `home`."""
    config = configparser.ConfigParser()
    config.read(REPO / "infra" / "mlflow" / "basic_auth.ini")
    config["mlflow"]["database_uri"] = f"sqlite:///{home / 'basic_auth.db'}"
    path = home / "basic_auth.ini"
    with path.open("w") as out:
        config.write(out)
    return path


def start_mlflow_server(
    home: Path,
    port: int,
    env: dict[str, str],
    artifacts_destination: str,
    admin_password: str = MLFLOW_ADMIN[1],
) -> subprocess.Popen:
    """`mlflow server` as infra/compose.yaml starts it (basic-auth app, workspaces), with a SQLite store."""
    return subprocess.Popen(
        [
            str(BIN / "mlflow"),
            "server",
            "--app-name",
            "basic-auth",
            "--enable-workspaces",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{home / 'mlflow.db'}",
            "--artifacts-destination",
            artifacts_destination,
            "--serve-artifacts",
            "--workers",
            "1",
        ],
        env={
            **env,
            "MLFLOW_AUTH_CONFIG_PATH": str(mlflow_auth_config(home)),
            "MLFLOW_AUTH_ADMIN_PASSWORD": admin_password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": "mlflow-test-flask-secret",
        },
        cwd=home,
        stdout=open(home / "server.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def create_mlflow_users(url: str) -> None:
    """The pipeline and viewer users, made as the stack's `mlflow-users` service makes them."""
    from alignflow.mlflow_access import Account, ensure_users

    ensure_users(url, Account(*MLFLOW_ADMIN), Account(*MLFLOW_PIPELINE), Account(*MLFLOW_VIEWER))


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, s3_server):
    """`mlflow server` on 127.0.0.1 with authentication on and proxied artifacts on the local S3 server. For
    the module, this process and the stages it starts are the pipeline user (MLFLOW_TRACKING_USERNAME /
    MLFLOW_TRACKING_PASSWORD), as the stack's worker is."""
    from alignflow.config import StorageConfig
    from alignflow.storage import S3Store

    S3Store(StorageConfig(endpoint_url=s3_server)).create_bucket("prod")
    home = tmp_path_factory.mktemp("mlflow")
    port = free_port()
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": s3_server, "MLFLOW_S3_ENDPOINT_URL": s3_server}
    server = start_mlflow_server(home, port, env, "s3://prod/mlflow")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _healthy(f"{url}/health"), 180, "the MLflow server")
        create_mlflow_users(url)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MLFLOW_TRACKING_USERNAME", MLFLOW_PIPELINE[0])
            patch.setenv("MLFLOW_TRACKING_PASSWORD", MLFLOW_PIPELINE[1])
            yield url, s3_server
    finally:
        _stop(server)


@pytest.mark.heavy
def test_pipeline_on_s3_and_mlflow_server_with_registry_gate(
    mlflow_server, prefect_harness, tmp_path, monkeypatch
):
    import boto3
    from mlflow.tracking import MlflowClient

    from alignflow.flows.pipeline import alignflow_pipeline

    url, endpoint = mlflow_server
    # Stage processes reach MLflow only over HTTP (proxied artifacts): no S3 endpoint for MLflow in their env.
    monkeypatch.delenv("MLFLOW_S3_ENDPOINT_URL", raising=False)
    storage = {"root": "s3://prod/runs", "endpoint_url": endpoint}
    sections = dict(
        storage=storage,
        tracking={"uri": url, "experiment": "prod"},
        engine={"max_seq_len": 96, "max_batch_size": 32},
        ppo={
            "iterations": 6,
            "prompts_per_iteration": 8,
            "minibatch_size": 8,
            "max_new_tokens": 16,
            "checkpoint_every": 3,
        },
        evaluate={"n_prompts": 8, "max_new_tokens": 16, "temperature": 1.0},
    )
    first = {
        r["key"]: r
        for r in alignflow_pipeline(
            small_config(tmp_path, stages=None, **sections).model_copy(
                update={"stages": ["data", "base", "sft", "reward", "engine", "ppo", "evaluate"]}
            )
        )
    }
    assert {first[k]["status"] for k in first if k != "registry"} == {"ok"}

    s3 = boto3.client("s3", endpoint_url=endpoint)
    objects = {
        o["Key"]: o["Size"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="prod")
        for o in page.get("Contents", [])
    }
    mlflow_objects = {k: s for k, s in objects.items() if k.startswith("mlflow/")}
    checkpoint_files = {
        k: s
        for k, s in objects.items()
        if k.startswith("runs/") and k.endswith((".safetensors", ".pt", ".bin"))
    }
    assert any(
        k.startswith("runs/ppo/") and k.endswith("/policy/model.safetensors") for k in checkpoint_files
    )
    assert mlflow_objects, "MLflow artifacts went to S3 through the proxy"
    assert not [k for k in mlflow_objects if k.endswith((".safetensors", ".pt", ".bin"))]
    copies = sorted(k for k, size in mlflow_objects.items() if size in set(checkpoint_files.values()))
    assert copies == [], "no checkpoint stored twice: no MLflow object has a checkpoint file's size"

    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("prod")
    runs = client.search_runs([experiment.experiment_id])
    evaluate_run = next(r for r in runs if r.data.tags.get("alignflow.stage") == "evaluate")
    listed = {a.path for a in client.list_artifacts(evaluate_run.info.run_id)}
    assert {"eval_report.md", "output", "plots", "reports"} <= listed
    secrets = ("testing-secret-key", "testing-key-id")
    for run in runs:
        for value in [*run.data.params.values(), *run.data.tags.values()]:
            assert not any(s in value for s in secrets), "a credential leaked into MLflow"
    for key in objects:
        if key.endswith("manifest.json"):
            body = s3.get_object(Bucket="prod", Key=key)["Body"].read().decode()
            assert not any(s in body for s in secrets), f"a credential leaked into {key}"

    registry = first["registry"]["promotion"]
    policy = client.get_registered_model("alignflow-policy")
    assert policy.aliases["candidate"] == registry["policy_version"]
    assert client.get_registered_model("alignflow-reward-rm").aliases["candidate"] == "1"
    if not registry["promoted"]:
        pytest.fail(f"the first policy should beat SFT and become champion: {registry['reason']}")
    assert policy.aliases["champion"] == registry["policy_version"]

    # A second run whose policy is worse (barely trained) must not take 'champion', and must say why.
    worse = small_config(
        tmp_path, stages=None, **{**sections, "ppo": {**sections["ppo"], "iterations": 1, "actor_lr": 1e-7}}
    )
    second = {
        r["key"]: r
        for r in alignflow_pipeline(
            worse.model_copy(
                update={"stages": ["data", "base", "sft", "reward", "engine", "ppo", "evaluate"]}
            )
        )
    }
    assert [second[k]["status"] for k in ("data", "base", "sft", "reward-rm", "engine")] == ["skipped"] * 5
    decision = second["registry"]["promotion"]
    assert decision["promoted"] is False and decision["verdict"] == "rejected"
    assert decision["baseline"] == f"champion v{registry['policy_version']}"
    assert "does not beat champion" in decision["reason"]
    assert client.get_registered_model("alignflow-policy").aliases["champion"] == registry["policy_version"]
    version = client.get_model_version("alignflow-policy", decision["policy_version"])
    assert version.tags["alignflow.promotion"] == "rejected"
    assert version.tags["alignflow.promotion_reason"] == decision["reason"]


def test_a_local_folder_registers_on_an_mlflow_server_and_resolves_back(mlflow_server, tmp_path):
    """An MLflow server refuses a local folder as a model version's source; the registry must still work with
    a local storage.root: the version points at the stage run, and the folder comes back from its tag."""
    from mlflow.tracking import MlflowClient

    from alignflow import tracking

    url, _ = mlflow_server
    folder = f"file://{tmp_path}/ppo/0123abcd/policy"
    with tracking.stage_run(url, "local-root", "ppo", None) as run:
        version = tracking.register_version(url, "local-root-policy", folder, run.run_id, {"k": "v"})

    client = MlflowClient(url)
    registered = client.get_model_version("local-root-policy", version)
    assert registered.source == f"runs:/{run.run_id}/{tracking.REGISTERED_OUTPUT_PATH}"
    assert registered.tags["k"] == "v"
    pointer = client.download_artifacts(
        run.run_id, f"{tracking.REGISTERED_OUTPUT_PATH}/source.txt", str(tmp_path)
    )
    assert Path(pointer).read_text().strip() == folder
    assert tracking.resolve_models_uri(url, f"models:/local-root-policy/{version}") == folder
    assert tracking.resolve_models_uri(url, "models:/local-root-policy@candidate") == folder
    assert tracking.alias_version(url, "local-root-policy", "candidate")["source"] == folder

    with pytest.raises(ValueError, match="storage.root on S3"):
        tracking.register_version(url, "local-root-policy", folder, None, {})
    # An object-store folder stays the version's own source.
    s3_version = tracking.register_version(
        url, "local-root-policy", "s3://prod/runs/ppo/0123abcd/policy", run.run_id, {}
    )
    assert (
        client.get_model_version("local-root-policy", s3_version).source
        == "s3://prod/runs/ppo/0123abcd/policy"
    )
