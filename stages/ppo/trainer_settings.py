"""The settings the RL stage's actor and critic trainers are built with; not the trainers themselves.

The optimizer settings and the training forwards' attention, in one place because the critic's own process
(critic_schedule.started_critic, critic_worker.py) must build its trainer exactly as the stage builds it in
line; and what the profiler's advice needs to know of them (run_facts). The trainers are
stages/common/training's.
"""

from __future__ import annotations

import math

import torch

from alignflow.config import EngineConfig, ModelConfig, PPOConfig
from alignflow.stages.common.bottleneck_advice import RunFacts
from alignflow.stages.common.ranks import world_size
from alignflow.stages.common.training.deepspeed_setup import OptimSettings
from alignflow.stages.common.training.precision import Precision, has_bf16_arithmetic, training_attention


def minibatches_per_epoch(cfg: PPOConfig) -> int:
    """The minibatches of an epoch, one optimizer step each."""
    return math.ceil(cfg.prompts_per_iteration * cfg.group_size / cfg.minibatch_size)


def optim_settings(cfg: PPOConfig, model_cfg: ModelConfig, lr: float) -> OptimSettings:
    """The actor's or critic's optimizer settings: constant learning rate, one step per minibatch."""
    return OptimSettings(
        lr=lr,
        weight_decay=0.0,
        warmup_steps=0,
        total_steps=cfg.iterations * cfg.ppo_epochs * minibatches_per_epoch(cfg),
        micro_batch_size=cfg.minibatch_size // world_size(),  # each rank trains its share
        grad_accum=1,
        zero_stage=cfg.zero_stage,
        grad_clip=cfg.grad_clip,
        dtype=model_cfg.dtype,
        schedule="constant",
    )


def training_attention_for(cfg: PPOConfig, engine_cfg: EngineConfig) -> str:
    """The training forwards' attention implementation (every sequence fits the engine's cache: prompt +
    response <= engine.max_seq_len)."""
    return training_attention(engine_cfg.max_seq_len) if cfg.fast_train_step else "sdpa"


def run_facts(cfg: PPOConfig, model_cfg: ModelConfig, engine_cfg: EngineConfig, backend: str,
              precision: Precision, train_device: torch.device, generate_device: torch.device) -> RunFacts:
    """What the profiler's advice needs to know of this RL run (bottleneck_advice): the trainer (`backend`
    from resolve_train_backend, `precision` from resolve_precision) and the engine."""
    rollouts = cfg.prompts_per_iteration * cfg.group_size
    return RunFacts(
        train_device=train_device.type,
        train_dtype="bfloat16" if precision.autocast_dtype == torch.bfloat16 else model_cfg.dtype,
        bf16_arithmetic=has_bf16_arithmetic(train_device),
        zero_stage=cfg.zero_stage if backend == "deepspeed" else 0,
        minibatches=minibatches_per_epoch(cfg),
        engine_backend=engine_cfg.backend,
        generate_device=generate_device.type,
        cuda_graphs=engine_cfg.cuda_graphs,
        # rollout workers share the rollouts out in pieces of their own choosing: not counted here
        generate_calls=math.ceil(rollouts / engine_cfg.max_batch_size) if engine_cfg.rollout_workers == 0
        else None,
    )
