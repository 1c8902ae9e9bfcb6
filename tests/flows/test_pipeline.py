"""The Prefect pipeline end to end on a small config: MLflow runs, manifests, S3, reuse and re-runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from alignflow.manifest import materialize, read_manifest, sha256_file
from tests.conftest import small_config

pytestmark = pytest.mark.slow


def run_pipeline(config):
    from alignflow.flows.pipeline import alignflow_pipeline

    return {row["key"]: row for row in alignflow_pipeline(config)}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, prefect_harness):
    workdir = tmp_path_factory.mktemp("pipeline")
    config = small_config(workdir)
    return workdir, config, run_pipeline(config)


def test_stages_ran_and_published(first_run):
    workdir, config, rows = first_run
    assert list(rows) == ["data", "base", "sft", "reward-rm"]
    assert {r["status"] for r in rows.values()} == {"ok"}
    for row in rows.values():
        manifest = read_manifest(row["output_uri"])
        assert manifest.digest == row["manifest_digest"]
        folder, _ = materialize(row["output_uri"], workdir / "cache")
        for entry in manifest.files:
            assert sha256_file(folder / entry.path) == entry.sha256
    sft = read_manifest(rows["sft"]["output_uri"])
    assert {"model.safetensors", "config.json", "tokenizer.json", "alignflow_checkpoint.json"} <= {
        f.path for f in sft.files}
    assert sft.inputs["base"].digest == rows["base"]["manifest_digest"]
    assert sft.inputs["data"].digest == rows["data"]["manifest_digest"]


def test_sft_lowers_held_out_loss(first_run):
    metrics = first_run[2]["sft"]["metrics"]
    assert metrics["eval/loss"] < metrics["eval/loss_initial"] - 0.5, metrics


def test_mlflow_has_parent_nested_runs_params_metrics_artifacts(first_run):
    workdir, config, rows = first_run
    client = MlflowClient(f"sqlite:///{workdir.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("test")
    parent_id = rows["sft"]["parent_run_id"]
    parent = client.get_run(parent_id)
    assert parent.data.tags["alignflow.kind"] == "pipeline" and parent.info.status == "FINISHED"
    assert parent.data.params["sft.lr"] == str(config.sft.lr)
    children = client.search_runs([experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    by_stage = {run.data.tags["alignflow.stage"]: run for run in children}
    assert set(by_stage) == {"data", "base", "sft", "reward"}
    sft = by_stage["sft"]
    assert sft.info.run_id == rows["sft"]["mlflow_run_id"]
    assert sft.data.params["sft.epochs"] == "3.0"
    assert "eval/loss" in sft.data.metrics and "train/loss" in sft.data.metrics
    assert len(client.get_metric_history(sft.info.run_id, "train/loss")) >= 2, "metrics are logged per step"
    assert sft.data.tags["alignflow.output_uri"] == rows["sft"]["output_uri"]
    artifacts = [a.path for a in client.list_artifacts(sft.info.run_id, "output")]
    assert artifacts == ["output/manifest.json"]
    logged = json.loads(Path(client.download_artifacts(sft.info.run_id, "output/manifest.json",
                                                       str(workdir / "dl"))).read_text())
    assert logged["digest"] == rows["sft"]["manifest_digest"]
    reward = by_stage["reward"]
    assert reward.data.metrics["eval/accuracy"] == pytest.approx(
        rows["reward-rm"]["metrics"]["eval/accuracy"]
    )
    inputs = {d.dataset.name: d.dataset.digest for d in sft.inputs.dataset_inputs}
    assert set(inputs) == {"sft_train", "sft_eval"}


def test_same_config_reuses_and_changed_sft_reruns_downstream(first_run):
    workdir, config, rows = first_run
    again = run_pipeline(config)
    assert {k: r["status"] for k, r in again.items()} == {k: "skipped" for k in rows}
    assert {k: r["output_uri"] for k, r in again.items()} == {k: r["output_uri"] for k, r in rows.items()}
    changed = run_pipeline(small_config(workdir, sft={"lr": 2e-3}))
    assert {k: r["status"] for k, r in changed.items()} == {
        "data": "skipped",
        "base": "skipped",
        "sft": "ok",
        "reward-rm": "ok",
    }
    assert changed["sft"]["output_uri"] != rows["sft"]["output_uri"]
    assert changed["reward-rm"]["output_uri"] != rows["reward-rm"]["output_uri"]


def test_pipeline_on_s3(tmp_path, prefect_harness, s3_bucket):
    import boto3

    endpoint, bucket = s3_bucket
    config = small_config(
        tmp_path,
        stages=["data", "base", "sft"],
        storage={"root": f"s3://{bucket}/runs", "endpoint_url": endpoint},
        sft={"epochs": 0.5},
    )
    rows = run_pipeline(config)
    assert {r["status"] for r in rows.values()} == {"ok"}
    client = boto3.client("s3", endpoint_url=endpoint)
    keys = {o["Key"] for o in client.list_objects_v2(Bucket=bucket, Prefix="runs/")["Contents"]}
    sft_prefix = rows["sft"]["output_uri"].removeprefix(f"s3://{bucket}/")
    assert f"{sft_prefix}/manifest.json" in keys and f"{sft_prefix}/model.safetensors" in keys
    assert {k.split("/")[1] for k in keys} == {"data", "base", "sft"}
    manifest = read_manifest(rows["sft"]["output_uri"], config.storage)
    sizes = {
        o["Key"]: o["Size"] for o in client.list_objects_v2(Bucket=bucket, Prefix=sft_prefix)["Contents"]
    }
    for entry in manifest.files:
        assert sizes[f"{sft_prefix}/{entry.path}"] == entry.size


def test_flow_run_has_a_summary_artifact(first_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    _, _, rows = first_run
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["alignflow-summary"]))
        )
    assert artifacts, "the flow publishes a Markdown summary artifact"
    assert f"`{rows['sft']['output_uri']}`" in " ".join(a.data for a in artifacts)
    # this module's run's
    text = next(a.data for a in artifacts if f"`{rows['sft']['output_uri']}`" in a.data)
    assert (
        "| stage | status | duration | ran (s into the run) | device | key metric | output | MLflow run |"
        in text
    )
    sft_row = next(line for line in text.splitlines() if line.startswith("| sft |"))
    assert "| cpu |" in sft_row  # the device column: where SFT trained


def test_stages_whose_inputs_are_ready_run_at_the_same_time(first_run):
    """Two reward models need only SFT: with 2 stages at a time they overlap;
    the table shows when each ran."""
    from alignflow.flows.pipeline import parallel_stages
    from alignflow.flows.report import summary_markdown

    workdir, config, _ = first_run
    models = [{"name": "a", "seed": 1}, {"name": "b", "seed": 2}]
    parallel = config.model_copy(
        update={
            "reward": config.reward.model_copy(
                update={"models": [type(config.reward.models[0])(**m) for m in models]}
            ),
            "max_parallel_stages": 2,
        }
    )
    rows = run_pipeline(parallel)
    # plan order, whatever finished first
    assert list(rows) == [
        "data",
        "base",
        "sft",
        "reward-a",
        "reward-b",
    ]
    assert [rows[k]["status"] for k in ("data", "base", "sft")] == ["skipped"] * 3
    spans = {
        k: (rows[k]["finished_at_s"] - rows[k]["duration_s"], rows[k]["finished_at_s"])
        for k in ("reward-a", "reward-b")
    }
    (a_start, a_end), (b_start, b_end) = spans["reward-a"], spans["reward-b"]
    assert a_start < b_end and b_start < a_end, f"the reward models did not overlap: {spans}"
    assert "| ran (s into the run) |" in summary_markdown(parallel, list(rows.values()))
    assert parallel_stages(parallel) == 2
    assert parallel_stages(config.model_copy(update={"max_parallel_stages": 1})) == 1
    assert 2 <= parallel_stages(config.model_copy(update={"max_parallel_stages": None})) <= 4
