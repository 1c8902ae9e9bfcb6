"""Rollout replicas on nodes of their own: rank 0's authenticated queue server, and a rollout node's life.

What it is: the transport that lets `RolloutWorkers` keep its work queue, refit and failure reports when its
replicas run on other machines (engine.rollout_nodes >= 1). The worker processes are the same `worker_main`
as on rank 0's node; only three things change.
- The queues: rank 0 starts a `multiprocessing` manager (TCP, an HMAC challenge with the shared secret
  of ALIGNFLOW_ROLLOUT_SECRET, so only holders of the secret reach its unpickling) serving the task and
  result queues. Every message crosses it pickled by the standard pickler (`PickledQueue`): torch's
  multiprocessing reductions would hand tensors over as shared-memory handles that mean nothing elsewhere.
- The meeting point: rank 0's refit TCPStore listens on engine.rollout_endpoint's port, and holds the queue
  server's port under QUEUES_KEY; a rollout node connects to the store, reads it, and its workers join the
  refit groups over the network (gloo binds the address that routes towards rank 0).
- Liveness: there is no exit code across machines. Each node's host process (`serve_node`) puts a beat on the
  result queue every HEARTBEAT_S and reports every child's exit; rank 0 names a node silent for SILENT_AFTER_S
  as lost, with every replica on it.

What it is not: a scheduler. Each rollout node runs the stage's command with `--rollout-node I` (an Indexed
Job's pod, say); rank 0 waits for all of them when it opens the rollout workers.
"""

from __future__ import annotations

import json
import os
import pickle
import queue
import socket
import sys
import time
from datetime import timedelta
from multiprocessing.managers import BaseManager
from typing import Any

from alignflow.config import ROLLOUT_SECRET_MIN_CHARS, ROLLOUT_SECRET_VAR
from alignflow.stages.common.ranks import address_towards

QUEUES_KEY = "alignflow/rollout/queues"
# How often a node's host process says it is alive, and the silence after which rank 0 names it lost: long
# enough for a busy 2-core box to schedule the beat, short enough to name a dead node within seconds.
HEARTBEAT_S = 1.0
SILENT_AFTER_S = 10.0
# How often a node's host looks at its worker processes.
WATCH_S = 0.1


class RolloutNodeError(RuntimeError):
    """A rollout node cannot start or serve: the message says what to fix."""


def read_secret(role: str) -> bytes:
    """The shared secret both sides authenticate the queues with; refuses a missing or short one."""
    secret = os.environ.get(ROLLOUT_SECRET_VAR, "")
    if len(secret) < ROLLOUT_SECRET_MIN_CHARS:
        state = "is not set" if not secret else f"has {len(secret)} characters"
        raise RolloutNodeError(
            f"{role} needs the shared secret of the rollout queues in {ROLLOUT_SECRET_VAR} (at least "
            f"{ROLLOUT_SECRET_MIN_CHARS} characters, the same on the trainer and every rollout node), "
            f"but it {state}; "
            "e.g. `export ALIGNFLOW_ROLLOUT_SECRET=$(openssl rand -hex 32)`, on Kubernetes from a Secret"
        )
    return secret.encode()


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.rpartition(":")
    return host, int(port)


# The queues live in the manager's own process (rank 0's node).
_served: dict[str, queue.Queue] = {}


def _serve_tasks() -> queue.Queue:
    return _served.setdefault("tasks", queue.Queue())


def _serve_results() -> queue.Queue:
    return _served.setdefault("results", queue.Queue())


class _QueueManager(BaseManager):
    pass


_QueueManager.register("tasks", callable=_serve_tasks)
_QueueManager.register("results", callable=_serve_results)


class PickledQueue:
    """A queue proxy whose messages travel as standard pickles (see the module's docstring); picklable into a
    spawned worker, where the proxy reconnects with the secret."""

    def __init__(self, proxy: Any):
        self.proxy = proxy

    def put(self, message: Any) -> None:
        self.proxy.put(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def get(self, timeout: float | None = None) -> Any:
        return pickle.loads(self.proxy.get(timeout=timeout))  # noqa: S301 - from a holder of the secret

    def get_nowait(self) -> Any:
        return pickle.loads(self.proxy.get_nowait())  # noqa: S301 - from a holder of the secret


class QueueServer:
    """Rank 0's side: the manager process serving the queues, on a free port of every interface."""

    def __init__(self, secret: bytes, ctx: Any):
        self._manager = _QueueManager(address=("", 0), authkey=secret, ctx=ctx)
        self._manager.start()
        self.port = self._manager.address[1]
        self.tasks = PickledQueue(self._manager.tasks())
        self.results = PickledQueue(self._manager.results())

    def close(self) -> None:
        self._manager.shutdown()


def connect_queues(host: str, port: int, secret: bytes) -> tuple[PickledQueue, PickledQueue]:
    """A rollout node's (tasks, results) on rank 0's queue server."""
    from multiprocessing import AuthenticationError

    manager = _QueueManager(address=(host, port), authkey=secret)
    try:
        manager.connect()
    except AuthenticationError:
        raise RolloutNodeError(
            f"the trainer's queue server at {host}:{port} refused this node's secret: {ROLLOUT_SECRET_VAR} "
            "must hold the same value on the trainer and on every rollout node"
        ) from None
    return PickledQueue(manager.tasks()), PickledQueue(manager.results())


def connect_store(endpoint: str, world_size: int, timeout_s: float) -> Any:
    """A client of rank 0's refit store at `endpoint`, once rank 0 has published its queue server there; the
    wait is bounded by `timeout_s` (rank 0 loads its models before it opens the store)."""
    import torch.distributed as dist

    host, port = split_endpoint(endpoint)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store = dist.TCPStore(host, port, world_size, False, timedelta(seconds=timeout_s))
            store.wait([QUEUES_KEY], timedelta(seconds=max(1.0, deadline - time.monotonic())))
            return store
        except (RuntimeError, OSError) as exc:  # not listening yet, or the key is not there yet
            if time.monotonic() > deadline:
                raise RolloutNodeError(
                    f"no trainer answered at engine.rollout_endpoint={endpoint} within {timeout_s:.0f} s "
                    f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); check that the endpoint is "
                    "rank 0's address and that its stage is running"
                ) from None
            time.sleep(1.0)


def replicas_of_node(node: int, nodes: int, replicas: int) -> range:
    """The replica indices rollout node `node` of `nodes` runs: an even, contiguous share."""
    per_node = replicas // nodes
    return range(node * per_node, (node + 1) * per_node)


def gpus_of_node(node: int, processes: int, device: str | None) -> list[int | None]:
    """The CUDA device each of a rollout node's processes takes: GPU i for its i-th (None each off CUDA,
    where `device` names the device); refuses a node with fewer GPUs than processes."""
    if device is not None:
        return [None] * processes
    import torch

    count = torch.cuda.device_count()
    if count < processes:
        raise RolloutNodeError(
            f"rollout node {node} runs {processes} engine processes (its replicas x "
            f"engine.tensor_parallel_size) but sees {count} GPU(s); give it {processes} GPUs, or lower "
            "engine.rollout_workers per engine.rollout_nodes"
        )
    return list(range(processes))


def serve_node(engine_dir: str, node: int, engine_cfg: Any, device: str | None) -> int:
    """Rollout node `node`'s whole life: meet rank 0, start this node's replicas (k processes each), beat, and
    report their exits; returns the exit code (0 once rank 0 stopped the replicas)."""
    import multiprocessing as mp

    import torch

    from alignflow.stages.common.generation.interface import read_engine_config
    from alignflow.stages.common.generation.worker_python import resolve, spawning_under
    from alignflow.stages.ppo.rollout_workers import WorkerSettings, default_threads, worker_main

    secret = read_secret(f"rollout node {node}")
    nodes, replicas = engine_cfg.rollout_nodes, engine_cfg.rollout_workers
    tp = engine_cfg.tensor_parallel_size
    if not 0 <= node < nodes:
        raise RolloutNodeError(f"--rollout-node {node} is not in [0, engine.rollout_nodes={nodes})")
    processes = replicas * tp
    interpreter = resolve(engine_cfg.worker_python, read_engine_config(engine_dir)["backend"])
    host, port = split_endpoint(engine_cfg.rollout_endpoint)
    store = connect_store(engine_cfg.rollout_endpoint, processes + 1, engine_cfg.rollout_timeout_s + 900.0)
    queue_port = json.loads(store.get(QUEUES_KEY))["port"]
    tasks, results = connect_queues(host, queue_port, secret)
    mine = replicas_of_node(node, nodes, replicas)
    local = len(mine) * tp
    gpus = gpus_of_node(node, local, device)
    threads = engine_cfg.rollout_worker_threads or default_threads(local)
    place = {"node": node, "host": socket.gethostname(), "address": address_towards(host), "pid": os.getpid()}
    results.put(("node", node, place, [r * tp + j for r in mine for j in range(tp)]))
    ctx = mp.get_context("spawn")
    children: dict[int, Any] = {}
    follower_queues = {r * tp + j: ctx.Queue() for r in mine for j in range(1, tp)}
    for position, (replica, tp_rank) in enumerate((r, j) for r in mine for j in range(tp)):
        index = replica * tp + tp_rank
        settings = WorkerSettings(index, engine_dir, threads, host, port, processes + 1,
                                  engine_cfg.rollout_timeout_s, device, replica, tp_rank, tp,
                                  bind_host=place["address"], node=node, gpu=gpus[position],
                                  refit_backend=engine_cfg.refit_backend)
        if tp_rank == 0:
            args = (settings, tasks, results, tuple(follower_queues[index + j] for j in range(1, tp)))
        else:
            args = (settings, follower_queues[index], results)
        children[index] = ctx.Process(target=worker_main, args=args, name=f"rollout-worker-{index}",
                                      daemon=True)
        with spawning_under(interpreter):
            children[index].start()
    print(f"ppo: rollout node {node} ({place['host']}, {place['address']}): replicas {list(mine)} x {tp} "
          f"process(es), pids {[c.pid for c in children.values()]}, {threads} torch thread(s) each "
          f"(torch {torch.__version__})", file=sys.stderr, flush=True)
    reported: set[int] = set()
    last_beat = 0.0
    try:
        while True:
            if time.monotonic() - last_beat >= HEARTBEAT_S:
                results.put(("beat", node))
                last_beat = time.monotonic()
            for index, child in children.items():
                if child.exitcode is not None and index not in reported:
                    results.put(("exited", index, child.exitcode))
                    reported.add(index)
            if len(reported) == len(children):
                failed = [i for i, c in children.items() if c.exitcode != 0]
                return 1 if failed else 0
            if any(children[i].exitcode != 0 for i in reported):
                return 1  # rank 0 names the worker and fails the stage; the others are stopped below
            time.sleep(WATCH_S)
    except (EOFError, ConnectionError, OSError) as exc:
        print(f"ppo: rollout node {node}: the trainer's queue server at {host}:{queue_port} went away "
              f"({type(exc).__name__}); stopping this node's replicas", file=sys.stderr, flush=True)
        return 1
    finally:
        for child in children.values():
            if child.exitcode is None:
                child.terminate()
                child.join(2.0)
            if child.exitcode is None:
                child.kill()
