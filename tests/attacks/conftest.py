"""The attack tests' servers: the real, authenticated Prefect server and MLflow server of
tests/flows/test_production.py (one copy of how they are started)."""

from tests.flows.test_production import mlflow_server, prefect_server  # noqa: F401
