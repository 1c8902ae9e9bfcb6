"""Offline-friendly environment defaults (telemetry off) applied by every entry point before it works."""

from __future__ import annotations

import os

OFFLINE_ENV = {
    "MLFLOW_DISABLE_TELEMETRY": "true",
    "DO_NOT_TRACK": "true",  # MLflow honours it only when exactly "true"
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    # Prefect's 20 s default is too short on a small, loaded machine, where a fresh ephemeral server can take
    # longer than that to start (docs/performance.md#start-up).
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
    "PREFECT_LOGGING_LEVEL": "WARNING",
    "AWS_EC2_METADATA_DISABLED": "true",  # don't probe for instance credentials off-cloud
}


def set_offline_defaults() -> None:
    """Set each default unless the user set the variable already."""
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
