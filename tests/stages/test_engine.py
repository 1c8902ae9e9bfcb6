"""The engine stage as the pipeline runs it: its published artifact, build report and MLflow run."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest
import torch
from mlflow.tracking import MlflowClient

from alignflow.contract import StageResult, StageSpec
from alignflow.manifest import find_published, materialize, read_manifest

pytestmark = pytest.mark.slow


def test_engine_stage_publishes_the_engine_and_a_build_report_tracked_in_mlflow(upstream):
    from alignflow.kernels import decode_attention, skinny_linear
    from alignflow.stages.common.generation.native import prepack

    workdir, config, rows = upstream
    row = rows["engine"]
    manifest = read_manifest(row["output_uri"])
    assert {"engine_config.json", "build_report.json"} <= {f.path for f in manifest.files}
    assert manifest.inputs["sft"].digest == rows["sft"]["manifest_digest"]
    folder, _ = materialize(row["output_uri"], workdir / "engine-cache")
    report = json.loads((folder / "build_report.json").read_text())
    assert report["backend"] == config.engine.backend == "native"
    assert report["build_s"] > 0 and report["parity"]["ok"] is True
    assert report["parity"]["max_abs_logit_error"] <= report["parity"]["tolerance"]
    assert report["parity"]["greedy_matching_sequences"] == report["parity"]["prompts"] > 0
    paths = report["execution_paths"]
    assert paths["backend"] == "native" and paths["device"] == "cpu"
    if paths["dtype"] == "float32" and skinny_linear.available():
        floor = prepack.min_packed_bytes("blocked")  # the AVX2 build's 256 KiB: above every demo-model weight
        assert paths["linear"].startswith("skinny_linear") if floor == 0 else paths["linear"] == (
            f"F.linear (every weight is under {floor >> 10} KiB, where blocked packing does not pay)")
        head_dim = config.model.tiny.hidden_size // config.model.tiny.num_attention_heads
        assert paths["decode_attention"].startswith("decode_attention") == decode_attention.supports(
            torch.device("cpu"), torch.float32, head_dim)
    elif paths["dtype"] == "float32":
        assert paths["cpu_kernels"].startswith(("unavailable: ", "off "))

    client = MlflowClient(f"sqlite:///{workdir.resolve() / 'mlflow.db'}")
    run = client.get_run(row["mlflow_run_id"])
    assert run.data.tags["alignflow.stage"] == "engine"
    assert {k.removeprefix("alignflow.engine."): v for k, v in run.data.tags.items()
            if k.startswith("alignflow.engine.")} == paths
    assert run.data.metrics["engine/parity_ok"] == 1.0
    assert run.data.metrics["engine/build_s"] == pytest.approx(report["build_s"], abs=1e-3)
    assert "reports/build_report.json" in {a.path for a in client.list_artifacts(run.info.run_id, "reports")}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vllm is importable in this venv")
def test_a_backend_this_interpreter_cannot_run_is_a_configuration_error_exit_2(upstream, tmp_path):
    """engine.backend: vllm where vllm is not installed, and an engine.worker_python that is not there: the
    stage exits 2 (bad input, not retried) with one line naming the package or the key, and publishes
    nothing."""
    workdir, _, rows = upstream
    spec = StageSpec.model_validate_json(
        next((workdir / ".alignflow" / "specs").glob("engine-*.json")).read_text()
    )
    cases = {
        "vllm": (
            {"backend": "vllm"},
            r"engine.backend: vllm needs the vllm package .*containers/engine-vllm",
        ),
        "worker_python": (
            {"backend": "vllm", "worker_python": str(tmp_path / "no-venv" / "python")},
            rf"engine.worker_python={tmp_path}/no-venv/python: no executable there",
        ),
    }
    for name, (engine, message) in cases.items():
        config = {**spec.config, "engine": {**spec.config["engine"], **engine}}
        case = spec.model_copy(update={"config": config, "output_uri": f"file://{tmp_path}/out-{name}"})
        path = case.dump(tmp_path / f"{name}.json")
        proc = subprocess.run(
            [sys.executable, "-m", "alignflow.stages.engine", "--spec", str(path)],
            capture_output=True,
            text=True,
            cwd=workdir,
            timeout=300,
        )
        result = StageResult.from_output(proc.stdout)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert result.status == "failed" and re.search(message, result.message), result.message
        assert find_published(case.output_uri) is None
