"""Secrets are never written down: every credential the project reads holds a canary value, the pipeline runs
end to end (registry gate included) as a Prefect deployment on an authenticated Prefect server and process
worker, with S3 storage (moto) and an authenticated MLflow server; then every record the run left is searched
for the canaries, plain and base64-encoded (an HTTP Basic header). The rendered work-pool jobs (Docker,
Kubernetes) are searched the same way by
tests/test_infra.py::test_work_pool_jobs_carry_no_credential_of_the_worker."""

from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import free_port, small_config
from tests.flows.test_production import (
    BIN,
    _deploy,
    _healthy,
    _http,
    _stop,
    _wait,
    _wait_run,
    start_mlflow_server,
)

pytestmark = pytest.mark.slow

PREFECT_AUTH = "canary-prefect-user:canary-prefect-pass-4c1e9b"
MLFLOW_ADMIN_PASSWORD = "canary-mlflow-admin-pass-77d2a0"
MLFLOW_USER, MLFLOW_PASSWORD = "canary-mlflow-user-3a9f", "canary-mlflow-pass-e05b61"
VIEWER_PASSWORD = "canary-mlflow-viewer-pass-9d14c3"
# Every credential variable a client of the stack reads (the AWS chain, MLflow's client, Prefect's client,
# the Hugging Face hub client), each with a value found nowhere else.
CLIENT_CANARIES = {
    "AWS_ACCESS_KEY_ID": "CANARYAKID6b0d2e",
    "AWS_SECRET_ACCESS_KEY": "canary-s3-secret-8f41ac",
    "AWS_SESSION_TOKEN": "canary-s3-session-2e7c50",
    "MLFLOW_TRACKING_USERNAME": MLFLOW_USER,
    "MLFLOW_TRACKING_PASSWORD": MLFLOW_PASSWORD,
    # Sent only when no username/password is set (MLflow's client prefers basic auth): read, never used here.
    "MLFLOW_TRACKING_TOKEN": "canary-mlflow-token-1f9e77",
    "PREFECT_API_AUTH_STRING": PREFECT_AUTH,
    "HF_TOKEN": "canary-hf-token-c3d8e2",
}
# The servers' own secrets: the MLflow admin's and viewer's passwords.
SERVER_CANARIES = {"MLFLOW_AUTH_ADMIN_PASSWORD": MLFLOW_ADMIN_PASSWORD, "viewer": VIEWER_PASSWORD}


def _needles() -> dict[str, bytes]:
    secrets = {**CLIENT_CANARIES, **SERVER_CANARIES}
    needles = {name: value.encode() for name, value in secrets.items()}
    # What an Authorization header carries: user:password in base64.
    for name, pair in {
        "prefect basic header": PREFECT_AUTH,
        "mlflow basic header": f"{MLFLOW_USER}:{MLFLOW_PASSWORD}",
    }.items():
        needles[name] = base64.b64encode(pair.encode())
    return needles


def _records(roots: dict[str, Path], blobs: dict[str, bytes]) -> dict[str, bytes]:
    """Every file under the roots (named `<root label>/<relative path>`) and every blob."""
    records = dict(blobs)
    for label, root in roots.items():
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            records[f"{label}/{path.relative_to(root)}"] = path.read_bytes()
    return records


def _leaks(records: dict[str, bytes], allowed: dict[str, set[str]]) -> list[str]:
    """`<record>: <canary>` for each canary found in a record, except the pairs `allowed` lists (record name
    suffix -> the canaries that belong there)."""
    return [
        f"{record}: {name}"
        for record, data in records.items()
        for name, needle in _needles().items()
        if needle in data
        and not any(record.endswith(suffix) and name in names for suffix, names in allowed.items())
    ]


# The heavy tier (5-10 min on 2 cores), in CI's subset: the production path the registry-gate run covers
# (S3, an authenticated MLflow server proxying artifacts, the gate's candidate alias) and more (a deployment
# run by an authenticated Prefect server's worker). The timeout leaves room for the run's own 900 s wait.
@pytest.mark.heavy
@pytest.mark.timeout(1200)
def test_no_credential_is_written_in_any_record_of_a_pipeline_run(s3_server, tmp_path):
    import boto3
    from mlflow.tracking import MlflowClient

    from alignflow.mlflow_access import Account, ensure_users

    homes = {name: tmp_path / name for name in ("prefect", "mlflow", "work", "console")}
    for home in homes.values():
        home.mkdir()
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_", "PREFECT_"))}
    base_env.update(
        {
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL_S3": s3_server,
            "PREFECT_HOME": str(homes["prefect"]),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "INFO",
        }
    )
    s3 = boto3.client(
        "s3",
        endpoint_url=s3_server,
        aws_access_key_id=CLIENT_CANARIES["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CLIENT_CANARIES["AWS_SECRET_ACCESS_KEY"],
        region_name="us-east-1",
    )
    s3.create_bucket(Bucket="canary")

    # The servers, as the stack runs them; MLflow proxies artifacts to S3 with the clients' keys.
    mlflow_port, prefect_port = free_port(), free_port()
    mlflow_env = {
        **base_env,
        "AWS_ACCESS_KEY_ID": CLIENT_CANARIES["AWS_ACCESS_KEY_ID"],
        "AWS_SECRET_ACCESS_KEY": CLIENT_CANARIES["AWS_SECRET_ACCESS_KEY"],
        "MLFLOW_S3_ENDPOINT_URL": s3_server,
    }
    mlflow = start_mlflow_server(
        homes["mlflow"], mlflow_port, mlflow_env, "s3://canary/mlflow", admin_password=MLFLOW_ADMIN_PASSWORD
    )
    prefect = subprocess.Popen(
        [str(BIN / "prefect"), "server", "start"],
        env={
            **base_env,
            "PREFECT_SERVER_API_AUTH_STRING": PREFECT_AUTH,
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(prefect_port),
        },
        cwd=homes["prefect"],
        stdout=open(homes["console"] / "prefect-server.log", "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    mlflow_url, api = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}/api"
    client_env = {**base_env, **CLIENT_CANARIES, "PREFECT_API_URL": api, "PREFECT_WORKER_QUERY_SECONDS": "2"}
    worker = None
    try:
        _wait(lambda: _healthy(f"{mlflow_url}/health"), 180, "the MLflow server")
        ensure_users(
            mlflow_url,
            Account("admin", MLFLOW_ADMIN_PASSWORD),
            Account(MLFLOW_USER, MLFLOW_PASSWORD),
            Account("canary-viewer", VIEWER_PASSWORD),
        )
        _wait(lambda: _healthy(f"{api}/health"), 180, "the Prefect server")
        pool = subprocess.run(
            [str(BIN / "prefect"), "work-pool", "create", "alignflow-process", "--type", "process"],
            env=client_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert pool.returncode == 0, pool.stderr[-2000:]
        worker = subprocess.Popen(
            [str(BIN / "prefect"), "worker", "start", "--pool", "alignflow-process"],
            env=client_env,
            cwd=homes["work"],
            stdout=open(homes["console"] / "worker.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        config = small_config(
            homes["work"],
            stages=["data", "base", "sft", "reward", "engine", "ppo", "evaluate"],
            deployment={"name": "canary"},
            storage={"root": "s3://canary/runs", "endpoint_url": s3_server},
            tracking={"uri": mlflow_url, "experiment": "canary"},
            engine={"max_seq_len": 96, "max_batch_size": 32},
            ppo={"iterations": 2, "prompts_per_iteration": 8, "minibatch_size": 8, "max_new_tokens": 16},
            evaluate={"n_prompts": 8, "max_new_tokens": 16},
        ).model_dump(mode="json")
        ids, console = _deploy(config, tmp_path / "pipeline.yaml", client_env, with_console=True)
        (homes["console"] / "alignflow-deploy.log").write_text(console)
        deployment = ids["alignflow-pipeline/canary"]
        run = _http("POST", f"{api}/deployments/{deployment}/create_flow_run", {}, auth=PREFECT_AUTH)
        final = _wait_run(api, run["id"], 900, auth=PREFECT_AUTH)
        assert final["state_type"] == "COMPLETED", final["state"]
        logs = _http(
            "POST", f"{api}/logs/filter", {"logs": {"flow_run_id": {"any_": [run["id"]]}}}, auth=PREFECT_AUTH
        )
        assert logs, "the flow run's logs reached the Prefect server"
        flow_run = _http("GET", f"{api}/flow_runs/{run['id']}", auth=PREFECT_AUTH)
        deployment_record = _http("GET", f"{api}/deployments/{deployment}", auth=PREFECT_AUTH)
        work_pool = _http("GET", f"{api}/work_pools/alignflow-process", auth=PREFECT_AUTH)
        # The registry gate ran with the pipeline user's credentials: the policy has its candidate alias.
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("MLFLOW_TRACKING_USERNAME", MLFLOW_USER)
            patch.setenv("MLFLOW_TRACKING_PASSWORD", MLFLOW_PASSWORD)
            policy = MlflowClient(mlflow_url).get_registered_model("alignflow-policy")
        assert "candidate" in policy.aliases
    finally:
        if worker is not None:
            _stop(worker)
        _stop(prefect)
        _stop(mlflow)

    objects = {
        f"s3://canary/{o['Key']}": s3.get_object(Bucket="canary", Key=o["Key"])["Body"].read()
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket="canary")
        for o in page.get("Contents", [])
    }
    assert any(k.startswith("s3://canary/mlflow/") for k in objects), "MLflow's artifacts went to S3"
    # Checkpoints live once, in the run's storage: MLflow holds no weights file nor an object of their size.
    checkpoints = {
        key: len(body)
        for key, body in objects.items()
        if key.startswith("s3://canary/runs/") and key.endswith((".safetensors", ".pt", ".bin"))
    }
    policies = [k for k in checkpoints if k.startswith("s3://canary/runs/ppo/")]
    assert any(k.endswith("/policy/model.safetensors") for k in policies)
    copies = [
        key
        for key, body in objects.items()
        if key.startswith("s3://canary/mlflow/")
        and (key.endswith((".safetensors", ".pt", ".bin")) or len(body) in set(checkpoints.values()))
    ]
    assert copies == [], "no checkpoint stored twice"
    api_records = {
        "prefect API: the flow run's logs": json.dumps(logs).encode(),
        "prefect API: the flow run": json.dumps(flow_run).encode(),
        "prefect API: the deployment": json.dumps(deployment_record).encode(),
        "prefect API: the work pool": json.dumps(work_pool).encode(),
    }
    records = _records(
        {
            "prefect-home": homes["prefect"],
            "mlflow-home": homes["mlflow"],
            "workdir": homes["work"],
            "console": homes["console"],
        },
        {**objects, **api_records},
    )
    # The search covered what it claims to: both databases, the stage specs and logs, manifests, consoles.
    for kind in (
        "prefect-home/prefect.db",
        "mlflow-home/mlflow.db",
        "mlflow-home/basic_auth.db",
        "workdir/.alignflow/specs/ppo-",
        "workdir/.alignflow/logs/ppo-",
        "/manifest.json",
        "console/worker.log",
        "console/alignflow-deploy.log",
    ):
        assert any(kind in name for name in records), f"no record like {kind} was searched"
    # The pipeline user's name is an identity, not a secret: the users' table holds it (its password only as a
    # salted hash), and the server's access log shows the admin's user-management calls that named it.
    allowed = {
        "mlflow-home/basic_auth.db": {"MLFLOW_TRACKING_USERNAME"},
        "mlflow-home/server.log": {"MLFLOW_TRACKING_USERNAME"},
    }
    assert _leaks(records, allowed) == []


def test_the_search_finds_a_planted_canary_plain_and_as_a_basic_header(tmp_path):
    """The search itself: a canary planted in a file or a blob is found, plainly and base64-encoded as an
    Authorization header carries it, and an allowed pair is the only exemption."""
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "stage.log").write_text(f"key={CLIENT_CANARIES['AWS_SECRET_ACCESS_KEY']}\n")
    header = f"Authorization: Basic {base64.b64encode(PREFECT_AUTH.encode()).decode()}"
    records = _records({"workdir": tmp_path}, {"prefect API: logs": header.encode()})
    assert _leaks(records, {}) == [
        "prefect API: logs: prefect basic header",
        "workdir/logs/stage.log: AWS_SECRET_ACCESS_KEY",
    ]
    assert _leaks(records, {"logs/stage.log": {"AWS_SECRET_ACCESS_KEY"}}) == [
        "prefect API: logs: prefect basic header"
    ]
