"""Creates the MLflow users the alignflow stack runs with (a pipeline user that writes runs and registers
models, a viewer that can only read) on a server started with `--app-name basic-auth --enable-workspaces`.

Idempotent: a user that exists gets the password the environment gives, so re-running it with new
passwords rotates them without touching a run. Run as `python -m alignflow.mlflow_access` (the compose
stack's one-shot `mlflow-users` service does); it prints what it did and never a password.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from mlflow.exceptions import MlflowException, RestException

# The role that lets the pipeline user create experiments and registered models in the server's default
# workspace (it then manages what it created). Everyone else inherits the server's default_permission
# (READ in infra/mlflow/basic_auth.ini), which reads everything and creates nothing.
PIPELINE_ROLE = "alignflow-pipeline"
WORKSPACE = "default"
ENV_PREFIX = "ALIGNFLOW_MLFLOW_"


@dataclass(frozen=True)
class Account:
    username: str
    password: str


def _admin_client(tracking_uri: str, admin: Account):
    # Imported here: the auth client pulls in the server's Flask app modules, which no stage needs.
    from mlflow.server.auth.client import AuthServiceClient
    from mlflow.utils.rest_utils import MlflowHostCreds, http_request, verify_rest_response

    class AdminClient(AuthServiceClient):
        """The auth client, authenticated as the admin given rather than as MLFLOW_TRACKING_USERNAME (which
        belongs to the pipeline user in the stack's environment)."""

        def _request(self, endpoint, method, *, expected_status: int = 200, **kwargs):
            creds = MlflowHostCreds(self.tracking_uri, username=admin.username, password=admin.password)
            response = http_request(creds, endpoint, method, **kwargs)
            if response.status_code in (401, 403):
                raise PermissionError(
                    f"{self.tracking_uri} answered {response.status_code} to the admin"
                    f" {admin.username!r}: check {ENV_PREFIX}ADMIN_USERNAME / {ENV_PREFIX}ADMIN_PASSWORD, and"
                    " that the server runs `--app-name basic-auth`"
                )
            response = verify_rest_response(response, endpoint, expected_status=expected_status)
            return response.json() if response.content else {}

    return AdminClient(tracking_uri)


def _ensure_user(client, account: Account) -> str:
    try:
        user = client.get_user(account.username)
    except RestException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
        client.create_user(account.username, account.password)
        return f"created user {account.username}"
    if user.is_admin:
        raise ValueError(
            f"MLflow user {account.username!r} is an admin; the stack's pipeline and viewer users must not"
            " be: pick another username, or revoke it with the update-admin API"
        )
    client.update_user_password(account.username, account.password)
    return f"set the password of {account.username}"


def _pipeline_role(client):
    for role in client.list_roles(WORKSPACE):
        if role.name == PIPELINE_ROLE:
            return role
    role = client.create_role(
        WORKSPACE, PIPELINE_ROLE, "alignflow: create experiments and registered models"
    )
    client.add_role_permission(role.id, "workspace", "*", "USE")
    return role


def ensure_users(tracking_uri: str, admin: Account, pipeline: Account, viewer: Account) -> list[str]:
    """Make the pipeline and viewer users exist with these passwords and the pipeline user hold the role
    that lets it create; return one line per change."""
    if pipeline.username == viewer.username:
        raise ValueError(
            f"the pipeline and viewer users are both {pipeline.username!r}: the viewer must be a separate,"
            " read-only account"
        )
    client = _admin_client(tracking_uri, admin)
    done = [_ensure_user(client, pipeline), _ensure_user(client, viewer)]
    role = _pipeline_role(client)
    if not any(r.id == role.id for r in client.list_user_roles(pipeline.username)):
        client.assign_role(pipeline.username, role.id)
        done.append(f"gave {pipeline.username} the {PIPELINE_ROLE} role")
    # A viewer that once held the pipeline role (a rotation that swapped names) must lose it.
    if any(r.id == role.id for r in client.list_user_roles(viewer.username)):
        client.unassign_role(viewer.username, role.id)
        done.append(f"took the {PIPELINE_ROLE} role from {viewer.username}")
    return done


def _account(env: dict[str, str], who: str, default_username: str | None = None) -> Account:
    username = env.get(f"{ENV_PREFIX}{who}_USERNAME") or default_username
    password = env.get(f"{ENV_PREFIX}{who}_PASSWORD")
    named = {f"{ENV_PREFIX}{who}_USERNAME": username, f"{ENV_PREFIX}{who}_PASSWORD": password}
    missing = [name for name, value in named.items() if not value]
    if missing:
        raise ValueError(f"{' and '.join(missing)} not set: put it in infra/.env (see infra/.env.example)")
    return Account(username, password)


def main(env: dict[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    tracking_uri = env.get("MLFLOW_TRACKING_URI", "")
    try:
        if not tracking_uri.startswith(("http://", "https://")):
            raise ValueError(
                f"MLFLOW_TRACKING_URI={tracking_uri!r}: users live on an MLflow server; set it to the"
                " server's http(s) URL"
            )
        admin = _account(env, "ADMIN", default_username="admin")
        pipeline, viewer = _account(env, "PIPELINE"), _account(env, "VIEWER")
        done = ensure_users(tracking_uri, admin, pipeline, viewer)
    except (ValueError, PermissionError) as exc:
        print(f"error: mlflow-access: {exc}", file=sys.stderr)
        return 2
    except MlflowException as exc:  # the server refused a value (a password under its minimum length)
        print(f"error: mlflow-access: {exc.message}", file=sys.stderr)
        return 1
    for line in done:
        print(f"mlflow-access: {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
