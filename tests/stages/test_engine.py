"""The engine stage as the pipeline runs it: its published artifact, build report and MLflow run."""

from __future__ import annotations

import json

import pytest
import torch
from mlflow.tracking import MlflowClient

from alignflow.manifest import materialize, read_manifest

pytestmark = pytest.mark.slow


def test_engine_stage_publishes_the_engine_and_a_build_report_tracked_in_mlflow(upstream):
    from alignflow.kernels import decode_attention, skinny_linear

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
        assert paths["linear"].startswith("skinny_linear")
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
