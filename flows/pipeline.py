"""The alignflow pipeline as a Prefect flow: one task per stage call, each its own process, URIs in between.

The flow never imports torch: it plans the stage calls, derives each output URI from (stage,
config, input digests, code version), skips a stage whose output is already published, launches
the others (as local processes, or as their own deployments on their own work pools), retries
transient failures with backoff (never bad input), records one MLflow parent run with a nested
run per stage, registers the models and gates the 'champion' alias.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture, as_completed

from alignflow import tracking
from alignflow.config import PipelineConfig, config_digest
from alignflow.contract import REUSED_MESSAGE, StageResult, StageSpec, TrackingSpec
from alignflow.flows.launch import WARM, launch_local
from alignflow.flows.plan import StageCall, plan
from alignflow.flows.registry import champion_output, decision_markdown, register_and_gate
from alignflow.flows.report import evaluation_markdown, summary_markdown
from alignflow.flows.snapshots import resolve_inputs
from alignflow.manifest import code_version, find_published, output_uri
from alignflow.storage import join_uri, normalize_root, open_store

STAGE_FLOW_NAME = "alignflow-stage"


class StageFailed(RuntimeError):
    """A stage failed; `bad_input` failures (exit code 2) are not retried."""

    def __init__(self, key: str, result: StageResult, bad_input: bool):
        super().__init__(f"stage '{key}' failed: {result.message}")
        self.result = result
        self.bad_input = bad_input


def _retry_transient(task_, task_run, state) -> bool:
    """Prefect retry condition: retry anything but bad input (a config, data or spec error)."""
    error = state.result(raise_on_failure=False)
    return not (isinstance(error, StageFailed) and error.bad_input)


def _raw_data_digests(config: PipelineConfig, workdir: Path) -> dict[str, str]:
    """sha256 of the user's data files, so changed files re-run the data stage (the demo task needs none)."""
    if config.data.source != "files":
        return {}
    digests = {}
    for name in ("sft", "preferences", "prompts", "eval_prompts"):
        uri = getattr(config.data, name)
        if uri:
            path = uri if "://" in uri else str((workdir / uri).resolve())
            digests[f"file:{name}"] = hashlib.sha256(
                open_store(path, config.storage).get_bytes(path)
            ).hexdigest()
    return digests


def _reused(key: str, spec: StageSpec) -> StageResult | None:
    manifest = find_published(spec.output_uri, spec.storage)
    if manifest is None:
        return None
    run_id = None
    if spec.tracking is not None and spec.tracking.enabled:
        run_id = tracking.record_skipped_stage(
            spec.tracking.uri,
            spec.tracking.experiment,
            key,
            spec.tracking.parent_run_id,
            manifest.uri,
            None,
            tags=spec.tracking.tags,
        )
    return StageResult.from_manifest(manifest, "skipped", mlflow_run_id=run_id, message=REUSED_MESSAGE)


def _stage_reason(key: str, message: str) -> str:
    """The stage's own reason in a failed stage flow run's state message, which Prefect words as
    "Flow run encountered an exception: StageFailed: stage 'KEY' failed: REASON"; the pipeline's
    StageFailed says "stage 'KEY' failed" again, so only REASON is kept. Other messages are kept whole."""
    marker = f"{StageFailed.__name__}: stage '{key}' failed: "
    return message.split(marker, 1)[1] if marker in message else message


def _run_as_deployment(key: str, spec: StageSpec, deployment: str) -> StageResult:
    """Run the stage as its own deployment (its own work pool and image); the spec is the parameter."""
    from prefect.deployments import run_deployment

    started = time.perf_counter()
    flow_run = run_deployment(
        deployment,
        parameters={"key": key, "spec": spec.model_dump(mode="json")},
        timeout=None,
        as_subflow=True,
    )
    manifest = find_published(spec.output_uri, spec.storage)
    if flow_run.state is not None and flow_run.state.is_completed() and manifest is not None:
        return StageResult.from_manifest(manifest, "ok", duration_s=round(time.perf_counter() - started, 3))
    state = flow_run.state.name if flow_run.state else "unknown"
    message = (flow_run.state.message if flow_run.state else "") or f"deployment run ended {state}"
    return StageResult(
        stage=spec.stage,
        status="failed",
        message=f"{deployment}: {_stage_reason(key, message)}",
        duration_s=round(time.perf_counter() - started, 3),
    )


@task(name="stage", task_run_name="{key}")
def run_stage(key: str, spec: StageSpec, workdir: str, deployment: str | None = None) -> StageResult:
    """Reuse a published output when its manifest is there; otherwise run the stage; raise on failure."""
    reused = _reused(key, spec)
    if reused is not None:
        return reused
    if deployment:
        result, code = _run_as_deployment(key, spec, deployment), 1
    else:
        result, code = launch_local(spec, key, Path(workdir))
    if result.status == "failed":
        raise StageFailed(key, result, bad_input=code == 2)
    return result


def build_spec(
    call: StageCall,
    config: PipelineConfig,
    results: dict[str, StageResult],
    root: str,
    version: str,
    tracking_spec: TrackingSpec | None,
    workdir: Path,
    extra_digests: dict[str, str],
    extra_inputs: dict[str, tuple[str, str]] | None = None,
) -> StageSpec:
    """The spec of one stage call; `extra_inputs` adds inputs not in the plan (name -> (uri, digest))."""
    inputs = {name: results[up].output_uri for name, up in call.inputs.items()}
    digests = {name: results[up].manifest_digest for name, up in call.inputs.items()}
    for name, (uri, digest) in (extra_inputs or {}).items():
        inputs[name], digests[name] = uri, digest
    identity = {**digests, **(extra_digests if call.stage == "data" else {})}
    return StageSpec(
        stage=call.stage,
        config=call.config,
        inputs=inputs,
        input_digests=digests,
        output_uri=output_uri(root, call.stage, call.identity(), identity, version),
        storage=config.storage,
        tracking=tracking_spec,
        code_version=version,
        workdir=str(workdir),
    )


def parallel_stages(config: PipelineConfig) -> int:
    """How many stages may run at once: `max_parallel_stages`, else 2 (2-8 cores) up to 4 (16+ cores).

    Stages whose inputs are ready overlap (the reward models with each other and with the engine build,
    which need only SFT). Each stage process still sizes its thread pool to the whole machine: two torch
    stages on 2 cores share them, and what overlap gains there is the single-threaded time of one beside
    the other (the engine stage's C++ build, process start-up and imports, checkpoint writes).
    """
    if config.max_parallel_stages is not None:
        return config.max_parallel_stages
    return min(4, max(2, (os.cpu_count() or 1) // 4))


def _flow_run_tags() -> dict[str, str]:
    """Prefect flow-run id and UI URL, as MLflow tags (empty outside a flow run)."""
    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return {}
    run_id = str(context.flow_run.id)
    tags = {"prefect.flow_run_id": run_id, "prefect.flow_run_name": context.flow_run.name}
    ui = os.environ.get("PREFECT_UI_URL")
    if ui:
        tags["prefect.flow_run_url"] = f"{ui.rstrip('/')}/runs/flow-run/{run_id}"
    return tags


@flow(name="alignflow-pipeline", log_prints=True)
def alignflow_pipeline(config: PipelineConfig) -> list[dict[str, Any]]:
    """Run SFT -> reward model(s) -> engine build -> PPO/GRPO
    (or SFT -> DPO) -> evaluation for one pipeline config."""
    logger = get_run_logger()
    workdir = Path(config.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    WARM.start(workdir)  # the first stage to run takes it (a no-op when `alignflow run` started one already)
    tracking_uri = tracking.resolve_tracking_uri(config.tracking, workdir)
    config = resolve_inputs(config, tracking_uri if config.tracking.enabled else None)
    root = normalize_root(config.storage.root, workdir)
    version = code_version()
    tracking_spec = None
    parent_run_id = None
    prefect_tags = _flow_run_tags()
    if config.tracking.enabled:
        parent_run_id = tracking.start_parent_run(
            tracking_uri,
            config.tracking.experiment,
            f"{config.name}-{time.strftime('%Y%m%d-%H%M%S')}",
            config.model_dump(mode="json"),
            tags={
                "alignflow.code_version": version,
                "alignflow.config_digest": config_digest(config)[:16],
                **prefect_tags,
            },
        )
        tracking_spec = TrackingSpec(
            uri=tracking_uri,
            experiment=config.tracking.experiment,
            parent_run_id=parent_run_id,
            tags={"alignflow.pipeline_run": parent_run_id, **prefect_tags},
        )
    extra = _raw_data_digests(config, workdir)
    retries = config.deployment.stage_retries
    delays = [config.deployment.retry_delay_s * 2**i for i in range(max(retries, 1))]
    results: dict[str, StageResult] = {}
    rows: list[dict[str, Any]] = []
    status = "FINISHED"
    champion = None
    calls = plan(config)
    parallel = parallel_stages(config)
    pipeline_started = time.time()
    try:
        waiting = list(calls)
        running: dict[str, PrefectFuture] = {}
        while waiting or running:
            # Start every stage whose inputs are published, up to `parallel` at once, in plan order.
            for call in [c for c in waiting if set(c.inputs.values()) <= results.keys()]:
                if len(running) >= parallel:
                    break
                waiting.remove(call)
                extra_inputs = {}
                if call.stage == "evaluate" and config.registry.enabled and config.tracking.enabled:
                    champion = champion_output(config, tracking_uri)
                    if champion is not None:
                        extra_inputs["champion"] = (champion[1], champion[2])
                spec = build_spec(
                    call, config, results, root, version, tracking_spec, workdir, extra, extra_inputs
                )
                infra = config.deployment.stage_infra.get(call.stage)
                deployment = f"{STAGE_FLOW_NAME}/{config.deployment.name}-{call.stage}" if infra else None
                logger.info(
                    "stage %s -> %s%s", call.key, spec.output_uri, f" via {deployment}" if deployment else ""
                )
                running[call.key] = run_stage.with_options(
                    task_run_name=call.key,
                    retries=retries,
                    retry_delay_seconds=delays,
                    retry_condition_fn=_retry_transient,
                ).submit(call.key, spec, str(workdir), deployment)
            finished = next(as_completed(list(running.values())))
            key = next(k for k, future in running.items() if future is finished)
            del running[key]
            results[key] = finished.result()  # a failed stage raises here; stages already running finish
            rows.append(
                {
                    "key": key,
                    **results[key].model_dump(),
                    "finished_at_s": round(time.time() - pipeline_started, 3),
                }
            )
        order = [c.key for c in calls]
        rows.sort(key=lambda row: order.index(row["key"]))
    except BaseException:
        status = "FAILED"
        raise
    finally:
        WARM.close()
        if parent_run_id is not None and tracking_spec is not None:
            tracking.end_run(tracking_spec.uri, parent_run_id, status)
    for row in rows:
        row["parent_run_id"] = parent_run_id
    promotion = None
    by_key = {row["key"]: row for row in rows}
    if config.registry.enabled and config.tracking.enabled and "evaluate" in by_key:
        promotion = register_and_gate(
            config, by_key, tracking_uri, parent_run_id, champion[0] if champion else None
        )
        rows.append(
            {
                "key": "registry",
                "stage": "registry",
                "status": promotion["verdict"],
                "duration_s": 0.0,
                "output_uri": None,
                "mlflow_run_id": None,
                "metrics": {},
                "key_metric": None,
                "message": promotion["reason"],
                "parent_run_id": parent_run_id,
                "promotion": promotion,
            }
        )
    publish_artifacts(config, rows, tracking_uri, promotion)
    return rows


def publish_artifacts(
    config: PipelineConfig, rows: list[dict[str, Any]], tracking_uri: str, promotion: dict[str, Any] | None
) -> None:
    """Prefect artifacts on the flow run: the stage table, MLflow links,
    evaluation and promotion summaries."""
    create_markdown_artifact(
        key="alignflow-summary",
        markdown=summary_markdown(config, rows),
        description="stage, status, duration, key metric, output URI, MLflow run",
    )
    mlflow_ui = os.environ.get("ALIGNFLOW_MLFLOW_UI_URL") or (
        tracking_uri if tracking_uri.startswith("http") else ""
    )
    parent = rows[0].get("parent_run_id") if rows else None
    if mlflow_ui and parent:
        create_link_artifact(
            key="alignflow-mlflow",
            link=f"{mlflow_ui.rstrip('/')}/#/runs/{parent}",
            link_text="MLflow parent run",
        )
    evaluation = next((r for r in rows if r.get("stage") == "evaluate" and r.get("output_uri")), None)
    if evaluation is not None:
        uri = join_uri(evaluation["output_uri"], "eval_report.md")
        report = open_store(uri, config.storage).get_bytes(uri).decode()
        create_markdown_artifact(
            key="alignflow-evaluation",
            markdown=evaluation_markdown(report),
            description="policy vs SFT on held-out prompts",
        )
    if promotion is not None:
        create_markdown_artifact(
            key="alignflow-promotion",
            markdown=decision_markdown(promotion, config.registry.policy_name),
            description="registry promotion gate",
        )


@flow(name=STAGE_FLOW_NAME, log_prints=True)
def alignflow_stage(key: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One stage as its own deployment (its own work pool and image): launch it locally on that worker."""
    parsed = StageSpec.model_validate(spec)
    workdir = Path(parsed.workdir) if Path(parsed.workdir).is_dir() else Path.cwd()
    result, code = launch_local(parsed, key, workdir)
    if result.status == "failed":
        raise StageFailed(key, result, bad_input=code == 2)
    return result.model_dump()
