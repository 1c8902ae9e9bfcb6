"""The stage runtime's publishing order with tracking: an output is published only once every metric the stage
queued is in its MLflow run (the run the stage table and registry point at)."""

from __future__ import annotations

import threading

import pytest
import requests
from mlflow.exceptions import MlflowException

from alignflow import tracking
from alignflow.contract import StageSpec, TrackingSpec, TrackingUnavailableError
from alignflow.manifest import find_published
from alignflow.stages.common.runtime import StageContext, tracked


def test_an_output_waits_for_its_queued_metrics_and_is_not_published_without_them(tmp_path, monkeypatch):
    """The sender's kept batch cannot get in (the server refuses the background sender's calls) while the
    stage's own calls still do: publish_output must not publish before the sender gives up, and then not at
    all."""
    monkeypatch.setattr(tracking, "_RETRY_FIRST_S", 0.01)
    monkeypatch.setenv(tracking.OUTAGE_VAR, "0.5")
    spec = StageSpec(stage="ppo", config={}, output_uri=f"file://{tmp_path}/out/ppo", workdir=str(tmp_path),
                     tracking=TrackingSpec(uri=f"sqlite:///{tmp_path / 'mlflow.db'}", experiment="t"))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "policy.txt").write_text("weights")
    ctx = StageContext(spec)
    with pytest.raises(TrackingUnavailableError, match="MLflow unreachable for"):
        with tracked(ctx):
            client = ctx.tracker._client
            log_batch = client.log_batch

            def refused_to_the_sender(run_id, metrics=(), **kwargs):
                if threading.current_thread().name.startswith("mlflow-metrics"):
                    try:
                        raise requests.exceptions.ConnectionError("Connection refused")
                    except requests.exceptions.ConnectionError as exc:
                        raise MlflowException(f"API request failed with exception {exc}") from None
                return log_batch(run_id, metrics=metrics, **kwargs)

            monkeypatch.setattr(client, "log_batch", refused_to_the_sender)
            ctx.tracker.log_metrics_async({"rollout/score_mean": 1.0}, 1)
            ctx.publish_output(folder)
    assert find_published(spec.output_uri) is None, "published while its run lacked a step"


def test_a_stage_program_freezes_the_imports_objects_and_exits_with_mains_code():
    """run_program: the objects alive before main (the imports') are frozen, out of every collection main's
    allocations trigger, and the collector is on for main even where the imports ran with it off (`python -m
    alignflow.stages`); the process exits with main's code after its output is flushed."""
    import subprocess
    import sys

    for collector in ("on", "off"):
        script = (
            "import gc\n"
            f"{'gc.disable()' if collector == 'off' else ''}\n"
            "from alignflow.stages.common.runtime import run_program\n"
            "def main():\n"
            "    print(gc.get_freeze_count() > 1000, gc.isenabled(), end='')\n"
            "    return 3\n"
            "run_program(main)\n"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
        assert (out.returncode, out.stdout) == (3, "True True"), (collector, out.stderr[-2000:])


def test_every_stage_program_runs_through_run_program():
    """A stage program's `__main__` block goes through run_program (and so skips the exit's collections)."""
    import importlib.util
    import re

    from alignflow.contract import STAGE_PROGRAMS

    for stage, program in STAGE_PROGRAMS.items():
        with open(importlib.util.find_spec(program).origin) as file:
            source = file.read()
        block = source.split('if __name__ == "__main__":', 1)[-1]
        assert re.fullmatch(r"\s*run_program\(main\)\s*", block), f"{stage}: {program}: {block!r}"
