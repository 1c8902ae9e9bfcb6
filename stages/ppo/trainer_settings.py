"""The settings the RL stage's actor and critic trainers are built with; not the trainers themselves.

The optimizer settings and the training forwards' attention, in one place because the critic's own process
(critic_schedule.started_critic, critic_worker.py) must build its trainer exactly as the stage builds it in
line. The trainers are stages/common/training's.
"""

from __future__ import annotations

import math

from alignflow.config import EngineConfig, ModelConfig, PPOConfig
from alignflow.stages.common.ranks import world_size
from alignflow.stages.common.training.deepspeed_setup import OptimSettings
from alignflow.stages.common.training.precision import training_attention


def optim_settings(cfg: PPOConfig, model_cfg: ModelConfig, lr: float) -> OptimSettings:
    """The actor's or critic's optimizer settings: constant learning rate, one step per minibatch."""
    steps = (
        cfg.iterations
        * cfg.ppo_epochs
        * math.ceil(cfg.prompts_per_iteration * cfg.group_size / cfg.minibatch_size)
    )
    return OptimSettings(
        lr=lr,
        weight_decay=0.0,
        warmup_steps=0,
        total_steps=steps,
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
