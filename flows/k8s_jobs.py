"""Render a training stage's multi-node Kubernetes Job (Indexed Job and headless Service) from its config.

The pod spec is `infra/k8s/job-stage-training-multinode.yaml`'s: that file is the template (and, edited by
hand, a Job of its own), and this module fills in what the config decides: the stage, its spec, the node
count (`completions` = `parallelism` = `<stage>.resources.nnodes`), the GPUs per pod, the image, and the
names and port of the rendezvous, which must be the ones `<stage>.resources.rdzv_endpoint` names (pod 0:
`<Job name>-0.<Service name>:<port>`), or the pods would never meet. The supervised stages (sft, reward, dpo)
keep the template's names; the RL stage (ppo) gets its own Job and Service, so that both can exist.

NCCL's needs are in the pod: the memory-backed /dev/shm of the template, NCCL_SOCKET_IFNAME and
GLOO_SOCKET_IFNAME (the interface the ranks talk over: the pod's own, eth0, by default) and NCCL_DEBUG=WARN.
`host_network=True` is the opt-in for a fast fabric the pod network does not reach (the ranks then use the
node's interfaces; the namespace's restricted Pod Security Standard refuses such pods: docs/production.md).

What it is not: a deployer (kubectl applies what it returns: `alignflow k8s-job CONFIG --stage ppo | kubectl
create -f -`), nor the GPU work pool's flow-run Job (one pod per flow run, infra/work-pools/kubernetes.json).
Torch-free and Prefect-free: the CLI imports it without starting either.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from alignflow.config import ConfigError, PipelineConfig

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "infra" / "k8s" / "job-stage-training-multinode.yaml"
MULTINODE_STAGES = ("sft", "reward", "dpo", "ppo")
# The RL stage's own names: a supervised stage's Job (the template's names) and the RL stage's can coexist.
RL_JOB_NAME = "alignflow-rl"
RL_SERVICE_NAME = "alignflow-rl-rdzv"
# The images whose engine package the RL stage needs in-process or in its rollout workers (the GPU pool's
# `image` variable says the same); other backends run in the template's alignflow/training image.
ENGINE_IMAGES = {"vllm": "alignflow/engine-vllm", "tensorrt-llm": "alignflow/engine-tensorrt-llm"}
CONTAINER = "stage"


def load_template(path: Path = TEMPLATE) -> tuple[dict[str, Any], dict[str, Any]]:
    """The template's headless Service and Indexed Job."""
    if not path.is_file():
        raise ConfigError(
            f"{path}: the multi-node Job template is missing (it is in the source checkout, not the "
            "installed package): pass the path of infra/k8s/job-stage-training-multinode.yaml"
        )
    docs = {doc["kind"]: doc for doc in yaml.safe_load_all(path.read_text()) if doc}
    return docs["Service"], docs["Job"]


def job_names(stage: str, template: Path = TEMPLATE) -> tuple[str, str]:
    """(Job name, headless Service name) of `stage`'s multi-node Job."""
    if stage == "ppo":
        return RL_JOB_NAME, RL_SERVICE_NAME
    service, job = load_template(template)
    return job["metadata"]["name"], service["metadata"]["name"]


def rendezvous_host(stage: str, template: Path = TEMPLATE) -> str:
    """The DNS name of pod 0 of `stage`'s Job, the host part `<stage>.resources.rdzv_endpoint` must have."""
    job, service = job_names(stage, template)
    return f"{job}-0.{service}"


def default_spec_uri(config: PipelineConfig, stage: str) -> str | None:
    """Where the docs have the stage's spec uploaded: `<storage.root>/specs/<stage>.json` on S3 (None on a
    file:// root, which no pod reads)."""
    root = config.storage.root.rstrip("/")
    return f"{root}/specs/{stage}.json" if root.startswith("s3://") else None


def pod_gpus(config: PipelineConfig, stage: str) -> int:
    """GPUs each pod requests: one per rank, and for the RL stage its rollout replicas' too.

    The replicas run beside rank 0 (their store and gloo group bind to 127.0.0.1:
    stages/ppo/rollout_workers.py), so only pod 0 uses them; an Indexed Job's pods share one spec, so every
    pod asks for them and the other nodes leave them idle.
    """
    gpus = getattr(config, stage).resources.nproc_per_node
    if stage == "ppo" and config.engine.rollout_workers:
        gpus += config.engine.rollout_workers * config.engine.tensor_parallel_size
    return gpus


def stage_image(config: PipelineConfig, stage: str, template_image: str) -> str:
    """The stage's image: deployment.stage_infra's when set; for the RL stage with the vllm or tensorrt-llm
    engine, that engine's image (same tag as the template's); else the template's."""
    infra = config.deployment.stage_infra.get(stage)
    if infra is not None and infra.image:
        return infra.image
    if stage == "ppo" and config.engine.backend in ENGINE_IMAGES:
        tag = template_image.rpartition(":")[2] if ":" in template_image else "latest"
        return f"{ENGINE_IMAGES[config.engine.backend]}:{tag}"
    return template_image


def check_rendezvous(config: PipelineConfig, stage: str, template: Path = TEMPLATE) -> int:
    """The rendezvous port, once `<stage>.resources` fits a multi-node Job; ConfigError naming each key
    that does not, with the value it needs."""
    if stage not in MULTINODE_STAGES:
        raise ConfigError(
            f"stage {stage!r} has no multi-node Job; valid stages: {', '.join(MULTINODE_STAGES)}"
        )
    resources = getattr(config, stage).resources
    key = f"{stage}.resources"
    host = rendezvous_host(stage, template)
    if resources.nnodes < 2:
        raise ConfigError(
            f"{key}.nnodes: is {resources.nnodes}; a multi-node Job needs 2 or more (one node runs as "
            f"infra/k8s/job-stage-training.yaml or a flow run of the GPU pool), with {key}.rdzv_endpoint "
            f"{host}:29400"
        )
    endpoint = resources.rdzv_endpoint or ""
    got_host, _, port_text = endpoint.rpartition(":")
    port = int(port_text) if port_text.isdigit() else 0
    problems = []
    if got_host != host:
        problems.append(
            f"{key}.rdzv_endpoint: {endpoint!r} does not name pod 0 of the Job; expected {host}:<port> (e.g. "
            f"{host}:29400): <Job name>-0.<headless Service name>"
        )
    if not 1 <= port <= 65535:
        problems.append(f"{key}.rdzv_endpoint: port {port_text!r} is not a TCP port (1-65535, e.g. 29400)")
    if problems:
        raise ConfigError(
            f"{len(problems)} problem(s) with the multi-node Job:\n  - " + "\n  - ".join(problems)
        )
    return port


def render_multinode_job(
    config: PipelineConfig,
    stage: str,
    *,
    spec_uri: str | None = None,
    image: str | None = None,
    host_network: bool = False,
    socket_ifname: str = "eth0",
    template: Path = TEMPLATE,
) -> list[dict[str, Any]]:
    """`stage`'s headless Service and Indexed Job, as Kubernetes objects (ConfigError when the config does
    not fit one: see check_rendezvous).

    spec_uri: the stage spec the pods read (default `<storage.root>/specs/<stage>.json` on an S3 root);
    image: the container image (default: stage_image); host_network: the pods use their node's network
    (a fast fabric the pod network does not reach); socket_ifname: the interface NCCL and gloo use.
    """
    port = check_rendezvous(config, stage, template)
    spec_uri = spec_uri or default_spec_uri(config, stage)
    if not spec_uri:
        raise ConfigError(
            f"storage.root: {config.storage.root!r} is not on S3, so the pods have no spec to read: upload "
            f"the stage's spec and pass its URI (--spec-uri s3://...)"
        )
    job_name, service_name = job_names(stage, template)
    service, job = (copy.deepcopy(doc) for doc in load_template(template))
    resources = getattr(config, stage).resources

    def labels(base: dict[str, str]) -> dict[str, str]:  # a fresh dict each time: the template shares one
        return {**base, "alignflow.dev/stage": stage}

    service["metadata"]["name"] = service_name
    service["metadata"]["labels"] = labels(service["metadata"]["labels"])
    service["spec"]["selector"] = {"batch.kubernetes.io/job-name": job_name}
    (service_port,) = service["spec"]["ports"]
    service_port.update(port=port, targetPort=port)

    job_labels = job["metadata"]["labels"]
    job["metadata"]["name"] = job_name
    job["metadata"]["labels"] = labels(job_labels)
    spec = job["spec"]
    spec["completions"] = spec["parallelism"] = resources.nnodes
    spec["template"]["metadata"]["labels"] = labels(job_labels)
    pod = spec["template"]["spec"]
    pod["subdomain"] = service_name
    if host_network:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"  # the headless Service's names still resolve
    (container,) = [c for c in pod["containers"] if c["name"] == CONTAINER]
    container["image"] = image or stage_image(config, stage, container["image"])
    (container_port,) = container["ports"]
    container_port["containerPort"] = port
    env = {item["name"]: item for item in container["env"]}
    values = {
        "ALIGNFLOW_STAGE": stage,
        "ALIGNFLOW_SPEC_URI": spec_uri,
        "NCCL_SOCKET_IFNAME": socket_ifname,
        "GLOO_SOCKET_IFNAME": socket_ifname,
    }
    for name, value in values.items():
        env.setdefault(name, {"name": name})["value"] = value
    container["env"] = list(env.values())
    gpus = pod_gpus(config, stage)
    container["resources"]["requests"]["nvidia.com/gpu"] = gpus
    container["resources"]["limits"]["nvidia.com/gpu"] = gpus
    return [service, job]


class _PlainDumper(yaml.SafeDumper):
    """Writes repeated objects out in full (no &id001 anchors): kubectl reads either, people read this."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """The objects as one multi-document YAML stream, keys in the template's order."""
    return yaml.dump_all(objects, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)
