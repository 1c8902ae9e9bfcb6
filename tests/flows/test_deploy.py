"""flows/deploy.py: deployments from the source folder (process pools) and an image (docker, kubernetes)."""

from __future__ import annotations

import asyncio

from tests.conftest import small_config


def _read(name: str) -> dict:
    from prefect.client.orchestration import get_client

    async def read():
        async with get_client() as client:
            deployment = await client.read_deployment_by_name(name)
            pool = await client.read_work_pool(deployment.work_pool_name)
            return {
                "entrypoint": deployment.entrypoint,
                "pull_steps": deployment.pull_steps,
                "job_variables": deployment.job_variables,
                "pool_type": pool.type,
                "path": deployment.path,
            }

    return asyncio.run(read())


def test_image_deployments_import_the_installed_flow_and_leave_gpus_out(prefect_harness, tmp_path):
    from alignflow.flows.deploy import deploy, ensure_work_pool

    ensure_work_pool("e2e-docker", "docker")
    infra = {
        "sft": {"work_pool": "e2e-docker", "image": "localhost/alignflow-training:t", "gpus": 0},
        "ppo": {"work_pool": "e2e-docker", "image": "localhost/alignflow-engine-native:t", "gpus": 2},
        "data": {"work_pool": "e2e-process"},
    }
    config = small_config(
        tmp_path,
        deployment={
            "name": "img",
            "work_pool": "e2e-docker",
            "work_pool_type": "docker",
            "image": "localhost/alignflow-worker:t",
            "stage_infra": infra,
        },
    )
    deployed = deploy(config)
    assert set(deployed) == {
        "alignflow-pipeline/img",
        "alignflow-stage/img-sft",
        "alignflow-stage/img-ppo",
        "alignflow-stage/img-data",
    }

    pipeline = _read("alignflow-pipeline/img")
    # Inside the container the source folder does not exist: a module entrypoint, no pull step.
    assert pipeline["entrypoint"] == "alignflow.flows.pipeline.alignflow_pipeline"
    assert not pipeline["pull_steps"]
    assert pipeline["job_variables"] == {"image": "localhost/alignflow-worker:t", "gpu_count": 0}
    assert pipeline["pool_type"] == "docker"

    sft, ppo = _read("alignflow-stage/img-sft"), _read("alignflow-stage/img-ppo")
    assert sft["entrypoint"] == ppo["entrypoint"] == "alignflow.flows.pipeline.alignflow_stage"
    # `gpu_count` is the templates' variable (it was sent as `gpus`, which no template reads).
    assert sft["job_variables"] == {"image": "localhost/alignflow-training:t", "gpu_count": 0}
    assert ppo["job_variables"] == {"image": "localhost/alignflow-engine-native:t", "gpu_count": 2}

    # A stage without an image still runs from the source folder on a process worker.
    data = _read("alignflow-stage/img-data")
    assert data["entrypoint"] == "flows/pipeline.py:alignflow_stage"
    assert data["pull_steps"] and not data["job_variables"]
    assert data["pool_type"] == "process"


def test_deploy_sets_up_one_zombie_automation_from_the_heartbeat_period(prefect_harness, tmp_path):
    """The automation that marks a run Crashed when its heartbeats stop: 3 missed periods, one per server
    however often `alignflow deploy` runs. That it fires is tested in tests/faults/test_orchestration.py (a
    killed worker)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    from alignflow.flows.deploy import ZOMBIE_AUTOMATION, deploy

    for period in (30, 60):  # the second deploy updates the first's automation
        with temporary_settings({PREFECT_FLOWS_HEARTBEAT_FREQUENCY: period}):
            deploy(small_config(tmp_path, deployment={"name": "zombie", "work_pool": "zombie-process"}))
    with get_client(sync_client=True) as client:
        automations = client.read_automations_by_name(ZOMBIE_AUTOMATION)
    assert len(automations) == 1 and automations[0].enabled
    trigger, (action,) = automations[0].trigger, automations[0].actions
    assert trigger.posture == "Proactive" and trigger.within.total_seconds() == 180  # 3 x 60 s
    assert trigger.after == {"prefect.flow-run.heartbeat"} and "prefect.flow-run.Completed" in trigger.expect
    assert trigger.for_each == {"prefect.resource.id"}
    assert action.type == "change-flow-run-state" and action.state == "CRASHED"
