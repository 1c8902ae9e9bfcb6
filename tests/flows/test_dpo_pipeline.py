"""SFT -> DPO -> evaluate as a pipeline: no reward model, no engine stage; evaluated and gated as RL is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.conftest import small_config

pytestmark = pytest.mark.slow


def test_dpo_pipeline_runs_evaluates_and_registers(tmp_path, prefect_harness):
    from alignflow.flows.pipeline import alignflow_pipeline

    config = small_config(
        tmp_path,
        stages=["data", "base", "sft", "dpo", "evaluate"],
        dpo={
            "loss": "ipo",
            "beta": 5.0,
            "lr": 1e-3,
            "batch_size": 16,
            "micro_batch_size": 16,
            "max_length": 64,
            "eval_every": 4,
            "lora": {"rank": 4, "alpha": 8},
        },
        evaluate={"n_prompts": 8, "max_new_tokens": 16, "temperature": 1.0},
        engine={"max_seq_len": 96, "max_batch_size": 16},
    )
    rows = {row["key"]: row for row in alignflow_pipeline(config)}
    assert list(rows) == ["data", "base", "sft", "dpo", "evaluate", "registry"]
    assert {rows[k]["status"] for k in ("data", "base", "sft", "dpo", "evaluate")} == {"ok"}
    evaluation = rows["evaluate"]
    assert "eval/policy_gold_score" in evaluation["metrics"] and "eval/kl_to_ref" in evaluation["metrics"]
    assert not any("rm" in key for key in evaluation["metrics"])  # no reward model anywhere in this pipeline
    report = json.loads((Path(evaluation["output_uri"].removeprefix("file://")) / "eval.json").read_text())
    assert report["training"]["algorithm"] == "dpo"
    # The registry gates the DPO policy on the gold score (no reward model) and registers <dpo output>/policy.
    promotion = rows["registry"]["promotion"]
    assert promotion["score"] == "gold score"
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    version = client.get_latest_versions(config.registry.policy_name)[0]
    assert version.source.endswith("/policy") and rows["dpo"]["output_uri"] in version.source
