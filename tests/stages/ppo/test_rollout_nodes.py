"""Rollout replicas on a node of their own: the same tokens and refit as workers beside the trainer, a killed
node named within seconds, and a node with the wrong secret or none refused in one line.

The rollout node is a separate process tree on this host (`serve_node`, as `--rollout-node 0` runs it),
reaching rank 0 only through the endpoint's TCP port; tests/stages/common/test_two_nodes.py runs the RL stage
with the node in its own network namespace.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from alignflow.config import ROLLOUT_SECRET_VAR as SECRET_VAR
from alignflow.config import EngineConfig
from alignflow.stages.common.generation.native.weights import checkpoint_tensors
from alignflow.stages.ppo.rollout_nodes import (
    RolloutNodeError,
    gpus_of_node,
    read_secret,
    replicas_of_node,
)
from alignflow.stages.ppo.rollout_workers import RolloutWorkerError, RolloutWorkers
from tests.stages.ppo.test_rollout_workers import (
    GREEDY,
    LOGPROB_TOL,
    PROMPTS,
    SAMPLED,
    TP,
    TP_LOGPROB_TOL,
    assert_same,
    checkpoints,  # noqa: F401 - the module's fixture
    in_process,
    request,
)

pytestmark = pytest.mark.cpu_only("rollout workers are CPU processes here (stages/ppo/rollout_workers.py)")

SECRET = "test-secret-0123456789abcdef"
REPLICAS = 2

NODE_SCRIPT = """
import json, sys
from alignflow.config import EngineConfig
from alignflow.stages.ppo.rollout_nodes import RolloutNodeError, serve_node
engine_dir, node, cfg = sys.argv[1], int(sys.argv[2]), EngineConfig.model_validate(json.loads(sys.argv[3]))
device = sys.argv[4] or None
try:
    raise SystemExit(serve_node(engine_dir, node, cfg, device))
except RolloutNodeError as exc:
    print(f"error: {exc}", file=sys.stderr)
    raise SystemExit(2)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def engine_cfg(port: int, **overrides) -> EngineConfig:
    return EngineConfig(**{"rollout_workers": REPLICAS, "rollout_nodes": 1,
                           "rollout_endpoint": f"127.0.0.1:{port}", "rollout_worker_threads": 1,
                           "rollout_timeout_s": 30, **overrides})


def start_node(engine_dir, cfg: EngineConfig, secret: str = SECRET, device: str | None = "cpu",
               env: dict[str, str] | None = None) -> subprocess.Popen:
    """Rollout node 0 in its own session (so the test can kill its whole process tree); `device` None: CUDA,
    each process on a GPU of its own."""
    env = {**os.environ, SECRET_VAR: secret, **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", NODE_SCRIPT, str(engine_dir), "0", cfg.model_dump_json(), device or ""],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )


def open_workers(engine_dir, cfg: EngineConfig, **kwargs) -> RolloutWorkers:
    return RolloutWorkers(engine_dir, cfg.rollout_workers, **{
        "chunk_size": 3, "threads": 1, "timeout_s": 30, "device": "cpu", "rollout_nodes": 1,
        "endpoint": cfg.rollout_endpoint, "secret": SECRET.encode(), **kwargs})


def test_replicas_on_a_rollout_node_generate_and_refit_like_an_engine_in_process(checkpoints):  # noqa: F811
    base, moved, engine_dir = checkpoints
    cfg = engine_cfg(free_port())
    node = start_node(engine_dir, cfg)
    try:
        with open_workers(engine_dir, cfg) as workers:
            names = [workers._worker_name(w.index) for w in workers.workers]
            assert all(f"rollout node 0 ({socket.gethostname()}, 127.0.0.1)" in n for n in names), names
            assert all(w.info["node"] == 0 for w in workers.workers)
            want = in_process(base)
            for sampling in (GREEDY, *SAMPLED):
                got = workers.result(workers.submit(request(PROMPTS, sampling)))
                assert_same(got.generation, want.generate(PROMPTS, sampling), LOGPROB_TOL)
            assert sorted(set(workers.last_chunks)) == [0, 1], "both replicas took chunks"
            stats = workers.refit(checkpoint_tensors(moved))
            assert stats.bytes_sent == REPLICAS * stats.bytes
            fresh = in_process(moved)
            got = workers.result(workers.submit(request(PROMPTS, SAMPLED[0])))
            assert_same(got.generation, fresh.generate(PROMPTS, SAMPLED[0]), LOGPROB_TOL)
        _, err = node.communicate(timeout=30)
        assert node.returncode == 0, err[-3000:]
        assert "rollout node 0" in err
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)


def test_a_tensor_parallel_replica_on_a_rollout_node_takes_its_slices(checkpoints):  # noqa: F811
    """1 replica x 2 ranks on the node: the leader forwards each task to its follower there, each rank
    receives its slices over the network, and the tokens are the one-device engine's."""
    base, moved, engine_dir = checkpoints
    cfg = engine_cfg(free_port(), rollout_workers=1, tensor_parallel_size=TP)
    node = start_node(engine_dir, cfg)
    try:
        with open_workers(engine_dir, cfg, tensor_parallel_size=TP) as workers:
            assert [(w.replica, w.tp_rank, w.node) for w in workers.workers] == [(0, 0, 0), (0, 1, 0)]
            stats = workers.refit(checkpoint_tensors(moved))
            assert stats.bytes < stats.bytes_sent < 1.1 * stats.bytes, "each slice once, norms k times"
            assert all(w.bytes < 0.6 * stats.bytes for w in stats.workers)
            got = workers.result(workers.submit(request(PROMPTS, SAMPLED[0]))).generation
            assert_same(got, in_process(moved).generate(PROMPTS, SAMPLED[0]), TP_LOGPROB_TOL)
        node.communicate(timeout=30)
        assert node.returncode == 0
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)


def test_a_killed_rollout_node_is_named_within_seconds(checkpoints):  # noqa: F811
    engine_dir = checkpoints[2]
    cfg = engine_cfg(free_port())
    node = start_node(engine_dir, cfg)
    try:
        workers = open_workers(engine_dir, cfg)
        try:
            workers.result(workers.submit(request(PROMPTS, GREEDY)))
            os.killpg(node.pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(RolloutWorkerError) as raised:
                workers.result(workers.submit(request(PROMPTS * 20, GREEDY, iteration=2)))
            named_after = time.monotonic() - killed
        finally:
            workers.close()
        message = str(raised.value)
        assert f"rollout node 0 ({socket.gethostname()}, 127.0.0.1)" in message, message
        assert "went silent: no heartbeat from rollout node 0" in message, message
        assert "generating iteration 2" in message
        assert named_after < 20, f"named {named_after:.1f} s after the kill"
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.communicate(timeout=30)


def test_a_node_with_another_secret_is_refused_and_the_trainer_names_it_missing(checkpoints):  # noqa: F811
    engine_dir = checkpoints[2]
    cfg = engine_cfg(free_port())
    node = start_node(engine_dir, cfg, secret="another-secret-0123456789")
    try:
        with pytest.raises(RolloutWorkerError, match=r"rollout node\(s\) \[0\] did not connect to "
                           rf"engine.rollout_endpoint={cfg.rollout_endpoint} within 15 s"):
            open_workers(engine_dir, cfg, start_timeout_s=15)
        _, err = node.communicate(timeout=60)
        assert node.returncode == 2
        assert f"refused this node's secret: {SECRET_VAR} must hold the same value" in err, err[-2000:]
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)


def test_a_missing_or_short_secret_is_refused_naming_the_variable(monkeypatch):
    monkeypatch.delenv(SECRET_VAR, raising=False)
    with pytest.raises(RolloutNodeError, match=f"the trainer needs the shared secret .* in {SECRET_VAR} .* "
                       "it is not set"):
        read_secret("the trainer")
    monkeypatch.setenv(SECRET_VAR, "short")
    with pytest.raises(RolloutNodeError, match="but it has 5 characters"):
        read_secret("rollout node 0")
    monkeypatch.setenv(SECRET_VAR, SECRET)
    assert read_secret("the trainer") == SECRET.encode()


def test_replicas_are_spread_evenly_and_contiguously_over_the_nodes():
    assert [list(replicas_of_node(n, 2, 4)) for n in range(2)] == [[0, 1], [2, 3]]
    assert list(replicas_of_node(0, 1, 3)) == [0, 1, 2]


def test_each_process_of_a_gpu_node_takes_a_gpu_of_its_own_and_too_few_are_refused(monkeypatch):
    assert gpus_of_node(0, 3, "cpu") == [None, None, None]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert gpus_of_node(0, 4, None) == [0, 1, 2, 3]
    with pytest.raises(RolloutNodeError, match=r"rollout node 1 runs 6 engine processes .* sees 4 GPU\(s\)"):
        gpus_of_node(1, 6, None)


def test_an_nccl_refit_is_refused_without_rollout_nodes(checkpoints):  # noqa: F811
    with pytest.raises(ValueError, match=r"engine.refit_backend=nccl needs every rollout replica on a "):
        EngineConfig(rollout_workers=2, refit_backend="nccl")
    with pytest.raises(ValueError, match="NCCL refuses two members of one group on the same GPU"):
        RolloutWorkers(checkpoints[2], 1, device="cpu", refit_backend="nccl")


def test_the_layout_is_refused_naming_the_keys():
    with pytest.raises(ValueError, match="set rollout_workers to a multiple of 2"):
        EngineConfig(rollout_workers=3, rollout_nodes=2, rollout_endpoint="a:1")
    with pytest.raises(ValueError, match=r"needs engine.rollout_endpoint \(host:port"):
        EngineConfig(rollout_workers=2, rollout_nodes=1)
    assert json.loads(EngineConfig().model_dump_json())["rollout_nodes"] == 0
