"""An NCCL refit to a replica on a rollout node (engine.refit_backend=nccl): GPU to GPU, the same engine as
a fresh build of the new weights. Needs two GPUs (NCCL refuses two members of one group on one GPU): the
trainer here takes GPU 0, the rollout node GPU 1 (its CUDA_VISIBLE_DEVICES)."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from alignflow.stages.common.generation.interface import build_engine
from alignflow.stages.common.generation.native.weights import checkpoint_tensors
from tests.stages.common.generation.engine_test_models import engine_config
from tests.stages.ppo import test_rollout_nodes as nodes
from tests.stages.ppo.test_rollout_workers import GREEDY, PROMPTS, checkpoints  # noqa: F401 - the fixture

pytestmark = [
    pytest.mark.cuda_only("an NCCL refit moves GPU memory"),
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL refit test needs two GPUs"),
]


def test_an_nccl_refit_reaches_a_replica_on_another_gpu_like_a_fresh_build(checkpoints):  # noqa: F811
    base, moved, engine_dir = checkpoints
    cfg = nodes.engine_cfg(nodes.free_port(), rollout_workers=1, refit_backend="nccl")
    node = nodes.start_node(engine_dir, cfg, device=None, env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        torch.cuda.set_device(0)
        with nodes.open_workers(engine_dir, cfg, device=None, refit_backend="nccl") as workers:
            stats = workers.refit(checkpoint_tensors(moved))
            assert stats.bytes_sent == stats.bytes
            got = workers.result(workers.submit(nodes.request(PROMPTS, GREEDY))).generation
        fresh = build_engine(moved, engine_config(backend="native"), device="cuda")
        assert got.response_token_ids == fresh.generate(PROMPTS, GREEDY).response_token_ids
        node.communicate(timeout=60)
        assert node.returncode == 0
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
