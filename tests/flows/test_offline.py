"""Offline defaults reach Prefect however the flows are imported."""

from __future__ import annotations

import os
import subprocess
import sys

from alignflow.offline import OFFLINE_ENV

TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def prefect_timeout(code: str, **env: str) -> str:
    """The ephemeral-server start timeout Prefect sees after `code`,
    in a fresh process without our defaults."""
    clean = {k: v for k, v in os.environ.items() if k not in OFFLINE_ENV}
    script = code + f"\nfrom prefect.settings import {TIMEOUT} as T\nprint(T.value())"
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**clean, **env}, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()[-1]


def test_importing_the_flows_sets_the_defaults_before_prefect_reads_them():
    """A benchmark's order (import the pipeline, then call set_offline_defaults) must not leave Prefect at its
    own 20 s, too short for a fresh ephemeral server on a loaded machine."""
    assert prefect_timeout("import prefect") == "20"  # Prefect's own default: what the check below would miss
    late = (
        "from alignflow.flows.pipeline import alignflow_pipeline\n"
        "from alignflow.offline import set_offline_defaults\n"
    )
    assert prefect_timeout(late + "set_offline_defaults()") == "120"
    # the user's value wins
    assert prefect_timeout("import alignflow.flows.pipeline", **{TIMEOUT: "45"}) == "45"
