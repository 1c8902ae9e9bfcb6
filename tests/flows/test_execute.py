"""flows/execute.py: a container's `prefect flow-run execute` exits 1 when its flow run failed (Prefect 0)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefect import flow

from alignflow.flows.execute import exit_code
from alignflow.flows.pipeline import _stage_reason

REPO = Path(__file__).resolve().parents[2]


@flow(name="execute-test-fails")
def fails() -> None:
    raise RuntimeError("stage 'sft' failed: the spec's data input is missing")


@flow(name="execute-test-completes")
def completes() -> int:
    return 1


def _flow_run(entrypoint: str, flow_name: str) -> str:
    from prefect.client.orchestration import get_client

    async def create() -> str:
        async with get_client() as client:
            flow_id = await client.create_flow_from_name(flow_name)
            deployment_id = await client.create_deployment(
                flow_id=flow_id, name="exit-code", entrypoint=entrypoint
            )
            return str((await client.create_flow_run_from_deployment(deployment_id)).id)

    return asyncio.run(create())


def _execute(flow_run_id: str, cwd: Path, *, by_env: bool) -> subprocess.CompletedProcess:
    """The wrapper as the entrypoint runs it in a container: a fresh process, the flow run from the API.
    An empty working folder: Prefect copies it as the run's code storage (the module entrypoint is
    imported)."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-m", "alignflow.flows.execute"]
    if by_env:  # how the docker worker passes it: PREFECT__FLOW_RUN_ID, no argument
        env["PREFECT__FLOW_RUN_ID"] = flow_run_id
    else:
        argv.append(flow_run_id)
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=cwd, timeout=300)


@pytest.mark.slow
def test_a_failed_flow_run_exits_1_and_a_completed_one_0(prefect_harness, tmp_path):
    failed = _execute(
        _flow_run("tests.flows.test_execute.fails", "execute-test-fails"), tmp_path, by_env=True
    )
    # Prefect's own `prefect flow-run execute` exits 0 here; the wrapper reads the Failed state back.
    assert failed.returncode == 1, failed.stderr[-3000:]
    # The reason is in Prefect's log of the run once; the wrapper adds only the state.
    assert failed.stderr.count("the spec's data input is missing") >= 1
    assert failed.stderr.strip().splitlines()[-1].endswith("ended Failed; exiting 1")
    done = _execute(
        _flow_run("tests.flows.test_execute.completes", "execute-test-completes"), tmp_path, by_env=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_exit_codes_by_final_state():
    assert [exit_code(s) for s in ("FAILED", "CRASHED", "COMPLETED", "CANCELLED", "SCHEDULED", None)] == [
        1,
        1,
        0,
        0,
        0,
        0,
    ]


def test_a_remote_stage_failure_is_worded_once():
    prefect_message = (
        "Flow run encountered an exception: StageFailed: stage 'evaluate' failed: "
        "get s3://e2e/runs/evaluate/cbdd/manifest.json failed: cannot reach S3"
    )
    assert (
        _stage_reason("evaluate", prefect_message)
        == "get s3://e2e/runs/evaluate/cbdd/manifest.json failed: cannot reach S3"
    )
    # A crash says no StageFailed: its message is kept whole.
    assert (
        _stage_reason("evaluate", "Flow run infrastructure exited with non-zero status code 137.")
        == "Flow run infrastructure exited with non-zero status code 137."
    )
