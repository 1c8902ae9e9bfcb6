"""`python -m alignflow.mlflow_access` against a real basic-auth MLflow server: it makes the pipeline and
viewer users, gives only the pipeline user the right to create, rotates passwords by running again, and
refuses bad settings with a line that names the variable."""

from __future__ import annotations

import os

import pytest
import requests

from alignflow.mlflow_access import PIPELINE_ROLE, Account, ensure_users, main
from tests.conftest import free_port
from tests.flows.test_production import (
    MLFLOW_ADMIN,
    _healthy,
    _stop,
    _wait,
    start_mlflow_server,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("mlflow-access")
    port = free_port()
    proc = start_mlflow_server(home, port, dict(os.environ), str(home / "artifacts"))
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: _healthy(f"{url}/health"), 180, "the MLflow server")
        yield url
    finally:
        _stop(proc)


def _env(url: str, **accounts: tuple[str, str]) -> dict[str, str]:
    env = {"MLFLOW_TRACKING_URI": url, "ALIGNFLOW_MLFLOW_ADMIN_PASSWORD": MLFLOW_ADMIN[1]}
    for who, (username, password) in accounts.items():
        env[f"ALIGNFLOW_MLFLOW_{who.upper()}_USERNAME"] = username
        env[f"ALIGNFLOW_MLFLOW_{who.upper()}_PASSWORD"] = password
    return env


def _create_experiment(url: str, account: tuple[str, str], name: str) -> int:
    return requests.post(
        f"{url}/api/2.0/mlflow/experiments/create", json={"name": name}, auth=account, timeout=30
    ).status_code


def test_users_are_made_once_then_rotated_and_only_the_pipeline_user_creates(server, capsys):
    pipeline, viewer = ("pipe-a", "pipe-a-password-1"), ("view-a", "view-a-password-1")
    assert main(_env(server, pipeline=pipeline, viewer=viewer)) == 0
    assert capsys.readouterr().out.splitlines() == [
        "mlflow-access: created user pipe-a",
        "mlflow-access: created user view-a",
        f"mlflow-access: gave pipe-a the {PIPELINE_ROLE} role",
    ]
    assert _create_experiment(server, pipeline, "made-by-pipeline") == 200
    assert _create_experiment(server, viewer, "made-by-viewer") == 403
    listed = requests.get(
        f"{server}/api/2.0/mlflow/experiments/get-by-name",
        params={"experiment_name": "made-by-pipeline"},
        auth=viewer,
        timeout=30,
    )
    assert listed.status_code == 200, "the viewer reads what the pipeline made"

    # Again with new passwords: the rotation. The old ones stop working, the new ones work, nothing is
    # re-made.
    rotated_pipeline, rotated_viewer = ("pipe-a", "pipe-a-password-2"), ("view-a", "view-a-password-2")
    assert main(_env(server, pipeline=rotated_pipeline, viewer=rotated_viewer)) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "mlflow-access: set the password of pipe-a",
        "mlflow-access: set the password of view-a",
    ]
    for secret in ("pipe-a-password", "view-a-password", MLFLOW_ADMIN[1]):
        assert secret not in out
    assert _create_experiment(server, pipeline, "old-password") == 401
    assert _create_experiment(server, rotated_pipeline, "new-password") == 200
    assert _create_experiment(server, rotated_viewer, "viewer-new-password") == 403


def test_a_viewer_that_held_the_pipeline_role_loses_it(server):
    admin = Account(*MLFLOW_ADMIN)
    ensure_users(
        server, admin, Account("pipe-b", "pipe-b-password-1"), Account("view-b", "view-b-password-1")
    )
    # The names swapped: yesterday's pipeline user is today's viewer.
    done = ensure_users(
        server, admin, Account("view-b", "view-b-password-2"), Account("pipe-b", "pipe-b-password-2")
    )
    assert f"took the {PIPELINE_ROLE} role from pipe-b" in done
    assert _create_experiment(server, ("pipe-b", "pipe-b-password-2"), "swapped-viewer") == 403
    assert _create_experiment(server, ("view-b", "view-b-password-2"), "swapped-pipeline") == 200


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"ALIGNFLOW_MLFLOW_VIEWER_PASSWORD": ""}, "ALIGNFLOW_MLFLOW_VIEWER_PASSWORD not set"),
        ({"ALIGNFLOW_MLFLOW_VIEWER_USERNAME": "pipe-c"}, "the pipeline and viewer users are both 'pipe-c'"),
        ({"ALIGNFLOW_MLFLOW_ADMIN_PASSWORD": "not-the-admin-password"}, "answered 401 to the admin 'admin'"),
        ({"MLFLOW_TRACKING_URI": "file:///tmp/mlruns"}, "users live on an MLflow server"),
    ],
)
def test_bad_settings_exit_2_with_the_variable_named(server, capsys, change, message):
    env = {**_env(server, pipeline=("pipe-c", "pipe-c-password-1"), viewer=("view-c", "view-c-password-1"))}
    env.update(change)
    assert main(env) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: mlflow-access: ") and message in err
    assert "pipe-c-password-1" not in err and "view-c-password-1" not in err


def test_a_password_the_server_refuses_is_reported_and_exits_1(server, capsys):
    assert main(_env(server, pipeline=("pipe-d", "short"), viewer=("view-d", "view-d-password-1"))) == 1
    assert "Password must be at least 12 characters" in capsys.readouterr().err
