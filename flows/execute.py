"""`prefect flow-run execute` for alignflow's containers, exiting 1 when the flow run ended Failed or Crashed.

Prefect's command (3.8.8) exits 0 after it reported a failed flow run to the API, so a stage container
whose stage failed looked successful to everything that reads exit codes: Kubernetes' backoffLimit and
podFailurePolicy, Docker restart policies, `podman ps`. containers/entrypoint.sh sends the work pools'
`prefect flow-run execute [ID]` here. Prefect's own command still does the work (signals, SIGTERM
rescheduling, hooks); afterwards the run's final state is read back from the API. The stage's reason is
already in that state and in the run's logs: this prints the state name only, so it is not repeated.
A Cancelled or rescheduled run exits 0 (nothing to retry).
"""

from __future__ import annotations

import os
import sys
from uuid import UUID

FAILED_STATES = ("FAILED", "CRASHED")


def exit_code(state_type: str | None) -> int:
    """1 for a flow run that ended Failed or Crashed, else 0 (Completed, Cancelled, rescheduled)."""
    return 1 if state_type in FAILED_STATES else 0


def _run_prefect(argv: list[str]) -> int:
    from prefect.cli import app

    sys.argv = ["prefect", "flow-run", "execute", *argv]  # the console script's app() reads sys.argv
    try:
        result = app()
    except SystemExit as done:  # the CLI ends with sys.exit
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return result if isinstance(result, int) else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = _run_prefect(argv)
    if code != 0:  # Prefect's own error (no flow run, API unreachable) already said why
        return code
    flow_run_id = next((a for a in argv if not a.startswith("-")), None) or os.environ.get(
        "PREFECT__FLOW_RUN_ID"
    )
    if flow_run_id is None:
        return code
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        state = client.read_flow_run(UUID(flow_run_id)).state
    state_type = state.type.value if state is not None else None
    code = exit_code(state_type)
    if code:
        print(f"flow run {flow_run_id} ended {state.name}; exiting {code}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
