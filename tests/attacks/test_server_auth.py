"""The stack's servers tried as an attacker would: without credentials, with wrong ones, and as the read-only
viewer. Real servers on 127.0.0.1 started as infra/compose.yaml starts them (Prefect with its API auth string,
MLflow's basic-auth app with workspaces, the users `alignflow.mlflow_access` makes)."""

from __future__ import annotations

import uuid

import pytest
import requests

from tests.flows.test_production import (
    MLFLOW_ADMIN,
    MLFLOW_PIPELINE,
    MLFLOW_VIEWER,
    PREFECT_AUTH_STRING,
)

pytestmark = pytest.mark.slow

# Each way in without the right credentials: none, a wrong password, a stranger, a malformed header.
PREFECT_USER = PREFECT_AUTH_STRING.split(":", 1)[0]
PREFECT_INTRUDERS = {
    "no credentials": {},
    "wrong password": {"auth": (PREFECT_USER, "not-the-password")},
    "another user": {"auth": ("admin", PREFECT_AUTH_STRING.split(":", 1)[1])},
    "not basic auth": {"headers": {"Authorization": f"Bearer {PREFECT_AUTH_STRING}"}},
}
MLFLOW_INTRUDERS = {
    "no credentials": {},
    "wrong password": {"auth": (MLFLOW_PIPELINE[0], "not-the-password")},
    "unknown user": {"auth": ("mallory", MLFLOW_PIPELINE[1])},
    "admin, wrong password": {"auth": (MLFLOW_ADMIN[0], MLFLOW_VIEWER[1])},
}
FAKE_ID = str(uuid.UUID(int=1))


def _call(method: str, url: str, body: dict | bytes | None = None, **auth) -> requests.Response:
    """One request; a bytes body is sent as it is (an artifact upload), a dict as JSON."""
    payload = {"data": body} if isinstance(body, bytes) else {"json": body}
    return requests.request(method, url, timeout=60, **payload, **auth)


# The Prefect API: reading runs, triggering and deleting them, reading the server's settings. The UI is a
# static bundle that holds no data: everything it shows comes from these endpoints (its dashboard's own
# `/api/ui/...` ones included), so it shows nothing but its login form.
PREFECT_CALLS = [
    ("POST", "/flow_runs/filter", {"limit": 1}),
    ("POST", "/deployments/filter", {"limit": 1}),
    ("POST", f"/deployments/{FAKE_ID}/create_flow_run", {}),
    ("DELETE", f"/flow_runs/{FAKE_ID}", None),
    ("POST", f"/flow_runs/{FAKE_ID}/set_state", {"state": {"type": "CANCELLED"}}),
    ("POST", "/work_pools/filter", {}),
    ("GET", "/admin/settings", None),
    ("POST", "/ui/flow_runs/history", {"history_start": "2026-01-01T00:00:00Z"}),
    ("POST", "/ui/flows/next-runs", {"flow_ids": [FAKE_ID]}),
]


@pytest.mark.parametrize("intruder", PREFECT_INTRUDERS)
def test_the_prefect_api_and_the_uis_data_refuse_whoever_lacks_the_auth_string(prefect_server, intruder):
    api, _ = prefect_server
    refused = {
        f"{method} {path}": _call(method, f"{api}{path}", body, **PREFECT_INTRUDERS[intruder]).status_code
        for method, path, body in PREFECT_CALLS
    }
    assert refused == {call: 401 for call in refused}


def test_the_prefect_api_answers_the_auth_string_and_the_ui_asks_for_it(prefect_server):
    api, _ = prefect_server
    auth = tuple(PREFECT_AUTH_STRING.split(":", 1))
    assert _call("POST", f"{api}/flow_runs/filter", {"limit": 1}, auth=auth).status_code == 200
    assert _call("GET", f"{api}/admin/settings", auth=auth).status_code == 200
    # Open on purpose: the health probe, and the UI's shell and settings (which tell it to show its login).
    assert _call("GET", f"{api}/health").status_code == 200
    ui = api.removesuffix("/api")
    assert _call("GET", f"{ui}/ui-settings").json()["auth"] == "BASIC"


def _mlflow_calls(url: str) -> list[tuple[str, str, dict | bytes | None]]:
    """The REST API, the UI (its page and its ajax API), the artifact proxy and the registry's alias
    endpoint."""
    return [
        ("POST", f"{url}/api/2.0/mlflow/experiments/search", {"max_results": 1}),
        ("POST", f"{url}/api/2.0/mlflow/runs/search", {"experiment_ids": ["0"]}),
        ("GET", f"{url}/api/2.0/mlflow/registered-models/search", None),
        ("POST", f"{url}/api/2.0/mlflow/experiments/create", {"name": "intruder"}),
        ("GET", f"{url}/", None),
        ("POST", f"{url}/ajax-api/2.0/mlflow/experiments/search", {"max_results": 1}),
        ("GET", f"{url}/api/2.0/mlflow-artifacts/artifacts", None),
        ("GET", f"{url}/api/2.0/mlflow-artifacts/artifacts/workspaces/default/0/x.txt", None),
        ("PUT", f"{url}/api/2.0/mlflow-artifacts/artifacts/workspaces/default/0/x.txt", b"forged"),
        ("GET", f"{url}/get-artifact?path=x.txt&run_uuid={FAKE_ID.replace('-', '')}", None),
        ("GET", f"{url}/api/2.0/mlflow/registered-models/alias?name=alignflow-policy&alias=champion", None),
        (
            "POST",
            f"{url}/api/2.0/mlflow/registered-models/alias",
            {"name": "m", "alias": "champion", "version": "1"},
        ),
        ("DELETE", f"{url}/api/2.0/mlflow/registered-models/alias?name=m&alias=champion", None),
    ]


@pytest.mark.parametrize("intruder", MLFLOW_INTRUDERS)
def test_mlflow_refuses_whoever_lacks_credentials_everywhere(mlflow_server, intruder):
    url, _ = mlflow_server
    refused = {
        f"{method} {target.removeprefix(url)}": _call(
            method, target, body, **MLFLOW_INTRUDERS[intruder]
        ).status_code
        for method, target, body in _mlflow_calls(url)
    }
    assert refused == {call: 401 for call in refused}
    assert _call("GET", f"{url}/health").status_code == 200


@pytest.fixture(scope="module")
def pipeline_objects(mlflow_server):
    """What the pipeline user makes, as a pipeline run does: an experiment, a run with a metric and an
    artifact (through the proxy), a registered model with a version and the `champion` alias on it."""
    url, _ = mlflow_server
    pipeline = {"auth": MLFLOW_PIPELINE}

    def ok(method: str, path: str, body: dict | None = None) -> dict:
        response = _call(method, f"{url}/api/2.0/mlflow/{path}", body, **pipeline)
        assert response.status_code == 200, (path, response.text)
        return response.json()

    experiment = ok("POST", "experiments/create", {"name": "attack-target"})["experiment_id"]
    run = ok("POST", "runs/create", {"experiment_id": experiment})["run"]["info"]
    ok("POST", "runs/log-metric", {"run_id": run["run_id"], "key": "gold", "value": 1.0, "timestamp": 0})
    artifact = f"{url}/api/2.0/mlflow-artifacts/artifacts/{run['artifact_uri'].split(':/', 1)[1]}/report.md"
    assert _call("PUT", artifact, b"the real report", **pipeline).status_code == 200
    ok("POST", "registered-models/create", {"name": "attack-policy"})
    version = ok(
        "POST",
        "model-versions/create",
        {"name": "attack-policy", "source": "s3://prod/runs/ppo/attack/policy", "run_id": run["run_id"]},
    )["model_version"]["version"]
    ok("POST", "registered-models/alias", {"name": "attack-policy", "alias": "champion", "version": version})
    return {
        "url": url,
        "experiment": experiment,
        "run": run["run_id"],
        "version": version,
        "artifact": artifact,
    }


def _viewer_attempts(o: dict) -> dict[str, tuple[str, str, dict | bytes | None]]:
    api = f"{o['url']}/api/2.0/mlflow"
    model = "attack-policy"
    return {
        "create an experiment": ("POST", f"{api}/experiments/create", {"name": "viewer-experiment"}),
        "rename the experiment": (
            "POST",
            f"{api}/experiments/update",
            {"experiment_id": o["experiment"], "new_name": "renamed"},
        ),
        "delete the experiment": ("POST", f"{api}/experiments/delete", {"experiment_id": o["experiment"]}),
        "create a run": ("POST", f"{api}/runs/create", {"experiment_id": o["experiment"]}),
        "update the run": ("POST", f"{api}/runs/update", {"run_id": o["run"], "status": "FAILED"}),
        "log a metric": (
            "POST",
            f"{api}/runs/log-metric",
            {"run_id": o["run"], "key": "gold", "value": 9.0, "timestamp": 1},
        ),
        "tag the run": ("POST", f"{api}/runs/set-tag", {"run_id": o["run"], "key": "k", "value": "v"}),
        "delete the run": ("POST", f"{api}/runs/delete", {"run_id": o["run"]}),
        "overwrite an artifact": ("PUT", o["artifact"], b"forged report"),
        "delete an artifact": ("DELETE", o["artifact"], None),
        "create a registered model": ("POST", f"{api}/registered-models/create", {"name": "viewer-model"}),
        "rename the model": ("POST", f"{api}/registered-models/rename", {"name": model, "new_name": "x"}),
        "delete the model": ("DELETE", f"{api}/registered-models/delete", {"name": model}),
        "create a model version": (
            "POST",
            f"{api}/model-versions/create",
            {"name": model, "source": "s3://prod/evil"},
        ),
        "update the version": (
            "PATCH",
            f"{api}/model-versions/update",
            {"name": model, "version": o["version"], "description": "x"},
        ),
        "tag the version": (
            "POST",
            f"{api}/model-versions/set-tag",
            {"name": model, "version": o["version"], "key": "alignflow.promotion", "value": "promoted"},
        ),
        "delete the version": (
            "DELETE",
            f"{api}/model-versions/delete",
            {"name": model, "version": o["version"]},
        ),
        "move the champion alias": (
            "POST",
            f"{api}/registered-models/alias",
            {"name": model, "alias": "champion", "version": "1"},
        ),
        "set a new alias": (
            "POST",
            f"{api}/registered-models/alias",
            {"name": model, "alias": "x", "version": "1"},
        ),
        "delete the champion alias": (
            "DELETE",
            f"{api}/registered-models/alias",
            {"name": model, "alias": "champion"},
        ),
    }


def test_the_viewer_reads_everything_and_changes_nothing(pipeline_objects):
    o = pipeline_objects
    viewer = {"auth": MLFLOW_VIEWER}
    answers = {
        what: _call(method, target, body, **viewer).status_code
        for what, (method, target, body) in _viewer_attempts(o).items()
    }
    assert answers == {what: 403 for what in answers}

    api = f"{o['url']}/api/2.0/mlflow"
    run = _call("GET", f"{api}/runs/get?run_id={o['run']}", **viewer)
    assert run.status_code == 200
    assert run.json()["run"]["info"]["status"] == "RUNNING"
    assert run.json()["run"]["data"]["metrics"] == [{"key": "gold", "value": 1.0, "timestamp": 0, "step": 0}]
    assert "tags" not in run.json()["run"]["data"] or not any(
        t["key"] == "k" for t in run.json()["run"]["data"]["tags"]
    )
    alias = _call("GET", f"{api}/registered-models/alias?name=attack-policy&alias=champion", **viewer)
    assert alias.status_code == 200 and alias.json()["model_version"]["version"] == o["version"]
    versions = _call("GET", f"{api}/registered-models/get?name=attack-policy", **viewer).json()
    assert [v["version"] for v in versions["registered_model"]["latest_versions"]] == [o["version"]]
    experiment = _call("GET", f"{api}/experiments/get?experiment_id={o['experiment']}", **viewer).json()
    assert experiment["experiment"]["name"] == "attack-target"
    assert experiment["experiment"]["lifecycle_stage"] == "active"
    assert _call("GET", o["artifact"], **viewer).content == b"the real report"


@pytest.mark.parametrize(
    ("credentials", "answer"),
    [
        (None, "answered 401 to a client without credentials (no MLFLOW_TRACKING_USERNAME)"),
        ((MLFLOW_PIPELINE[0], "not-the-password"), f"answered 401 to user '{MLFLOW_PIPELINE[0]}'"),
        (MLFLOW_VIEWER, f"answered 403 to user '{MLFLOW_VIEWER[0]}'"),
    ],
)
def test_a_stage_refused_by_mlflow_says_which_credentials_to_set(
    mlflow_server, monkeypatch, credentials, answer
):
    """A stage whose credentials are missing, wrong or only a viewer's fails at once with one line (exit 2 in
    a stage: a retry would be refused the same way), not with MLflow's trace or a wait for an outage."""
    from alignflow import tracking
    from alignflow.contract import TrackingAccessError
    from alignflow.stages.common.runtime import BAD_INPUT_ERRORS

    url, _ = mlflow_server
    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
    for name, value in zip(names, credentials or ("", ""), strict=True):
        if value:
            monkeypatch.setenv(name, value)
        else:
            monkeypatch.delenv(name, raising=False)
    with pytest.raises(TrackingAccessError) as refused:
        with tracking.stage_run(url, "refused-stage", "sft", None):
            pass
    message = str(refused.value)
    assert message.startswith(f"MLflow tracking server {url} {answer} while opening the sft stage's run; ")
    assert ("MLFLOW_TRACKING_PASSWORD" in message) == (credentials != MLFLOW_VIEWER)
    assert TrackingAccessError in BAD_INPUT_ERRORS


def test_a_model_that_does_not_exist_is_none_to_the_gate_though_the_server_answers_403(
    mlflow_server, monkeypatch
):
    """A basic-auth server answers 403 (not 404) for a model nobody registered yet: the promotion gate's first
    run must read that as "no champion", while wrong credentials still stop it."""
    from alignflow import tracking
    from alignflow.contract import TrackingAccessError

    url, _ = mlflow_server
    assert tracking.alias_version(url, "never-registered", "champion") is None
    with pytest.raises(ValueError, match="no such registered model version, or one this user may not read"):
        tracking.resolve_models_uri(url, "models:/never-registered@champion")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    with pytest.raises(TrackingAccessError, match="answered 401"):
        tracking.alias_version(url, "never-registered", "champion")
