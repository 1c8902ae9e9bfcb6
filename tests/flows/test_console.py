"""A quiet console: `alignflow run` and its stage processes show no other library's noise unless --verbose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from alignflow.console import QUIET_ENV, VERBOSE_VAR
from tests.conftest import small_config

pytestmark = pytest.mark.slow

# Seen in `alignflow run configs/tiny.yaml` before the switches (alignflow/console.py), by source.
NOISE = {
    "transformers load report": "LOAD REPORT",
    "transformers loading bar": "Loading weights:",
    "transformers saving bar": "Writing model shards:",
    "DeepSpeed logger": "Setting accelerator to CPU",
    "DeepSpeed scheduler warning": "Attempting to get learning rate from scheduler",
    "DeepSpeed print to stdout": "deepspeed_shm_comm_op built successfully",
    "MLflow store logs": "Creating initial MLflow database tables",
}
# Ours, which stay: the stages' progress lines and the summary.
OURS = ("[sft] sft: ", "[reward-rm] reward-rm: ", "alignflow pipeline 'test' finished in")


def run_cli(workdir: Path, *flags: str) -> str:
    """`alignflow run` on a small data -> base -> sft -> reward config in a fresh folder; its whole
    console."""
    workdir.mkdir()
    config = small_config(workdir, stages=["data", "base", "sft", "reward"])
    path = workdir / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    from prefect.settings import PREFECT_API_URL

    # A user's shell: none of the switches set, the session's Prefect API (saves starting a server).
    env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV and k != VERBOSE_VAR}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    proc = subprocess.run(
        [sys.executable, "-m", "alignflow.cli", "run", str(path), *flags],
        capture_output=True,
        text=True,
        cwd=workdir,
        env=env,
        timeout=600,
    )
    console = proc.stdout + proc.stderr
    assert proc.returncode == 0, console[-3000:]
    return console


@pytest.mark.heavy
def test_run_is_quiet_by_default_and_verbose_brings_the_noise_back(tmp_path, prefect_harness):
    quiet = run_cli(tmp_path / "quiet")
    assert {name: marker for name, marker in NOISE.items() if marker in quiet} == {}
    assert [line for line in OURS if line not in quiet] == []
    loud = run_cli(tmp_path / "verbose", "--verbose")
    assert {name: marker for name, marker in NOISE.items() if marker not in loud} == {}, (
        "the markers must be real"
    )
    assert [line for line in OURS if line not in loud] == []
    assert len(quiet.splitlines()) < len(loud.splitlines())
