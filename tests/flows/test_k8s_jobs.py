"""flows/k8s_jobs.py: a training stage's multi-node Job, rendered from its config, meets at the rendezvous the
config names, keeps the template's pod spec (and gives the template back for its own overrides), carries
NCCL's needs, is schema-valid, and refuses a config it cannot serve, naming the key and the value it needs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from alignflow.config import ConfigError, load_config
from alignflow.flows.k8s_jobs import TEMPLATE, render_multinode_job, to_yaml
from tests.test_infra import expand_k8s_vars, k8s_validate, load_yaml_docs, validate_k8s

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "llama3-8b-gpu.yaml"
RL_ENDPOINT = "alignflow-rl-0.alignflow-rl-rdzv:29500"  # not the template's port: the port must follow it
PPO_TWO_NODES = ["ppo.resources.nnodes=2", f"ppo.resources.rdzv_endpoint={RL_ENDPOINT}"]


def render(stage: str, overrides: list[str], **kwargs) -> tuple[dict, dict]:
    service, job = render_multinode_job(load_config(CONFIG, overrides), stage, **kwargs)
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    return service, job


def stage_container(job: dict) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container["env"]}


def test_rl_job_meets_at_the_rendezvous_its_config_names():
    config = load_config(CONFIG, PPO_TWO_NODES)
    service, job = render("ppo", PPO_TWO_NODES)
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    container = stage_container(job)
    # One pod per node, all at once; pod 0's DNS name is the endpoint's host, its port the endpoint's.
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == config.ppo.resources.nnodes == 2
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": job["metadata"]["name"]}
    assert pod["subdomain"] == service["metadata"]["name"]
    host, port = RL_ENDPOINT.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    (service_port,) = service["spec"]["ports"]
    (container_port,) = container["ports"]
    assert int(port) == service_port["port"] == service_port["targetPort"] == container_port["containerPort"]
    # The stage command runs the RL stage on the spec; the pod spec is the template's.
    command = [expand_k8s_vars(part, container["env"]) for part in container["command"] + container["args"]]
    assert command == ["python", "-m", "alignflow.stages", "ppo", "--spec",
                       "s3://alignflow-artifacts/llama3-8b/specs/ppo.json"]
    assert {"secretRef": {"name": "alignflow-client-credentials"}} in container["envFrom"]
    assert spec["backoffLimit"] == 0
    assert spec["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2]
    assert pod["securityContext"]["runAsNonRoot"] is True and "hostNetwork" not in pod
    # NCCL's needs: the memory-backed /dev/shm, the interface, its warnings in the log.
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}} in pod["volumes"]
    env = env_of(container)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
    assert env["NCCL_DEBUG"] == "WARN"
    # GPUs: a rank each, plus the vLLM rollout replicas beside rank 0 (4 + 4 x tensor-parallel 1).
    assert config.ppo.resources.nproc_per_node == 4 and config.engine.rollout_workers == 4
    gpus = container["resources"]
    assert gpus["requests"]["nvidia.com/gpu"] == gpus["limits"]["nvidia.com/gpu"] == 8
    assert container["image"] == "alignflow/engine-vllm:0.1.0"  # engine.backend's: the stage runs the engine
    # With the engine in the trainer's process, one GPU per rank.
    _, job = render("ppo", [*PPO_TWO_NODES, "engine.rollout_workers=0", "ppo.resources.nproc_per_node=8"])
    assert stage_container(job)["resources"]["limits"]["nvidia.com/gpu"] == 8
    _, job = render("ppo", [*PPO_TWO_NODES, "engine.rollout_workers=0", "engine.backend=native"])
    assert stage_container(job)["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert stage_container(job)["image"] == "alignflow/training:0.1.0"


def test_supervised_stage_gives_back_the_template_and_the_rl_job_has_its_own_names():
    """Rendered from the overrides the template's header gives, an SFT Job is the template itself (plus the
    stage label): the file stays the one source of the pod spec, and its own example stays right."""
    overrides = re.findall(r"--set (\S+)", TEMPLATE.read_text())
    service, job = render("sft", overrides)
    static = {doc["kind"]: doc for doc in load_yaml_docs(TEMPLATE)}
    for doc in (service, job["spec"]["template"], job):
        assert doc["metadata"]["labels"].pop("alignflow.dev/stage") == "sft"
    assert service == static["Service"]
    assert job == static["Job"]
    # Both Jobs can exist at once: the RL stage's names are its own.
    rl_service, rl_job = render("ppo", PPO_TWO_NODES)
    assert rl_job["metadata"]["name"] != job["metadata"]["name"]
    assert rl_service["metadata"]["name"] != service["metadata"]["name"]
    # The reward and DPO stages meet at the supervised names, with their own stage and spec.
    for stage in ("reward", "dpo"):
        sets = [o.replace("sft.", f"{stage}.") for o in overrides]
        _, other = render(stage, sets)
        assert other["metadata"]["name"] == job["metadata"]["name"]
        env = env_of(stage_container(other))
        assert env["ALIGNFLOW_STAGE"] == stage and env["ALIGNFLOW_SPEC_URI"].endswith(f"/specs/{stage}.json")


RL_HOST = r"alignflow-rl-0\.alignflow-rl-rdzv"


@pytest.mark.parametrize(
    ("stage", "overrides", "message"),
    [
        # One node: the default of the shipped config.
        ("ppo", [], rf"ppo\.resources\.nnodes: is 1; .* needs 2 or more .* {RL_HOST}:29400"),
        # An endpoint that is not pod 0 of the stage's Job (the supervised Job's, an index other than 0).
        (
            "ppo",
            ["ppo.resources.nnodes=2", "ppo.resources.rdzv_endpoint=alignflow-train-0.alignflow-rdzv:29400"],
            r"ppo\.resources\.rdzv_endpoint: 'alignflow-train-0\.alignflow-rdzv:29400' does not name pod 0 "
            rf"of the Job; expected {RL_HOST}:<port>",
        ),
        (
            "sft",
            ["sft.resources.nnodes=3", "sft.resources.rdzv_endpoint=alignflow-train-1.alignflow-rdzv:29400"],
            r"sft\.resources\.rdzv_endpoint: .* expected alignflow-train-0\.alignflow-rdzv:<port>",
        ),
        (
            "ppo",
            ["ppo.resources.nnodes=2", "ppo.resources.rdzv_endpoint=alignflow-rl-0.alignflow-rl-rdzv:70000"],
            r"ppo\.resources\.rdzv_endpoint: port '70000' is not a TCP port",
        ),
        ("engine", [], r"stage 'engine' has no multi-node Job; valid stages: sft, reward, dpo, ppo"),
        # No S3 root and no spec URI: nothing a pod could read.
        (
            "ppo",
            [*PPO_TWO_NODES, "storage.root=file://./artifacts"],
            r"storage\.root: 'file://\./artifacts' is not on S3, .*\(--spec-uri s3://",
        ),
    ],
)
def test_a_config_the_job_cannot_serve_is_refused_naming_the_key(stage, overrides, message):
    with pytest.raises(ConfigError, match=message):
        render_multinode_job(load_config(CONFIG, overrides), stage)


def test_host_network_and_another_interface_are_opt_in():
    _, job = render("ppo", PPO_TWO_NODES, host_network=True, socket_ifname="ib0",
                    spec_uri="s3://b/p/specs/ppo-1.json", image="registry.example/alignflow/engine-vllm:9")
    pod, container = job["spec"]["template"]["spec"], stage_container(job)
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"  # the headless Service's names resolve on it
    env = env_of(container)
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert env["ALIGNFLOW_SPEC_URI"] == "s3://b/p/specs/ppo-1.json"
    assert container["image"] == "registry.example/alignflow/engine-vllm:9"


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])
def test_rendered_jobs_are_schema_valid(version):
    k8s_validate()
    overrides = re.findall(r"--set (\S+)", TEMPLATE.read_text())
    for objects in (render("ppo", PPO_TWO_NODES), render("ppo", PPO_TWO_NODES, host_network=True),
                    render("sft", overrides)):
        for doc in objects:
            validate_k8s(doc, version)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "alignflow.cli", "k8s-job", str(CONFIG), *args],
        capture_output=True, text=True, timeout=120, cwd=REPO,
    )


def test_cli_prints_the_objects_as_yaml_and_refuses_with_the_key():
    sets = [arg for override in PPO_TWO_NODES for arg in ("--set", override)]
    done = cli("--stage", "ppo", *sets)
    assert done.returncode == 0, done.stderr
    assert list(yaml.safe_load_all(done.stdout)) == list(render("ppo", PPO_TWO_NODES))
    assert done.stdout == to_yaml(list(render("ppo", PPO_TWO_NODES)))
    done = cli("--stage", "ppo", *sets, "--host-network", "--socket-ifname", "ib0", "--spec-uri", "s3://b/s.json")
    assert done.returncode == 0, done.stderr
    (_, job) = yaml.safe_load_all(done.stdout)
    assert job["spec"]["template"]["spec"]["hostNetwork"] is True
    assert env_of(stage_container(job))["NCCL_SOCKET_IFNAME"] == "ib0"
    done = cli("--stage", "ppo")
    assert done.returncode == 2 and done.stdout == ""
    assert "error: ppo.resources.nnodes: is 1" in done.stderr


def test_rendered_job_passes_kubectl_client_dry_run(tmp_path):
    if not shutil.which("kubectl"):
        pytest.skip("kubectl not installed")
    path = tmp_path / "rl.yaml"
    path.write_text(to_yaml(list(render("ppo", PPO_TWO_NODES))))
    result = subprocess.run(
        ["kubectl", "create", "--dry-run=client", "-o", "name", "--request-timeout=5s", "-f", str(path)],
        capture_output=True, text=True, timeout=60,
    )
    if result.returncode != 0 and re.search(
        r"connection refused|unable to recognize|no such host|timeout|couldn't get current server",
        result.stderr,
    ):
        pytest.skip("kubectl's client dry-run still needs an API server for discovery; none is reachable")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["service/alignflow-rl-rdzv", "job.batch/alignflow-rl"]
