"""Orchestration only: Prefect flows and tasks that chain the stage programs, passing URIs and small JSON."""

from alignflow.offline import set_offline_defaults

# Prefect reads its settings once, when it is imported, so the defaults must be in the environment before any module
# of this package imports it. Entry points that called set_offline_defaults() after importing
# alignflow.flows.pipeline (the benchmarks) got Prefect's 20 s ephemeral-server start timeout instead of our 120 s, and
# benchmarks/alignment_seeds.py failed with "Timed out while attempting to connect to ephemeral Prefect API server"
# on the 2-core box at load ~5. setdefault only: a value the user set wins.
set_offline_defaults()
