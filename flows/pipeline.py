"""The alignflow pipeline as a Prefect flow: one task per stage call, each a separate process, URIs in between.

The flow never imports torch: it plans the stage calls, derives each output URI from (stage,
config, input digests, code version), skips a stage whose output is already published, launches
the others, and records one MLflow parent run with a nested run per stage.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task

from alignflow import tracking
from alignflow.config import PipelineConfig, config_digest
from alignflow.contract import StageResult, StageSpec, TrackingSpec
from alignflow.flows.launch import launch_local
from alignflow.flows.plan import StageCall, plan
from alignflow.manifest import code_version, find_published, output_uri
from alignflow.offline import set_offline_defaults
from alignflow.storage import normalize_root, open_store


class StageFailed(RuntimeError):
    """A stage exited with a failure; the message is the stage's own one-line reason."""


def _raw_data_digests(config: PipelineConfig, workdir: Path) -> dict[str, str]:
    """sha256 of the user's data files, so changed files re-run the data stage (the demo task needs none)."""
    if config.data.source != "files":
        return {}
    digests = {}
    for name in ("sft", "preferences", "prompts", "eval_prompts"):
        uri = getattr(config.data, name)
        if uri:
            path = uri if "://" in uri else str((workdir / uri).resolve())
            digests[f"file:{name}"] = hashlib.sha256(open_store(path, config.storage).get_bytes(path)).hexdigest()
    return digests


@task(name="stage", task_run_name="{key}")
def run_stage(key: str, spec: StageSpec, workdir: str) -> StageResult:
    """Reuse a published output when its manifest is there; otherwise launch the stage as a process."""
    manifest = find_published(spec.output_uri, spec.storage)
    if manifest is not None:
        run_id = None
        if spec.tracking is not None and spec.tracking.enabled:
            run_id = tracking.record_skipped_stage(spec.tracking.uri, spec.tracking.experiment, key,
                                                   spec.tracking.parent_run_id, manifest.uri, None,
                                                   tags=spec.tracking.tags)
        return StageResult(stage=spec.stage, status="skipped", output_uri=manifest.uri,
                           manifest_digest=manifest.digest, mlflow_run_id=run_id,
                           metrics={k: float(v) for k, v in manifest.summary.get("metrics", {}).items()},
                           key_metric=manifest.summary.get("key_metric"),
                           message="output already published with a matching manifest; reused")
    return launch_local(spec, key, Path(workdir))


def build_spec(call: StageCall, config: PipelineConfig, results: dict[str, StageResult], root: str,
               version: str, tracking_spec: TrackingSpec | None, workdir: Path,
               extra_digests: dict[str, str]) -> StageSpec:
    inputs = {name: results[up].output_uri for name, up in call.inputs.items()}
    digests = {name: results[up].manifest_digest for name, up in call.inputs.items()}
    identity = {**digests, **(extra_digests if call.stage == "data" else {})}
    return StageSpec(stage=call.stage, config=call.config, inputs=inputs, input_digests=digests,
                     output_uri=output_uri(root, call.stage, call.config, identity, version),
                     storage=config.storage, tracking=tracking_spec, code_version=version, workdir=str(workdir))


@flow(name="alignflow-pipeline", log_prints=True)
def alignflow_pipeline(config: PipelineConfig) -> list[dict[str, Any]]:
    """Run SFT -> reward model(s) -> engine build -> PPO/GRPO -> evaluation for one pipeline config."""
    set_offline_defaults()
    logger = get_run_logger()
    workdir = Path(config.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    root = normalize_root(config.storage.root, workdir)
    version = code_version()
    tracking_spec = None
    parent_run_id = None
    if config.tracking.enabled:
        uri = tracking.resolve_tracking_uri(config.tracking, workdir)
        parent_run_id = tracking.start_parent_run(
            uri, config.tracking.experiment, f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}",
            config.model_dump(mode="json"),
            tags={"alignflow.code_version": version, "alignflow.config_digest": config_digest(config)[:16]})
        tracking_spec = TrackingSpec(uri=uri, experiment=config.tracking.experiment, parent_run_id=parent_run_id,
                                     tags={"alignflow.pipeline_run": parent_run_id})
    extra = _raw_data_digests(config, workdir)
    results: dict[str, StageResult] = {}
    rows: list[dict[str, Any]] = []
    status = "FINISHED"
    try:
        for call in plan(config):
            spec = build_spec(call, config, results, root, version, tracking_spec, workdir, extra)
            logger.info("stage %s -> %s", call.key, spec.output_uri)
            result = run_stage.with_options(task_run_name=call.key)(call.key, spec, str(workdir))
            results[call.key] = result
            rows.append({"key": call.key, **result.model_dump()})
            if result.status == "failed":
                raise StageFailed(f"stage '{call.key}' failed: {result.message}")
    except BaseException:
        status = "FAILED"
        raise
    finally:
        if parent_run_id is not None and tracking_spec is not None:
            tracking.end_run(tracking_spec.uri, parent_run_id, status)
    for row in rows:
        row["parent_run_id"] = parent_run_id
    return rows
