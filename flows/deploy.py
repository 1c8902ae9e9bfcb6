"""Register the pipeline (and, where configured, each stage) as Prefect deployments, with schedules and tags.

The pipeline deployment's one parameter is the whole PipelineConfig (a pydantic model), so the
Prefect UI shows a form with every field's description, default and constraints; the YAML's
values are the deployment's defaults. Code is pulled from the source folder (offline-friendly:
no image registry or git remote needed); a deployment given an image (docker/kubernetes pools)
imports the flow from the alignflow package installed in that image instead (a module entrypoint,
no pull step: the source folder does not exist inside the container).

It also creates the automation that marks a flow run whose process died (its worker or machine killed)
Crashed, so that `prefect flow-run retry` can run it again: without it Prefect shows such a run Running
forever.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from prefect import Flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import StateType
from prefect.client.schemas.schedules import CronSchedule, IntervalSchedule
from prefect.events.actions import ChangeFlowRunState
from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
from prefect.events.schemas.events import ResourceSpecification
from prefect.exceptions import ObjectNotFound
from prefect.settings import get_current_settings
from prefect.types.entrypoint import EntrypointType

from alignflow.config import PipelineConfig
from alignflow.flows.pipeline import STAGE_FLOW_NAME, alignflow_pipeline, alignflow_stage

REPO = Path(__file__).resolve().parent.parent
POOL_TEMPLATES = {"docker": REPO / "infra" / "work-pools" / "docker.json",
                  "kubernetes": REPO / "infra" / "work-pools" / "kubernetes.json"}


def schedules_of(config: PipelineConfig) -> list:
    out = []
    for schedule in config.deployment.schedules:
        if schedule.cron:
            out.append(CronSchedule(cron=schedule.cron, timezone=schedule.timezone))
        else:
            out.append(IntervalSchedule(interval=timedelta(seconds=schedule.interval_s)))
    return out


def ensure_work_pool(name: str, pool_type: str) -> None:
    """Create the work pool when missing (docker/kubernetes pools get the GPU-aware templates in infra/)."""
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(name)
            return
        except ObjectNotFound:
            pass
        template: dict[str, Any] = {}
        if pool_type in POOL_TEMPLATES and POOL_TEMPLATES[pool_type].is_file():
            template = json.loads(POOL_TEMPLATES[pool_type].read_text())
        client.create_work_pool(WorkPoolCreate(name=name, type=pool_type, base_job_template=template))


def check_pipeline_pool(config: PipelineConfig, limits: dict[str, int | None]) -> None:
    """Refuse to put the pipeline flow on a pool with a concurrency limit that its stage flows use.

    The pipeline flow holds one of that pool's slots for the whole run while it waits on its stages:
    with limit 1 (`alignflow-docker-gpu` in infra/create-work-pools.sh: one run per GPU host, each
    takes all its GPUs) the stage flows can never start, and with limit N, N pipeline runs deadlock the
    same way. The pipeline flow only plans and waits, so it belongs on a pool without GPUs.
    `limits`: pool name -> its concurrency limit (None = unlimited).
    """
    dep = config.deployment
    limit = limits.get(dep.work_pool)
    shared = sorted(stage for stage, infra in dep.stage_infra.items() if infra.work_pool == dep.work_pool)
    if limit is not None and shared:
        raise ValueError(
            f"deployment.work_pool: '{dep.work_pool}' has a concurrency limit of {limit} and also runs the "
            f"stages {', '.join(shared)} (deployment.stage_infra); the pipeline flow would hold a slot while "
            "waiting on them (deadlock). Put the pipeline on a pool without a limit, e.g. "
            "deployment.work_pool=alignflow-process"
        )


def _pool_limits(names: set[str]) -> dict[str, int | None]:
    limits: dict[str, int | None] = {}
    with get_client(sync_client=True) as client:
        for name in names:
            try:
                limits[name] = client.read_work_pool(name).concurrency_limit
            except ObjectNotFound:
                limits[name] = None
    return limits


def _flow_for(local: Flow, name: str, source: Path, image: str | None) -> Flow:
    """The flow to deploy: from the source folder, or
    (with an image) the one the installed package defines."""
    return local if image else Flow.from_source(source=str(source), entrypoint=f"flows/pipeline.py:{name}")


def _image_args(image: str | None) -> dict[str, Any]:
    return {"image": image, "entrypoint_type": EntrypointType.MODULE_PATH} if image else {}


ZOMBIE_AUTOMATION = "alignflow: crash flow runs that stopped heartbeating"
# A run is a zombie after this many heartbeats in a row are missing (Prefect's own recipe: 3 x 30 s = 90 s).
_MISSED_HEARTBEATS = 3


def zombie_automation() -> AutomationCore:
    """The automation that marks a flow run Crashed once its heartbeats stop (its process died with its
    worker).

    Every deployed flow run's process sends `prefect.flow-run.heartbeat` every
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (180 by default in prefect 3.8, at least 30). The server's
    triggers service fires when, after a heartbeat, neither another heartbeat nor a final state arrives within
    `_MISSED_HEARTBEATS` periods. The period is read where `alignflow deploy` runs: give the workers the same
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY. It runs inside the Prefect server (SQLite or Postgres), so it works
    offline."""
    period = get_current_settings().flows.heartbeat_frequency or 180
    within = timedelta(seconds=_MISSED_HEARTBEATS * period)
    return AutomationCore(
        name=ZOMBIE_AUTOMATION,
        description=f"A flow run with no heartbeat for {within.total_seconds():.0f} s ({_MISSED_HEARTBEATS} "
        f"x {period} s, PREFECT_FLOWS_HEARTBEAT_FREQUENCY) is marked Crashed: its process is gone. Retry it "
        "with `prefect flow-run retry <id>`; finished stages are reused.",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={
                "prefect.flow-run.heartbeat",
                "prefect.flow-run.Completed",
                "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled",
                "prefect.flow-run.Crashed",
            },
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=within,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {within.total_seconds():.0f} s: the flow run's process "
                "died (worker or machine lost); retry it with `prefect flow-run retry`",
            )
        ],
    )


def ensure_zombie_automation() -> str:
    """Create the zombie automation, or bring an existing one (by name) up to date; returns its id."""
    automation = zombie_automation()
    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(ZOMBIE_AUTOMATION)
        if not existing:
            return str(client.create_automation(automation))
        for extra in existing[1:]:  # two deploys racing each other made two: keep one
            client.delete_automation(extra.id)
        client.update_automation(existing[0].id, automation)
        return str(existing[0].id)


def deploy(config: PipelineConfig, source: Path = REPO) -> dict[str, str]:
    """Register the pipeline deployment (and stage deployments) and the zombie-run automation;
    returns {deployment name: id}."""
    dep = config.deployment
    check_pipeline_pool(config, _pool_limits({dep.work_pool}))
    ensure_work_pool(dep.work_pool, dep.work_pool_type)
    ensure_zombie_automation()
    deployed = {}
    deployment_id = _flow_for(alignflow_pipeline, "alignflow_pipeline", source, dep.image).deploy(
        name=dep.name,
        work_pool_name=dep.work_pool,
        build=False,
        push=False,
        **_image_args(dep.image),
        job_variables={"gpu_count": 0} if dep.image else None,  # the flow only plans and waits: no GPU
        parameters={"config": config.model_dump(mode="json")},
        schedules=schedules_of(config),
        tags=dep.tags,
        description=f"alignflow pipeline '{config.name}': SFT -> reward -> engine -> RL -> evaluation",
        print_next_steps=False,
        ignore_warnings=True,
    )
    deployed[f"alignflow-pipeline/{dep.name}"] = str(deployment_id)
    for stage, infra in dep.stage_infra.items():
        ensure_work_pool(infra.work_pool, "kubernetes" if infra.image and infra.gpus else "process")
        stage_flow = _flow_for(alignflow_stage, "alignflow_stage", source, infra.image)
        # `gpu_count` is the GPU variable of both templates in infra/work-pools; 0 leaves GPUs out (CPU
        # hosts).
        job_variables: dict[str, Any] = {"gpu_count": infra.gpus} if infra.image else {}
        stage_id = stage_flow.deploy(
            name=f"{dep.name}-{stage}",
            work_pool_name=infra.work_pool,
            build=False,
            push=False,
            **_image_args(infra.image),
            job_variables=job_variables or None,
            tags=[*dep.tags, f"stage:{stage}"],
            description=f"alignflow '{stage}' stage: runs `python -m alignflow.stages {stage}` with the "
            "given spec",
            print_next_steps=False,
            ignore_warnings=True,
        )
        deployed[f"{STAGE_FLOW_NAME}/{dep.name}-{stage}"] = str(stage_id)
    return deployed
