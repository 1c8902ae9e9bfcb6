"""Render a training stage's multi-node Kubernetes Jobs (Indexed Jobs, headless Service) from its config.

The pod spec is `infra/k8s/job-stage-training-multinode.yaml`'s: that file is the template (and, edited
by hand, a Job of its own), and this module fills in what the config decides: the stage, its spec, the
node count (`completions` = `parallelism` = `<stage>.resources.nnodes`), the GPUs per pod, the image, and
the names and port of the rendezvous, which must be the ones `<stage>.resources.rdzv_endpoint` names (pod
0: `<Job name>-0.<Service name>:<port>`), or the pods would never meet. The supervised stages (sft,
reward, dpo) keep the template's names; the RL stage (ppo) gets its own Job and Service, so that both can
exist.

The RL stage with rollout nodes (engine.rollout_nodes >= 1) gets a second Indexed Job, one pod per
rollout node, on the pod spec of `infra/k8s/job-stage-rollout-nodes.yaml`: the stage's command plus
`--rollout-node $(JOB_COMPLETION_INDEX)`, rollout_workers / rollout_nodes x tensor_parallel_size GPUs,
the role label `alignflow.dev/role: rollout`. Its pods connect to the trainer's rank 0 at
engine.rollout_endpoint, which must name the trainer Job's pod 0 too: the elastic launcher gives rank 0
to the node whose name (FQDN) sorts first, and `<Job name>-0.` sorts first among the Job's pods. The
trainer's pods then ask only for their ranks' GPUs (one trainer pod is enough), and both roles read
ALIGNFLOW_ROLLOUT_SECRET from the Secret the rollout template names, never from a literal.

NCCL's needs are in the pod: the memory-backed /dev/shm of the template, NCCL_SOCKET_IFNAME and
GLOO_SOCKET_IFNAME (the interface the ranks talk over: the pod's own, eth0, by default) and
NCCL_DEBUG=WARN. `host_network=True` is the opt-in for a fast fabric the pod network does not reach (the
ranks then use the node's interfaces; the namespace's restricted Pod Security Standard refuses such pods:
docs/production.md).

What it is not: a deployer (kubectl applies what it returns: `alignflow k8s-job CONFIG --stage ppo |
kubectl create -f -`, or the files of `--output DIR`), nor the GPU work pool's flow-run Job (one pod per
flow run, infra/work-pools/kubernetes.json). Torch-free and Prefect-free: the CLI imports it without
starting either.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from alignflow.config import ROLLOUT_SECRET_VAR, ConfigError, PipelineConfig

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "infra" / "k8s" / "job-stage-training-multinode.yaml"
ROLLOUT_TEMPLATE = REPO / "infra" / "k8s" / "job-stage-rollout-nodes.yaml"
MULTINODE_STAGES = ("sft", "reward", "dpo", "ppo")
# The RL stage's own names: a supervised stage's Job (the template's names) and the RL stage's can
# coexist.
RL_JOB_NAME = "alignflow-rl"
RL_SERVICE_NAME = "alignflow-rl-rdzv"
# The images whose engine package the RL stage needs in-process or in its rollout workers (the GPU
# pool's `image` variable says the same); other backends run in the template's alignflow/training image.
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


def load_rollout_template(path: Path = ROLLOUT_TEMPLATE) -> dict[str, Any]:
    """The rollout nodes' Indexed Job of the template; ConfigError unless its container takes the shared
    secret from a Secret (a literal value would sit in the manifest, readable by all who read Jobs)."""
    if not path.is_file():
        raise ConfigError(
            f"{path}: the rollout nodes' Job template is missing (it is in the source checkout, not "
            "the installed package): pass the path of infra/k8s/job-stage-rollout-nodes.yaml"
        )
    (job,) = [doc for doc in yaml.safe_load_all(path.read_text()) if doc and doc["kind"] == "Job"]
    secret = secret_env(job_container(job))
    if secret is None or "value" in secret or "secretKeyRef" not in secret.get("valueFrom", {}):
        raise ConfigError(
            f"{path}: the rollout container must take {ROLLOUT_SECRET_VAR} from a Secret (env: "
            f"name {ROLLOUT_SECRET_VAR}, valueFrom.secretKeyRef), never as a literal value"
        )
    return job


def job_container(job: dict[str, Any]) -> dict[str, Any]:
    """The Job's stage container."""
    containers = job["spec"]["template"]["spec"]["containers"]
    (container,) = [c for c in containers if c["name"] == CONTAINER]
    return container


def secret_env(container: dict[str, Any]) -> dict[str, Any] | None:
    """The container's env entry for the rollout queues' shared secret, if any."""
    env = container.get("env", [])
    return next((item for item in env if item["name"] == ROLLOUT_SECRET_VAR), None)


def job_names(stage: str, template: Path = TEMPLATE) -> tuple[str, str]:
    """(Job name, headless Service name) of `stage`'s multi-node Job."""
    if stage == "ppo":
        return RL_JOB_NAME, RL_SERVICE_NAME
    service, job = load_template(template)
    return job["metadata"]["name"], service["metadata"]["name"]


def rendezvous_host(stage: str, template: Path = TEMPLATE) -> str:
    """The DNS name of pod 0 of `stage`'s Job: the host part `<stage>.resources.rdzv_endpoint` (and the
    RL stage's engine.rollout_endpoint) must have."""
    job, service = job_names(stage, template)
    return f"{job}-0.{service}"


def default_spec_uri(config: PipelineConfig, stage: str) -> str | None:
    """Where the docs have the stage's spec uploaded: `<storage.root>/specs/<stage>.json` on S3 (None on
    a file:// root, which no pod reads)."""
    root = config.storage.root.rstrip("/")
    return f"{root}/specs/{stage}.json" if root.startswith("s3://") else None


def rollout_nodes(config: PipelineConfig, stage: str) -> int:
    """The rollout nodes `stage`'s Jobs include: engine.rollout_nodes for the RL stage, else none."""
    return config.engine.rollout_nodes if stage == "ppo" else 0


def pod_gpus(config: PipelineConfig, stage: str) -> int:
    """GPUs each trainer pod requests: one per rank, and for the RL stage without rollout nodes its
    rollout replicas' too.

    Those replicas run beside rank 0 (their store and gloo group bind to 127.0.0.1:
    stages/ppo/rollout_workers.py), so only pod 0 uses them; an Indexed Job's pods share one spec, so
    every pod asks for them and the other nodes leave them idle. With rollout nodes, no replica runs
    beside the trainer.
    """
    gpus = getattr(config, stage).resources.nproc_per_node
    if stage == "ppo" and config.engine.rollout_workers and not config.engine.rollout_nodes:
        gpus += config.engine.rollout_workers * config.engine.tensor_parallel_size
    return gpus


def rollout_pod_gpus(config: PipelineConfig) -> int:
    """GPUs each rollout pod requests: its share of the replicas (engine.rollout_workers spread evenly
    over engine.rollout_nodes, which the config checks), tensor_parallel_size processes each, a GPU
    apiece (stages/ppo/rollout_nodes.py: gpus_of_node)."""
    engine = config.engine
    return engine.rollout_workers // engine.rollout_nodes * engine.tensor_parallel_size


def stage_image(config: PipelineConfig, stage: str, template_image: str) -> str:
    """The stage's image: deployment.stage_infra's when set; for the RL stage with the vllm or
    tensorrt-llm engine, that engine's image (same tag as the template's); else the template's."""
    infra = config.deployment.stage_infra.get(stage)
    if infra is not None and infra.image:
        return infra.image
    if stage == "ppo" and config.engine.backend in ENGINE_IMAGES:
        tag = template_image.rpartition(":")[2] if ":" in template_image else "latest"
        return f"{ENGINE_IMAGES[config.engine.backend]}:{tag}"
    return template_image


@dataclass(frozen=True)
class Ports:
    """What the trainer's pod 0 listens on for the others: the launcher's rendezvous
    (resources.rdzv_endpoint; None for one trainer node without one) and rank 0's refit store
    (engine.rollout_endpoint; None without rollout nodes)."""

    rendezvous: int | None
    rollout: int | None


def _pod0_port(problems: list[str], key: str, endpoint: str | None, host: str, example: int,
               what: str) -> int | None:
    """The port of `endpoint` once its host is `host` (pod 0's name); else a problem naming `key`."""
    endpoint = endpoint or ""
    got_host, _, port_text = endpoint.rpartition(":")
    port = int(port_text) if port_text.isdigit() else 0
    if got_host != host:
        problems.append(
            f"{key}: {endpoint!r} does not name {what}; expected {host}:<port> (e.g. "
            f"{host}:{example}): <Job name>-0.<headless Service name>"
        )
    if not 1 <= port <= 65535:
        problems.append(f"{key}: port {port_text!r} is not a TCP port (1-65535, e.g. {example})")
        return None
    return port


def check_layout(
    config: PipelineConfig, stage: str, template: Path = TEMPLATE, *, host_network: bool = False
) -> Ports:
    """The ports of the trainer's pod 0, once `<stage>.resources` (and for the RL stage with rollout
    nodes, engine.rollout_endpoint) fit the Jobs; ConfigError naming each key that does not, with the
    value it needs."""
    if stage not in MULTINODE_STAGES:
        raise ConfigError(
            f"stage {stage!r} has no multi-node Job; valid stages: {', '.join(MULTINODE_STAGES)}"
        )
    resources = getattr(config, stage).resources
    key = f"{stage}.resources"
    host = rendezvous_host(stage, template)
    nodes = rollout_nodes(config, stage)
    if resources.nnodes < 2 and not nodes:
        rollout = " (or engine.rollout_nodes >= 1: one trainer pod)" if stage == "ppo" else ""
        raise ConfigError(
            f"{key}.nnodes: is {resources.nnodes}; a multi-node Job needs 2 or more{rollout} (one node "
            "runs as infra/k8s/job-stage-training.yaml or a flow run of the GPU pool), with "
            f"{key}.rdzv_endpoint {host}:29400"
        )
    problems: list[str] = []
    rendezvous = None
    # One trainer node needs no rendezvous endpoint; given one, the launcher uses it: it must be pod 0's.
    if resources.nnodes >= 2 or resources.rdzv_endpoint:
        rendezvous = _pod0_port(
            problems, f"{key}.rdzv_endpoint", resources.rdzv_endpoint, host, 29400, "pod 0 of the Job"
        )
    rollout_port = None
    if nodes:
        rollout_port = _pod0_port(
            problems, "engine.rollout_endpoint", config.engine.rollout_endpoint, host, 29500,
            "the trainer's pod 0 (rank 0, which rollout pods reach through the headless Service)",
        )
        if rollout_port is not None and rollout_port == rendezvous:
            problems.append(
                f"engine.rollout_endpoint: port {rollout_port} is {key}.rdzv_endpoint's too, and pod 0 "
                f"listens on both (the launcher's rendezvous, rank 0's refit store); pick another, e.g. "
                f"{rendezvous + 1 if rendezvous < 65535 else rendezvous - 1}"
            )
        if host_network and resources.nnodes >= 2:
            problems.append(
                f"{key}.nnodes: is {resources.nnodes} with --host-network and "
                f"engine.rollout_nodes={nodes}: host-network pods carry their node's hostname, the "
                "launcher gives rank 0 to the node whose name sorts first, so rank 0 need not be pod 0, "
                f"which engine.rollout_endpoint names; set {key}.nnodes=1 (one trainer pod) or use the "
                "pod network"
            )
    if problems:
        raise ConfigError(
            f"{len(problems)} problem(s) with the multi-node Job:\n  - " + "\n  - ".join(problems)
        )
    return Ports(rendezvous, rollout_port)


def render_multinode_job(
    config: PipelineConfig,
    stage: str,
    *,
    spec_uri: str | None = None,
    image: str | None = None,
    host_network: bool = False,
    socket_ifname: str = "eth0",
    template: Path = TEMPLATE,
    rollout_template: Path = ROLLOUT_TEMPLATE,
) -> list[dict[str, Any]]:
    """`stage`'s headless Service and Indexed Job, and for the RL stage with rollout nodes the rollout
    nodes' Indexed Job, as Kubernetes objects (ConfigError when the config does not fit them: see
    check_layout).

    spec_uri: the stage spec the pods read (default `<storage.root>/specs/<stage>.json` on an S3 root);
    image: the container image (default: stage_image); host_network: the pods use their node's network
    (a fast fabric the pod network does not reach); socket_ifname: the interface NCCL and gloo use.
    """
    ports = check_layout(config, stage, template, host_network=host_network)
    spec_uri = spec_uri or default_spec_uri(config, stage)
    if not spec_uri:
        raise ConfigError(
            f"storage.root: {config.storage.root!r} is not on S3, so the pods have no spec to read: "
            "upload the stage's spec and pass its URI (--spec-uri s3://...)"
        )
    nodes = rollout_nodes(config, stage)
    rollout = copy.deepcopy(load_rollout_template(rollout_template)) if nodes else None
    job_name, service_name = job_names(stage, template)
    service, job = (copy.deepcopy(doc) for doc in load_template(template))
    resources = getattr(config, stage).resources

    def labels(base: dict[str, str]) -> dict[str, str]:  # a fresh dict each time: templates share one
        return {**base, "alignflow.dev/stage": stage}

    # One image for both roles: the trainer template's tag (a rollout pod runs the same stage program).
    pod_image = image or stage_image(config, stage, job_container(job)["image"])

    def fill_pod(job: dict[str, Any], completions: int, gpus: int) -> dict[str, Any]:
        """What both roles' Jobs take from the config; returns the stage container."""
        job_labels = job["metadata"]["labels"]
        job["metadata"]["labels"] = labels(job_labels)
        spec = job["spec"]
        spec["completions"] = spec["parallelism"] = completions
        spec["template"]["metadata"]["labels"] = labels(job_labels)
        pod = spec["template"]["spec"]
        if host_network:
            pod["hostNetwork"] = True
            pod["dnsPolicy"] = "ClusterFirstWithHostNet"  # the headless Service's names still resolve
        container = job_container(job)
        container["image"] = pod_image
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
        container["resources"]["requests"]["nvidia.com/gpu"] = gpus
        container["resources"]["limits"]["nvidia.com/gpu"] = gpus
        return container

    # Pod 0's ports: the rendezvous (the template's one entry) and, with rollout nodes, rank 0's refit
    # store (what a NetworkPolicy would open; the headless Service's DNS names need no port).
    named = {"rendezvous": ports.rendezvous, "rollout": ports.rollout}
    service["metadata"]["name"] = service_name
    service["metadata"]["labels"] = labels(service["metadata"]["labels"])
    service["spec"]["selector"] = {"batch.kubernetes.io/job-name": job_name}
    (service_port,) = service["spec"]["ports"]
    service["spec"]["ports"] = [
        {**service_port, "name": name, "port": port, "targetPort": port}
        for name, port in named.items()
        if port
    ]

    job["metadata"]["name"] = job_name
    container = fill_pod(job, resources.nnodes, pod_gpus(config, stage))
    job["spec"]["template"]["spec"]["subdomain"] = service_name
    (container_port,) = container["ports"]
    container["ports"] = [
        {**container_port, "name": name, "containerPort": port} for name, port in named.items() if port
    ]
    if rollout is None:
        return [service, job]
    # The trainer reads the shared secret from the rollout pods' Secret (the rollout template's entry).
    container["env"].append(copy.deepcopy(secret_env(job_container(rollout))))
    fill_pod(rollout, nodes, rollout_pod_gpus(config))
    return [service, job, rollout]


def write_manifests(objects: list[dict[str, Any]], directory: Path) -> list[Path]:
    """Write the objects to `directory`, one file per Job (`<Job name>.yaml`, with the objects before
    it: its Service); returns the paths, in the order `kubectl create -f` should take them."""
    directory.mkdir(parents=True, exist_ok=True)
    paths, pending = [], []
    for obj in objects:
        pending.append(obj)
        if obj["kind"] == "Job":
            path = directory / f"{obj['metadata']['name']}.yaml"
            path.write_text(to_yaml(pending))
            paths.append(path)
            pending = []
    return paths


class _PlainDumper(yaml.SafeDumper):
    """Writes repeated objects out in full (no &id001 anchors): kubectl reads either, people this."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def to_yaml(objects: list[dict[str, Any]]) -> str:
    """The objects as one multi-document YAML stream, keys in the template's order."""
    return yaml.dump_all(objects, Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)
