"""flows/k8s_jobs.py: a training stage's multi-node Job, rendered from its config, meets at the
rendezvous the config names, keeps the template's pod spec (and gives the template back for its own
overrides), carries NCCL's needs, is schema-valid, and refuses a config it cannot serve, naming the key
and the value it needs. The RL stage with rollout nodes adds the rollout pods' Job: their index on the
command line, their GPUs, the shared secret from a Secret on both roles (never a literal), and one
trainer pod allowed."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from alignflow.config import ROLLOUT_SECRET_VAR, ConfigError, load_config
from alignflow.flows.k8s_jobs import ROLLOUT_TEMPLATE, TEMPLATE, render_multinode_job, to_yaml
from tests.test_infra import expand_k8s_vars, k8s_validate, load_yaml_docs, validate_k8s

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "llama3-8b-gpu.yaml"
RL_ENDPOINT = "alignflow-rl-0.alignflow-rl-rdzv:29500"  # not the template's port: the port follows it
PPO_TWO_NODES = ["ppo.resources.nnodes=2", f"ppo.resources.rdzv_endpoint={RL_ENDPOINT}"]
# One trainer pod (4 ranks) and 3 rollout pods of 2 replicas x tensor-parallel 2 each: 4 GPUs a pod.
ROLLOUT_ENDPOINT = "alignflow-rl-0.alignflow-rl-rdzv:29600"
PPO_ROLLOUT_NODES = [
    "engine.backend=native", "engine.tensor_parallel_size=2", "engine.rollout_workers=6",
    "engine.rollout_nodes=3", f"engine.rollout_endpoint={ROLLOUT_ENDPOINT}",
]
SECRET_FROM_SECRET = {"secretKeyRef": {"name": "alignflow-rollout-secret", "key": "secret"}}


def render(stage: str, overrides: list[str], **kwargs) -> tuple[dict, dict]:
    service, job = render_multinode_job(load_config(CONFIG, overrides), stage, **kwargs)
    assert (service["kind"], job["kind"]) == ("Service", "Job")
    return service, job


def render_with_rollout(overrides: list[str], **kwargs) -> tuple[dict, dict, dict]:
    service, job, rollout = render_multinode_job(load_config(CONFIG, overrides), "ppo", **kwargs)
    assert (service["kind"], job["kind"], rollout["kind"]) == ("Service", "Job", "Job")
    return service, job, rollout


def stage_container(job: dict) -> dict:
    (container,) = job["spec"]["template"]["spec"]["containers"]
    return container


def env_of(container: dict) -> dict[str, str]:
    """The container's literal env values (not those from a Secret)."""
    return {item["name"]: item["value"] for item in container["env"] if "value" in item}


def gpus_of(job: dict) -> int:
    resources = stage_container(job)["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"]
    return resources["limits"]["nvidia.com/gpu"]


def command_of(job: dict) -> list[str]:
    container = stage_container(job)
    return [expand_k8s_vars(part, container["env"]) for part in container["command"] + container["args"]]


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
    assert int(port) == service_port["port"] == service_port["targetPort"]
    assert int(port) == container_port["containerPort"]
    # The stage command runs the RL stage on the spec; the pod spec is the template's.
    assert command_of(job) == ["python", "-m", "alignflow.stages", "ppo", "--spec",
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
    assert container["image"] == "alignflow/engine-vllm:0.1.0"  # engine.backend's: the stage runs it
    # With the engine in the trainer's process, one GPU per rank.
    in_process = [*PPO_TWO_NODES, "engine.rollout_workers=0"]
    _, job = render("ppo", [*in_process, "ppo.resources.nproc_per_node=8"])
    assert stage_container(job)["resources"]["limits"]["nvidia.com/gpu"] == 8
    _, job = render("ppo", [*PPO_TWO_NODES, "engine.rollout_workers=0", "engine.backend=native"])
    assert stage_container(job)["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert stage_container(job)["image"] == "alignflow/training:0.1.0"


def test_supervised_stage_gives_back_the_template_and_the_rl_job_has_its_own_names():
    """Rendered from the overrides the template's header gives, an SFT Job is the template itself (plus
    the stage label): the file stays the one source of the pod spec, and its own example stays right."""
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
        assert env["ALIGNFLOW_STAGE"] == stage
        assert env["ALIGNFLOW_SPEC_URI"].endswith(f"/specs/{stage}.json")


def test_rl_stage_with_rollout_nodes_adds_the_rollout_pods_job():
    config = load_config(CONFIG, PPO_ROLLOUT_NODES)
    service, job, rollout = render_with_rollout(PPO_ROLLOUT_NODES)
    spec_uri = "s3://alignflow-artifacts/llama3-8b/specs/ppo.json"
    # One trainer pod (nnodes 1 is the config's), asking only for its ranks' GPUs: no replica beside it.
    assert config.ppo.resources.nnodes == 1 and config.ppo.resources.nproc_per_node == 4
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 1
    assert gpus_of(job) == 4
    assert command_of(job) == ["python", "-m", "alignflow.stages", "ppo", "--spec", spec_uri]
    # A pod per rollout node, each the stage's command with its index, which Kubernetes puts in
    # JOB_COMPLETION_INDEX (no env entry of ours may shadow it), and 6 / 3 replicas x 2 GPUs.
    assert rollout["metadata"]["name"] == "alignflow-rl-rollout"
    assert rollout["spec"]["completionMode"] == "Indexed"
    assert rollout["spec"]["completions"] == rollout["spec"]["parallelism"] == 3
    assert command_of(rollout) == [
        "python", "-m", "alignflow.stages", "ppo", "--spec", spec_uri,
        "--rollout-node", "$(JOB_COMPLETION_INDEX)",
    ]
    assert "JOB_COMPLETION_INDEX" not in {e["name"] for e in stage_container(rollout)["env"]}
    assert gpus_of(rollout) == 4
    images = {stage_container(one)["image"] for one in (job, rollout)}
    assert images == {"alignflow/training:0.1.0"}  # engine.backend native: the trainer's, on both roles
    # Placed by role; the Service names the trainer's pods only, and pod 0 hosts the rollout endpoint.
    for one, role in ((job, "trainer"), (rollout, "rollout")):
        for labels in (one["metadata"]["labels"], one["spec"]["template"]["metadata"]["labels"]):
            assert labels["alignflow.dev/role"] == role and labels["alignflow.dev/stage"] == "ppo"
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": "alignflow-rl"}
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]
    host, port = ROLLOUT_ENDPOINT.rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    # One trainer node: no rendezvous to serve, only the rollout endpoint's port.
    assert service["spec"]["ports"] == [{"name": "rollout", "port": int(port), "targetPort": int(port)}]
    assert stage_container(job)["ports"] == [{"name": "rollout", "containerPort": int(port)}]
    assert "ports" not in stage_container(rollout)
    # Both roles: the shared secret from the Secret's key, and the same interfaces for NCCL and gloo.
    for one in (job, rollout):
        container = stage_container(one)
        (secret,) = [e for e in container["env"] if e["name"] == ROLLOUT_SECRET_VAR]
        assert secret == {"name": ROLLOUT_SECRET_VAR, "valueFrom": SECRET_FROM_SECRET}
        env = env_of(container)
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0"
        assert env["NCCL_DEBUG"] == "WARN"
        assert env["ALIGNFLOW_STAGE"] == "ppo" and env["ALIGNFLOW_SPEC_URI"] == spec_uri
    # Without rollout nodes the trainer's pods hold the replicas' GPUs, and no secret is asked for.
    _, job = render("ppo", PPO_TWO_NODES)
    assert gpus_of(job) == 4 + 4 and ROLLOUT_SECRET_VAR not in to_yaml([job])


def test_rollout_nodes_beside_several_trainer_nodes_and_on_the_host_network():
    sets = [*PPO_ROLLOUT_NODES, *PPO_TWO_NODES]
    service, job, rollout = render_with_rollout(sets)
    assert job["spec"]["completions"] == 2 and rollout["spec"]["completions"] == 3
    assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [
        ("rendezvous", 29500), ("rollout", 29600),
    ]
    assert [(p["name"], p["containerPort"]) for p in stage_container(job)["ports"]] == [
        ("rendezvous", 29500), ("rollout", 29600),
    ]
    # A fast fabric: both roles on their node's network and interface (one trainer pod: see the refusal).
    _, job, rollout = render_with_rollout(PPO_ROLLOUT_NODES, host_network=True, socket_ifname="ib0")
    for one in (job, rollout):
        pod = one["spec"]["template"]["spec"]
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert env_of(stage_container(one))["NCCL_SOCKET_IFNAME"] == "ib0"
        assert env_of(stage_container(one))["GLOO_SOCKET_IFNAME"] == "ib0"


def test_rollout_job_rendered_from_its_templates_example_is_the_template():
    """The rollout template's header example, rendered, gives the template back (plus the stage label):
    the file stays the one source of the rollout pod spec, and its example stays right."""
    overrides = re.findall(r"--set (\S+)", ROLLOUT_TEMPLATE.read_text())
    _, job, rollout = render_with_rollout(overrides)
    (static,) = load_yaml_docs(ROLLOUT_TEMPLATE)
    for doc in (rollout, rollout["spec"]["template"]):
        assert doc["metadata"]["labels"].pop("alignflow.dev/stage") == "ppo"
    assert rollout == static
    assert gpus_of(job) == 8  # the example's trainer: one pod of 8 ranks


def test_no_literal_secret_reaches_the_rendered_yaml(tmp_path):
    """The renderer never reads the secret: with it set in the environment, it is nowhere in the output;
    a rollout template that holds a literal one is refused."""
    canary = "canary-secret-0123456789abcdef"
    sets = [arg for override in PPO_ROLLOUT_NODES for arg in ("--set", override)]
    done = cli("--stage", "ppo", *sets, env={ROLLOUT_SECRET_VAR: canary})
    assert done.returncode == 0, done.stderr
    assert canary not in done.stdout
    objects = list(yaml.safe_load_all(done.stdout))
    assert objects == list(render_with_rollout(PPO_ROLLOUT_NODES))
    entries = [
        e for o in objects[1:] for e in stage_container(o)["env"] if e["name"] == ROLLOUT_SECRET_VAR
    ]
    assert len(entries) == 2 and all("value" not in e for e in entries)

    (template,) = load_yaml_docs(ROLLOUT_TEMPLATE)
    (entry,) = [e for e in stage_container(template)["env"] if e["name"] == ROLLOUT_SECRET_VAR]
    del entry["valueFrom"]
    entry["value"] = "hunter2hunter2hunter2"
    literal = tmp_path / "rollout.yaml"
    literal.write_text(yaml.safe_dump(template))
    config = load_config(CONFIG, PPO_ROLLOUT_NODES)
    with pytest.raises(ConfigError, match=rf"must take {ROLLOUT_SECRET_VAR} from a Secret .* never as"):
        render_multinode_job(config, "ppo", rollout_template=literal)


RL_HOST = r"alignflow-rl-0\.alignflow-rl-rdzv"


@pytest.mark.parametrize(
    ("stage", "overrides", "message"),
    [
        # One node: the default of the shipped config; one trainer node is for rollout nodes alone.
        (
            "ppo", [],
            rf"ppo\.resources\.nnodes: is 1; .* needs 2 or more \(or engine\.rollout_nodes >= 1: one "
            rf"trainer pod\) .* {RL_HOST}:29400",
        ),
        ("sft", [], r"sft\.resources\.nnodes: is 1; a multi-node Job needs 2 or more \(one node runs"),
        # The rollout endpoint: pod 0 of the trainer's Job (not the docs' old `trainer-0`, not a rollout
        # pod), a port of its own beside the rendezvous, a TCP port.
        (
            "ppo",
            [*PPO_ROLLOUT_NODES, "engine.rollout_endpoint=trainer-0.alignflow-rl-rdzv:29500"],
            r"engine\.rollout_endpoint: 'trainer-0\.alignflow-rl-rdzv:29500' does not name the "
            rf"trainer's pod 0 .*; expected {RL_HOST}:<port> \(e\.g\. {RL_HOST}:29500\)",
        ),
        (
            "ppo",
            [*PPO_ROLLOUT_NODES, "engine.rollout_endpoint=alignflow-rl-rollout-0:29500"],
            rf"engine\.rollout_endpoint: 'alignflow-rl-rollout-0:29500' does not name .* "
            rf"{RL_HOST}:<port>",
        ),
        (
            "ppo",
            [*PPO_ROLLOUT_NODES, *PPO_TWO_NODES, f"engine.rollout_endpoint={RL_ENDPOINT}"],
            r"engine\.rollout_endpoint: port 29500 is ppo\.resources\.rdzv_endpoint's too, .* pick "
            r"another, e\.g\. 29501",
        ),
        (
            "ppo",
            [*PPO_ROLLOUT_NODES, "engine.rollout_endpoint=alignflow-rl-0.alignflow-rl-rdzv:0"],
            r"engine\.rollout_endpoint: port '0' is not a TCP port",
        ),
        # One trainer node with a rendezvous endpoint elsewhere: its launcher would wait there for ever.
        (
            "ppo",
            [*PPO_ROLLOUT_NODES, "ppo.resources.rdzv_endpoint=alignflow-train-0.alignflow-rdzv:29400"],
            r"ppo\.resources\.rdzv_endpoint: 'alignflow-train-0\.alignflow-rdzv:29400' .* "
            rf"{RL_HOST}:<port>",
        ),
        # An endpoint that is not pod 0 of the stage's Job (the supervised Job's, an index other than 0).
        (
            "ppo",
            ["ppo.resources.nnodes=2",
             "ppo.resources.rdzv_endpoint=alignflow-train-0.alignflow-rdzv:29400"],
            r"ppo\.resources\.rdzv_endpoint: 'alignflow-train-0\.alignflow-rdzv:29400' does not name "
            rf"pod 0 of the Job; expected {RL_HOST}:<port>",
        ),
        (
            "sft",
            ["sft.resources.nnodes=3",
             "sft.resources.rdzv_endpoint=alignflow-train-1.alignflow-rdzv:29400"],
            r"sft\.resources\.rdzv_endpoint: .* expected alignflow-train-0\.alignflow-rdzv:<port>",
        ),
        (
            "ppo",
            ["ppo.resources.nnodes=2",
             "ppo.resources.rdzv_endpoint=alignflow-rl-0.alignflow-rl-rdzv:70000"],
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


def test_rollout_nodes_with_several_trainer_pods_on_the_host_network_are_refused():
    """On the host network a pod's name is its node's, so rank 0 (the rollout endpoint's) may be on any
    trainer pod; on the pod network, or with one trainer pod, it is pod 0."""
    config = load_config(CONFIG, [*PPO_ROLLOUT_NODES, *PPO_TWO_NODES])
    with pytest.raises(ConfigError, match=r"ppo\.resources\.nnodes: is 2 with --host-network and "
                       r"engine\.rollout_nodes=3: .* set ppo\.resources\.nnodes=1"):
        render_multinode_job(config, "ppo", host_network=True)
    assert len(render_multinode_job(config, "ppo")) == 3
    # Without rollout nodes the host network is the supervised case: rank 0 need not be pod 0.
    assert len(render_multinode_job(load_config(CONFIG, PPO_TWO_NODES), "ppo", host_network=True)) == 2


def test_host_network_and_another_interface_are_opt_in():
    _, job = render("ppo", PPO_TWO_NODES, host_network=True, socket_ifname="ib0",
                    spec_uri="s3://b/p/specs/ppo-1.json",
                    image="registry.example/alignflow/engine-vllm:9")
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
                    render("sft", overrides), render_with_rollout(PPO_ROLLOUT_NODES),
                    render_with_rollout([*PPO_ROLLOUT_NODES, *PPO_TWO_NODES]),
                    render_with_rollout(PPO_ROLLOUT_NODES, host_network=True)):
        for doc in objects:
            validate_k8s(doc, version)


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != ROLLOUT_SECRET_VAR} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "alignflow.cli", "k8s-job", str(CONFIG), *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=environ,
    )


def test_cli_prints_the_objects_as_yaml_and_refuses_with_the_key():
    sets = [arg for override in PPO_TWO_NODES for arg in ("--set", override)]
    done = cli("--stage", "ppo", *sets)
    assert done.returncode == 0, done.stderr
    assert list(yaml.safe_load_all(done.stdout)) == list(render("ppo", PPO_TWO_NODES))
    assert done.stdout == to_yaml(list(render("ppo", PPO_TWO_NODES)))
    done = cli("--stage", "ppo", *sets, "--host-network", "--socket-ifname", "ib0",
               "--spec-uri", "s3://b/s.json")
    assert done.returncode == 0, done.stderr
    (_, job) = yaml.safe_load_all(done.stdout)
    assert job["spec"]["template"]["spec"]["hostNetwork"] is True
    assert env_of(stage_container(job))["NCCL_SOCKET_IFNAME"] == "ib0"
    done = cli("--stage", "ppo")
    assert done.returncode == 2 and done.stdout == ""
    assert "error: ppo.resources.nnodes: is 1" in done.stderr


def test_cli_writes_a_file_per_job_to_apply_with_kubectl(tmp_path):
    sets = [arg for override in PPO_ROLLOUT_NODES for arg in ("--set", override)]
    out = tmp_path / "manifests"
    done = cli("--stage", "ppo", *sets, "--output", str(out))
    assert done.returncode == 0, done.stderr
    trainer, rollout = out / "alignflow-rl.yaml", out / "alignflow-rl-rollout.yaml"
    assert set(out.iterdir()) == {trainer, rollout}
    service, job, rollout_job = render_with_rollout(PPO_ROLLOUT_NODES)
    assert trainer.read_text() == to_yaml([service, job])
    assert rollout.read_text() == to_yaml([rollout_job])
    # What it prints: the files, and the command that creates them in order (the trainer first).
    assert done.stdout.splitlines()[-1] == f"kubectl create -f {trainer} -f {rollout}"
    assert f"wrote {trainer}" in done.stdout and f"wrote {rollout}" in done.stdout
    # A refused config writes nothing.
    done = cli("--stage", "ppo", "--output", str(tmp_path / "none"))
    assert done.returncode == 2 and not (tmp_path / "none").exists()


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
        pytest.skip("kubectl's client dry-run needs an API server for discovery; none is reachable")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["service/alignflow-rl-rdzv", "job.batch/alignflow-rl"]
