"""Orchestration only: Prefect flows and tasks that chain the stage programs, passing URIs and small JSON."""

from alignflow.offline import set_offline_defaults

# Prefect reads its settings once, when it is imported, so the defaults must be in the environment before any
# module of this package imports it: an entry point that calls set_offline_defaults() after importing
# alignflow.flows.pipeline (as the benchmarks do) would otherwise get Prefect's own ephemeral-server start
# timeout, too short on a loaded machine (alignflow/offline.py). setdefault only: a value the user set wins.
set_offline_defaults()
