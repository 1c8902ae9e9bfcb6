"""The PPO epochs of one iteration: minibatches, the actor's and critic's updates and their metrics, no more.

train_on is the loop; value_update is one critic update wherever it runs (in line, on the critic's thread, in
the critic's process). Not here: the experience they train on (experience_passes.py), where the critic runs
(critic_schedule.py), the losses (losses.py's pure functions).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from contextlib import suppress
from typing import Any, NamedTuple

import torch

from alignflow.config import PPOConfig
from alignflow.stages.common.ranks import rank, sum_over_ranks, world_size
from alignflow.stages.common.training.packing import PackedRows
from alignflow.stages.common.training.precision import Precision
from alignflow.stages.ppo import losses as rl
from alignflow.stages.ppo.critic_schedule import critic_thread, half_threads, overlaps_critic
from alignflow.stages.ppo.critic_worker import CriticWorker, Update
from alignflow.stages.ppo.experience import Experience, packing_for, policy_logprobs, token_values
from alignflow.stages.ppo.nan_guard import check_finite, finite_on_every_rank
from alignflow.stages.ppo.scoring import kl_estimator


class StaleOldLogprobs(Exception):
    """The engine's log-probs differ from the actor's by more than ppo.old_logprobs_tolerance (raised before
    any optimizer step, so the caller can recompute them and train again from the same weights)."""

    def __init__(self, measured: float):
        super().__init__(f"engine vs actor log-probs differ by up to {measured:.3g} nats")
        self.measured = measured


# Loss values that are a rank's share of the minibatch loss (normalised by the counts over all ranks).
LOSS_SHARES = frozenset({"losses/policy_loss", "losses/actor_loss", "losses/value_loss"})


def _max_over_ranks(value: float) -> float:
    total = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.MAX)
    return float(total)


def value_update(critic, mb: Experience, packed: PackedRows | None, cfg: PPOConfig, precision: Precision,
                 iteration: int, proceed: Callable[[], bool], counts=None,
                 hand_values: Callable[[torch.Tensor], bool] | None = None) -> dict[str, float]:
    """One minibatch's critic update, wherever it runs (train_on in line or on the critic's thread, the
    critic's process): forward, clipped value loss (normalised by `counts` on N ranks), backward, and a step
    if `proceed()` (else the gradients are dropped and {} returned). hand_values: given the forward's values
    first; False stops there ({})."""
    with precision.forward():
        values = token_values(critic, mb, lean=cfg.fast_train_step, packed=packed)
    if hand_values is not None and not hand_values(values.detach()):
        return {}
    value_loss, metrics = rl.value_loss_clipped(
        values,
        mb.values,
        mb.returns,
        mb.response_mask,
        cfg.value_clip_range,
        aggregation=cfg.loss_aggregation,
        counts=counts,
    )
    check_finite("the value loss", finite_on_every_rank(value_loss), iteration)
    critic.backward(cfg.vf_coef * world_size() * value_loss)
    if not proceed():
        critic.discard_gradients()
        return {}
    critic.step()
    return metrics


class Minibatch(NamedTuple):
    """One of train_on's minibatches, all selected before training starts."""

    index: torch.Tensor            # its rows' indices in the Experience
    rows: Experience               # those rows (trimmed under the fast step)
    counts: Any                    # token counts summed over ranks (rl.minibatch_token_counts); 1 rank: None
    packed: PackedRows | None      # packing_for(rows)
    # Its weight in the metrics' means: 1, or on N ranks this rank's share of the minibatch's tokens (x N), so
    # that the per-token means of the ranks average to the minibatch's.
    weight: float


def refill(minibatches: list[Minibatch], exp: Experience, names: tuple[str, ...]) -> None:
    """Copy exp's per-token fields `names` into minibatches selected before they were known (trimmed
    widths)."""
    for minibatch in minibatches:
        for name in names:
            setattr(
                minibatch.rows,
                name,
                getattr(exp, name)[minibatch.index, : minibatch.rows.response_mask.shape[1]],
            )


def rows_into(exp: Experience, index: torch.Tensor, per_token: torch.Tensor) -> torch.Tensor:
    """A (B, R) tensor of exp's shape, zero but for a minibatch's per-token values (B_mb, <= R) at its rows
    `index`."""
    out = torch.zeros_like(exp.response_mask)
    out[index, : per_token.shape[1]] = per_token
    return out


def train_on(
    exp: Experience,
    actor,
    critic,
    cfg: PPOConfig,
    kl_coef: float,
    iteration: int,
    precision: Precision,
    check_old_tolerance: float | None = None,
    old_from_first_forward: bool = False,
    advantages_after_values: Callable[[Experience], None] | None = None,
) -> dict[str, float]:
    """PPO epochs over shuffled minibatches; returns the mean of each loss metric.

    check_old_tolerance: compare the first minibatch's log-probs (taken before any optimizer step, so at
    the policy the old log-probs claim to be) with `exp.old_logprobs`; raise StaleOldLogprobs past it.
    The measured value is returned as rollout/logprob_engine_vs_actor_max.
    old_from_first_forward: fill `exp.old_logprobs` from the first minibatch's forward, which must hold
    every row (old_logprob_source's 'first_forward').
    advantages_after_values: fill `exp.values` from the critic's first forward (values_from_first_forward: one
    minibatch holding every row, the critic on its own thread), then call it on exp to fill the advantages and
    returns, before the actor's first loss and the critic's first value loss.

    On N trainer ranks every rank holds the whole experience and trains on its contiguous 1/N of each
    minibatch: the losses are normalised by the minibatch's token counts summed over the ranks and
    multiplied by N (DeepSpeed averages the gradients over ranks), so the update equals one rank's on the
    whole minibatch. Returned metrics equal one rank's: the loss values summed over ranks (each rank's is its
    share of the minibatch loss), the per-token means (clip fractions, ratio, entropy...) token-weighted.
    """
    take_old = old_from_first_forward
    if (take_old or advantages_after_values) and cfg.minibatch_size < exp.scores.shape[0]:
        raise ValueError(
            "old log-probs or values from the first forward need one minibatch holding every row")
    if advantages_after_values is not None and not overlaps_critic(actor, critic, cfg):
        raise ValueError("values from the critic's first forward need it on its own thread (overlaps_critic)")
    sums: dict[str, float] = {}
    count = 0
    measured: float | None = None
    world = world_size()
    fast = cfg.fast_train_step
    entropy_mode = "loss" if cfg.entropy_coef > 0 or not fast else "metric"

    # Whether the critic's updates may step: they wait for the actor's check of the old log-probs, which may
    # find them stale and send the caller back to train again from these weights (nothing may have moved
    # then).
    proceed: Future[bool] = Future()
    if check_old_tolerance is None:
        proceed.set_result(True)
    # advantages_after_values: the critic's first forward hands its values to the actor's thread, which
    # answers once the advantages and returns are in every minibatch (False: it failed, and the critic must
    # not step).
    first_values: Future[torch.Tensor] = Future()
    advantages_ready: Future[bool] = Future()

    def critic_update(mb: Experience, counts, packed: PackedRows | None, hands_values: bool = False
                      ) -> dict[str, float]:
        def hand(values: torch.Tensor) -> bool:
            first_values.set_result(values)
            return advantages_ready.result()

        try:
            return value_update(critic, mb, packed, cfg, precision, iteration, proceed.result, counts,
                                hand if hands_values else None)
        except BaseException as exc:
            if hands_values and not first_values.done():
                first_values.set_exception(exc)
            raise

    def add(metrics: dict[str, float], weight: float) -> None:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value) * (1.0 if key in LOSS_SHARES else weight)

    minibatches = select_minibatches(exp, cfg, actor, iteration)
    remote = critic if isinstance(critic, CriticWorker) else None
    with critic_thread(actor, critic, cfg) as overlap, half_threads(remote is not None):
        # The critic's updates depend on nothing the actor computes, so its thread takes them all now, in
        # minibatch order (FIFO, one thread), instead of each after the actor's forward of its minibatch: that
        # forward would be the critic thread's idle start and its last update the actor's idle end.
        pending = []
        if overlap is not None:
            hands_values = advantages_after_values is not None
            pending = [(overlap.submit(critic_update, m.rows, m.counts, m.packed, hands_values and i == 0),
                        m.weight) for i, m in enumerate(minibatches)]
        # In its own process (ppo.critic_process) the critic takes them all at once too; its first step waits
        # for the gate, which this process sends when the check below resolves it.
        remote_updates = None
        if remote is not None:
            remote_updates = remote.train_async([Update(m.rows, m.packed) for m in minibatches], iteration,
                                                gated=not proceed.done())
            if not proceed.done():
                proceed.add_done_callback(lambda gate: remote.proceed(gate.result()))
        try:
            for index, mb, counts, packed, weight in minibatches:
                with precision.forward():
                    logp, entropy = policy_logprobs(actor, mb, cfg.temperature, entropy=entropy_mode,
                                                    head_on_response_only=fast, lean=fast, packed=packed)
                # The one minibatch of epoch 1, before any step (one rank): its log-probs are the old ones.
                if take_old:
                    measured = float(((logp.detach() - mb.rollout_logprobs).abs() * mb.response_mask).max())
                    mb.old_logprobs = logp.detach()
                    exp.old_logprobs = rows_into(exp, index, mb.old_logprobs)
                    refill(minibatches[1:], exp, ("old_logprobs",))
                    take_old = False
                if advantages_after_values is not None and not advantages_ready.done():  # the first minibatch
                    exp.values = rows_into(exp, index, first_values.result())
                    advantages_after_values(exp)
                    refill(minibatches, exp, ("values", "token_rewards", "advantages", "returns"))
                    advantages_ready.set_result(True)
                if check_old_tolerance is not None and measured is None:
                    measured = float(((logp.detach() - mb.old_logprobs).abs() * mb.response_mask).max())
                    if world > 1:  # every rank decides alike on the largest difference of any rank
                        measured = _max_over_ranks(measured)
                    if not measured <= check_old_tolerance:
                        raise StaleOldLogprobs(measured)
                    proceed.set_result(True)
                loss, metrics = policy_loss(logp, entropy, mb, counts, cfg, kl_coef)
                check_finite("the policy loss", finite_on_every_rank(loss), iteration)
                if overlap is None and remote is None and critic is not None:
                    add(critic_update(mb, counts, packed), weight)
                actor.backward(loss * world)
                actor.step()
                add(metrics, weight)
                count += 1
        except BaseException:
            # The critic's thread must not wait for what will not come.
            for gate in (proceed, advantages_ready):
                if not gate.done():
                    gate.set_result(False)
            # The process's reply read, so that the next request's reply is the next one on the pipe.
            if remote_updates is not None:
                with suppress(Exception):
                    remote_updates.result()
            raise
        for future, weight in pending:
            add(future.result(), weight)
        if remote_updates is not None:
            for metrics, minibatch in zip(remote_updates.result(), minibatches, strict=True):
                add(metrics, minibatch.weight)
    out = metric_means(sums, count)
    if measured is not None:
        out["rollout/logprob_engine_vs_actor_max"] = measured
    return out


def select_minibatches(exp: Experience, cfg: PPOConfig, actor, iteration: int) -> list[Minibatch]:
    """Every epoch's minibatches, up front: a seeded shuffle of exp's rows per epoch, cut into
    ppo.minibatch_size; on N ranks each rank keeps its contiguous 1/N of each (minibatch_size is a multiple of
    the ranks: PPOConfig)."""
    rows, world = exp.scores.shape[0], world_size()
    generator = torch.Generator().manual_seed(cfg.seed * 100_003 + iteration)
    minibatches: list[Minibatch] = []
    for _ in range(cfg.ppo_epochs):
        order = torch.randperm(rows, generator=generator)
        for start in range(0, rows, cfg.minibatch_size):
            index = order[start : start + cfg.minibatch_size]
            if world > 1:  # this rank's share
                share = len(index) // world
                index = index[rank() * share : (rank() + 1) * share]
            mb = exp.select(index)
            counts = rl.minibatch_token_counts(mb.response_mask) if world > 1 else None  # sums over ranks
            mb = mb.trimmed() if cfg.fast_train_step else mb
            weight = (
                1.0 if counts is None else float(mb.response_mask.sum()) * world / max(counts.tokens, 1.0)
            )
            minibatches.append(Minibatch(index, mb, counts, packing_for(mb, cfg, actor), weight))
    return minibatches


def policy_loss(
    logp: torch.Tensor, entropy: torch.Tensor | None, mb: Experience, counts, cfg: PPOConfig, kl_coef: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's loss on one minibatch and its metrics: GRPO's (the KL in the loss), or PPO's (the KL in the
    loss only when not in the reward). logp, entropy: (B_mb, R) of the actor's forward."""
    if cfg.algorithm == "grpo":
        return rl.policy_loss_grpo(
            logp,
            mb.old_logprobs,
            mb.ref_logprobs,
            mb.advantages,
            mb.response_mask,
            cfg.clip_range,
            kl_coef=kl_coef,
            kl_estimator=kl_estimator(cfg),
            dual_clip=cfg.dual_clip,
            entropy=entropy,
            aggregation=cfg.loss_aggregation,
            entropy_coef=cfg.entropy_coef,
            token_weights=mb.behaviour_weights,
            counts=counts,
        )
    in_loss = not cfg.kl_in_reward
    return rl.policy_loss_ppo(
        logp,
        mb.old_logprobs,
        mb.advantages,
        mb.response_mask,
        cfg.clip_range,
        dual_clip=cfg.dual_clip,
        entropy=entropy,
        entropy_coef=cfg.entropy_coef,
        ref_logprobs=mb.ref_logprobs if in_loss else None,
        kl_coef=kl_coef if in_loss else 0.0,
        kl_estimator=kl_estimator(cfg),
        token_weights=mb.behaviour_weights,
        counts=counts,
        aggregation=cfg.loss_aggregation,
    )


def metric_means(sums: dict[str, float], count: int) -> dict[str, float]:
    """The minibatches' weighted metric sums as one rank's means: on N ranks the loss shares summed over the
    ranks, the per-token means averaged."""
    out = {key: value / count for key, value in sums.items()}
    world = world_size()
    if world > 1:
        totals = sum_over_ranks(*out.values())
        out = {
            key: total if key in LOSS_SHARES else total / world
            for key, total in zip(out, totals, strict=True)
        }
    return out
