"""The no-grad passes that fill an iteration's experience, and where each runs; not the record itself.

Score, then the reference's log-probs (when the KL needs them), the actor's old log-probs (when the engine's
cannot serve) and the critic's values, each its own profiler phase. On N trainer ranks every rank computes its
share of the rows and the ranks all-gather the rest; with the critic on its own thread or in its own process
(critic_schedule.py) one pass runs there beside the others. The record is experience.py's, the updates
training_loop.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from alignflow.config import PPOConfig
from alignflow.stages.common.ranks import gathered_rows, rank, world_size
from alignflow.stages.common.training.precision import Precision
from alignflow.stages.ppo.checkpoints import RLState
from alignflow.stages.ppo.critic_schedule import critic_thread, half_threads, overlaps_passes
from alignflow.stages.ppo.critic_worker import CriticWorker
from alignflow.stages.ppo.experience import Experience, packing_for, policy_logprobs, token_values
from alignflow.stages.ppo.scoring import kl_shapes_advantages, needs_reference

T = TypeVar("T")


def old_logprob_source(
    cfg: PPOConfig,
    precision: Precision,
    state: RLState,
    rows: int,
    values_first: bool = False,
    engine_exact: bool = True,
) -> str:
    """Where this iteration's old log-probs come from (see ppo.old_logprobs):

    'engine': the rollout log-probs; 'recompute': a no-grad actor forward before training; 'first_forward':
    the first minibatch's own forward, taken before any optimizer step. That last one is the recomputation
    for free, and exact, when one minibatch holds every row and nothing needs the old log-probs before
    training. The KL to the reference is what would: it waits for that forward (stage: kl_later) unless it
    shapes the advantages (PPO's KL in the reward) and these are known before training; with
    `values_first` (values_from_first_forward) they wait for the first forwards too. engine_exact: False
    where the engine samples from a rounded copy of the actor (engine.cpu_linear_weights: bfloat16), whose
    log-probs `auto` then does not take.
    """
    if cfg.old_logprobs == "engine":
        return "engine"
    # autocast != the engine's dtype; or the engine's weights are not the actor's
    stale = state.old_logprobs_fallback or precision.autocast_dtype is not None or not engine_exact
    if cfg.old_logprobs == "auto" and not stale:
        return "engine"
    kl_waits = not needs_reference(cfg) or not kl_shapes_advantages(cfg) or values_first
    if cfg.minibatch_size >= rows and kl_waits and world_size() == 1:
        return "first_forward"  # (with N ranks each holds only its share of that minibatch)
    return "recompute"


def over_rows(exp: Experience, forward) -> torch.Tensor:
    """forward(exp) [B, R] for every row: on N trainer ranks each computes its contiguous 1/N of the rows
    and the ranks all-gather the rest (the iteration's rows divide by N: PPOConfig)."""
    world = world_size()
    if world == 1:
        return forward(exp)
    share = exp.scores.shape[0] // world
    return gathered_rows(forward(exp.select(torch.arange(rank() * share, (rank() + 1) * share))))


def experience_passes(
    exp: Experience,
    cfg: PPOConfig,
    actor,
    critic,
    reference,
    precision: Precision,
    source: str,
    profiler,
    score: Callable[[], T],
    with_values: bool = True,
) -> T:
    """The no-grad passes that make the experience: score() (the reward models and functions; its result is
    returned), then the reference's log-probs (when the KL needs them), the actor's old log-probs (source
    'recompute') and the critic's values, filled into exp.

    With ppo.overlap_passes (overlaps_passes) one pass runs on the critic's thread from the start, beside
    score() and the others here, each thread with half the torch threads: the reference's when there is one
    (the longest of the passes, so the one that takes the most off this thread), else the critic's. The passes
    share no state and each gives what it gives alone. The phase of the pass on that thread is the wait for it
    after the others. With the critic in its own process (ppo.critic_process) the values pass runs there from
    the start, beside the others here.
    with_values False: no values pass (values_from_first_forward: train_on takes them from the critic's first
    forward)."""
    lean = cfg.fast_train_step
    with_reference = needs_reference(cfg)
    # Once, before two threads would both compute it for exp's cache; not at all when no pass runs (GRPO at
    # KL 0).
    with_values = with_values and critic is not None
    packed = packing_for(exp, cfg, actor) if with_reference or source == "recompute" or with_values else None

    # Grad mode and autocast are per thread: each pass sets them on the thread that runs it.
    def logprobs(model) -> torch.Tensor:
        with torch.no_grad(), precision.forward():
            return over_rows(
                exp,
                lambda part: policy_logprobs(
                    model,
                    part,
                    cfg.temperature,
                    lean=lean,
                    packed=packed if part is exp else packing_for(part, cfg, actor),
                )[0],
            )

    def values() -> torch.Tensor:
        with torch.no_grad(), precision.forward():
            return over_rows(
                exp,
                lambda part: token_values(
                    critic.module,
                    part,
                    lean=lean,
                    packed=packed if part is exp else packing_for(part, cfg, actor),
                ),
            )

    # With the critic in its own process (ppo.critic_process) its values pass runs there from the start,
    # beside score() and then the reference's pass here, each side with half the torch threads. The
    # reference's pass stays here: in that process it would queue behind the values, and on a second thread
    # here three streams of work would share the cores.
    remote = isinstance(critic, CriticWorker) and with_values
    beside_enabled = overlaps_passes(actor, critic, cfg) and (with_reference or with_values)
    with critic_thread(actor, critic, cfg, beside_enabled) as beside, half_threads(remote):
        reference_beside = beside is not None and with_reference
        values_beside = beside is not None and not with_reference
        if remote:
            pending: Any = critic.values_async(exp, packed)
        elif beside is not None:
            pending = beside.submit(logprobs, reference) if reference_beside else beside.submit(values)
        with profiler.phase("score"):
            scored = score()
        if with_reference and not reference_beside:
            with profiler.phase("reference"):
                exp.ref_logprobs = logprobs(reference)
        if source == "recompute":
            with profiler.phase("old_logprobs"):
                exp.old_logprobs = logprobs(actor.module)
        if with_values:
            with profiler.phase("values"):  # beside: the wait for the critic's thread or process
                exp.values = pending.result() if values_beside or remote else values()
        if reference_beside:
            with profiler.phase("reference"):
                exp.ref_logprobs = pending.result()
    return scored


def recompute_old_logprobs(exp: Experience, cfg: PPOConfig, actor, precision: Precision) -> torch.Tensor:
    """The actor's no-grad log-probs of exp's rows, (B, R): the old log-probs once the engine's were found
    stale (train_on raised StaleOldLogprobs before any optimizer step, so the actor is still at the rollout's
    weights)."""
    with torch.no_grad(), precision.forward():
        return over_rows(
            exp,
            lambda part: policy_logprobs(
                actor.module,
                part,
                cfg.temperature,
                lean=cfg.fast_train_step,
                packed=packing_for(part, cfg, actor),
            )[0],
        )
