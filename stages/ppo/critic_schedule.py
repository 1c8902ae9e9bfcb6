"""Where the PPO critic runs: in line, on a second thread or in its own process; not what it computes.

The critic's updates and its values pass share nothing with the actor's, so on one rank of a CPU box they can
run beside them: on a second thread (ppo.overlap_critic), or in the critic's own process (ppo.critic_process,
critic_worker.py), where they share no interpreter lock with the actor's. Each side then gets half the torch
threads. Everything here decides or schedules; the same updates and passes give the same bits wherever they
run (tests/stages/ppo/test_train_shortcuts.py, test_critic_worker.py). Why each applies where it does:
docs/rl.md#speed-options.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager

import torch

from alignflow.config import EngineConfig, ModelConfig, PPOConfig
from alignflow.stages.common.ranks import world_size
from alignflow.stages.common.runtime import StageContext
from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer, resolve_train_backend
from alignflow.stages.common.training.precision import resolve_precision
from alignflow.stages.ppo.critic_worker import CriticSpec, CriticWorker
from alignflow.stages.ppo.experience import actor_width
from alignflow.stages.ppo.trainer_settings import optim_settings, training_attention_for

# Narrower actors overlap the experience's passes under ppo.overlap_passes: auto (see its description).
OVERLAP_PASSES_BELOW_WIDTH = 256


def overlaps_critic(actor, critic, cfg: PPOConfig) -> bool:
    """Whether train_on runs the critic's updates on a second thread (ppo.overlap_critic): one rank (N ranks'
    collectives must come in one order), both models on the plain torch trainer (a DeepSpeed engine may call
    collectives even alone) and on CPU (on one CUDA stream the kernels would queue behind each other anyway),
    more than one thread, and not beside ppo.async_rollouts' generating thread (three would share the
    cores)."""
    return (critic is not None and cfg.overlap_critic and not cfg.async_rollouts and world_size() == 1
            and torch.get_num_threads() > 1
            and all(isinstance(m, PlainTorchTrainer) and next(m.module.parameters()).device.type == "cpu"
                    for m in (actor, critic)))


def overlaps_passes(actor, critic, cfg: PPOConfig) -> bool:
    """Whether experience_passes runs one pass on the critic's thread (ppo.overlap_passes, where
    overlaps_critic)."""
    if cfg.overlap_passes == "off" or not overlaps_critic(actor, critic, cfg):
        return False
    return cfg.overlap_passes == "on" or actor_width(actor) < OVERLAP_PASSES_BELOW_WIDTH


def critic_folder(ctx: StageContext):
    """The critic's initial weights: the first reward model's output (None: the stage has no reward model)."""
    reward_inputs = sorted(k for k in ctx.spec.inputs if k.startswith("reward_"))
    return ctx.input(reward_inputs[0]) if reward_inputs else None


def critic_in_process(actor_width: int, cfg: PPOConfig, backend: str, device: torch.device) -> bool:
    """Whether the critic runs in its own process (ppo.critic_process): where overlaps_critic would give it a
    thread (decided before any model loads, so the process starts first: one rank, > 1 thread, the plain torch
    trainer, the models on the CPU), not with ppo.compile_train (the critic would compile in the worker,
    untested there), and under auto for actors narrower than 256 (as overlap_passes: there the work is bound
    by operator dispatch, which the two processes do in parallel)."""
    return (
        cfg.algorithm == "ppo"
        and cfg.critic_process != "off"
        and cfg.overlap_critic
        and not cfg.async_rollouts
        and not cfg.compile_train
        and world_size() == 1
        and torch.get_num_threads() > 1
        and backend == "torch"
        and device.type == "cpu"
        and (cfg.critic_process == "on" or actor_width < OVERLAP_PASSES_BELOW_WIDTH)
    )


def values_from_first_forward(actor, critic, cfg: PPOConfig, rows: int) -> bool:
    """Whether the critic's first training forward gives the iteration's values, instead of a no-grad values
    pass before training (part of ppo.fast_train_step). That forward is the pass for free, at the same
    weights, when one minibatch holds every row; and it costs the actor no wait only beside it
    (overlaps_critic): the actor's first loss needs the advantages, which need the values, and the two
    forwards take about as long. It relies on train_on queueing every critic update up front, so that the
    critic's first forward starts with the actor's rather than after it. And the critic's training forward
    must compute what its no-grad one does: no dropout anywhere."""
    if not (cfg.fast_train_step and cfg.minibatch_size >= rows and overlaps_critic(actor, critic, cfg)):
        return False
    model = critic.module
    return float(getattr(model.config, "attention_dropout", 0.0) or 0.0) == 0.0 and not any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
    )


@contextmanager
def half_threads(enabled: bool) -> Iterator[None]:
    """This thread's torch threads halved (enabled) while the critic's thread or process works on the other
    half."""
    threads = torch.get_num_threads()
    if enabled:
        torch.set_num_threads(max(1, threads // 2))
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@contextmanager
def critic_thread(
    actor, critic, cfg: PPOConfig, enabled: bool | None = None
) -> Iterator[ThreadPoolExecutor | None]:
    """The second thread of overlaps_critic: one of the experience's passes runs there beside the others
    (experience_passes), the critic's updates beside the actor's (train_on); None: they run in line.
    enabled: whether to start it (default: overlaps_critic).
    Each thread gets half the torch threads: with all of them each, the two threads' OpenMP teams would
    oversubscribe the cores. torch.set_num_threads is per OS thread under OpenMP, so the critic's thread sets
    its own."""
    if not (overlaps_critic(actor, critic, cfg) if enabled is None else enabled):
        yield None
        return
    with half_threads(True):
        executor = ThreadPoolExecutor(
            1,
            thread_name_prefix="critic",
            initializer=torch.set_num_threads,
            initargs=(torch.get_num_threads(),),
        )
        try:
            yield executor
        finally:  # on an error too: the critic's queued work ends before the caller goes on
            executor.shutdown(cancel_futures=True)


@contextmanager
def started_critic(
    ctx: StageContext, cfg: PPOConfig, model_cfg: ModelConfig, engine_cfg: EngineConfig, device: torch.device
) -> Iterator[CriticWorker | None]:
    """The critic's process where critic_in_process puts it (None: the critic lives in this process), closed
    after. Started before anything else loads, so that its interpreter, imports and model load run beside the
    stage's own; its first request (iteration 1's values, or a resume's checkpoint) waits for the rest."""
    try:
        backend = resolve_train_backend(cfg.train_backend, cfg.zero_stage)
    except ValueError:
        backend = "deepspeed"  # the stage reports the bad setting when it builds the trainers
    initial = critic_folder(ctx)
    width = int(json.loads((ctx.input("sft") / "config.json").read_text()).get("hidden_size", 0) or 0)
    if not (initial and width and critic_in_process(width, cfg, backend, device)):
        yield None
        return
    precision = resolve_precision(cfg.autocast, model_cfg.dtype, device, width)  # as the actor's (on the CPU)
    worker = CriticWorker(
        CriticSpec(
            str(initial),
            cfg,
            model_cfg.dtype,
            optim_settings(cfg, model_cfg, cfg.critic_lr),
            training_attention_for(cfg, engine_cfg),
            precision,
            threads=max(1, torch.get_num_threads() // 2),
        )
    )
    with closing(worker):
        yield worker
