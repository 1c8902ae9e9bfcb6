"""The RL trainers' settings: optimizer steps per iteration, and the run's facts for the bottleneck advice."""

from __future__ import annotations

import torch

from alignflow.config import EngineConfig, ModelConfig, PPOConfig
from alignflow.stages.common.training.precision import Precision, has_bf16_arithmetic
from alignflow.stages.ppo.trainer_settings import minibatches_per_epoch, optim_settings, run_facts

CPU = torch.device("cpu")
FP32 = Precision(None, "cpu", "off")


def test_one_optimizer_step_per_minibatch_of_every_epoch():
    cfg = PPOConfig(prompts_per_iteration=10, group_size=3, minibatch_size=8, ppo_epochs=2, iterations=5)
    assert minibatches_per_epoch(cfg) == 4  # 30 rollouts: minibatches of 8, 8, 8, 6
    assert optim_settings(cfg, ModelConfig(), 1e-5).total_steps == 40  # 5 iterations x 2 epochs x 4


def test_run_facts_say_what_the_trainer_and_engine_run_with():
    cfg, model, engine = PPOConfig(prompts_per_iteration=16, ppo_epochs=4), ModelConfig(), EngineConfig()
    facts = run_facts(cfg, model, engine, "torch", FP32, CPU, CPU)
    trainer = (facts.train_device, facts.train_dtype, facts.zero_stage, facts.minibatches)
    assert trainer == ("cpu", "float32", 0, 1)
    assert facts.bf16_arithmetic == has_bf16_arithmetic(CPU)
    assert (facts.engine_backend, facts.generate_device, facts.generate_calls) == ("native", "cpu", 1)

    # DeepSpeed's ZeRO stage and bf16 autocast, and rollouts over two engine calls
    cfg = PPOConfig(prompts_per_iteration=96, zero_stage=2)
    bf16 = Precision(torch.bfloat16, "cpu", "ppo.autocast: bf16")
    facts = run_facts(cfg, model, EngineConfig(max_batch_size=64), "deepspeed", bf16, CPU, CPU)
    assert (facts.zero_stage, facts.train_dtype, facts.generate_calls) == (2, "bfloat16", 2)
    # the plain torch trainer shards nothing, whatever the config's ZeRO stage
    assert run_facts(cfg, model, engine, "torch", FP32, CPU, CPU).zero_stage == 0
    # rollout workers take pieces of their own size: the count is unknown
    workers = EngineConfig(rollout_workers=2)
    assert run_facts(cfg, model, workers, "torch", FP32, CPU, CPU).generate_calls is None
