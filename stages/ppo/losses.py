"""RL algorithm library for PPO and GRPO: pure tensor functions (advantages, KL, losses, loss aggregation).

Nothing here touches models, optimizers, engines or files; every function takes tensors and returns
tensors, so each can be checked against a plain-loop reference. The RL stage wires them together.

Conventions used throughout:

- Token-level tensors are ``[B, T]`` over the *response* tokens only (index 0 is the first generated
  token); ``mask`` is ``[B, T]`` with 1 on real response tokens and 0 on padding (bool or float).
- Values at masked positions are never read: padding may hold garbage (even NaN) and outputs are 0 there.
- Where the config offers a choice (KL estimator, loss aggregation) the implementation is picked by name
  from a registry dict; an unknown name raises ``ValueError`` listing the valid names.
- Loss metrics are returned as detached 0-dim tensors under namespaced keys (``losses/...``) so that
  logging them does not force a device sync per micro-batch; they are *local* masked means.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor

# exp() overflows float32 above ~88.7; ratios beyond e^20 (~4.9e8) are clipped by PPO anyway, so
# clamping the log-ratio there changes no sane loss and keeps one wild token from turning a batch NaN.
_MAX_LOG_RATIO = 20.0


def _choose(registry: Mapping[str, Any], name: str, what: str) -> Any:
    """Look `name` up in `registry`; an unknown name raises ValueError listing the valid ones."""
    try:
        return registry[name]
    except KeyError:
        valid = ", ".join(sorted(registry))
        raise ValueError(f"unknown {what} {name!r}; valid choices: {valid}") from None


def _check_same_shape(**tensors: Tensor) -> None:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{n}={list(s)}" for n, s in shapes.items())
        raise ValueError(f"shape mismatch: {listed}; all must be [B, T]")


def _fill_padding(values: Tensor, mask: Tensor, fill: Tensor | float) -> Tensor:
    """`values` with padding replaced by `fill`.

    A loss masked with torch.where still back-propagates 0 * d(branch), and 0 * NaN = NaN: garbage in
    the padding of a no-grad input (old log-probs, advantages) would turn the model's gradient NaN.
    """
    return torch.where(mask.bool(), values, fill)


def _work_dtype(t: Tensor) -> torch.dtype:
    """float32 at least: bf16 has 8 bits of mantissa, too few for a 1000-step discounted sum."""
    return torch.promote_types(t.dtype, torch.float32)


# --------------------------------------------------------------------------------------------------
# Masked reductions
# --------------------------------------------------------------------------------------------------


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `values` [B, T] where `mask` [B, T] is 1; `dim=None` sums everything (0-dim result)."""
    zeros = torch.zeros((), dtype=values.dtype, device=values.device)
    picked = torch.where(mask.bool(), values, zeros)
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `values` [B, T] over positions where `mask` is 1 (0 where there are none)."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: Tensor, mask: Tensor) -> Tensor:
    """Population variance (divide by n, not n-1) of `values` [B, T] over masked positions; 0-dim."""
    mean = masked_mean(values, mask)
    return masked_mean((values - mean) ** 2, mask)


def whiten(values: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Masked whitening: (x - mean) / sqrt(var + eps) over the real tokens of the whole batch.

    Args:
        values: [B, T] e.g. advantages.
        mask: [B, T] response mask.
        shift_mean: if False the mean is added back (only the scale changes), which keeps the sign of
            e.g. rewards intact.
        eps: added to the variance; 1e-8 so a constant batch gives 0, not NaN.

    Returns:
        [B, T], zero at padding. Statistics are local to this tensor (this rank): whiten the full
        rollout batch before it is split into micro-batches.
    """
    _check_same_shape(values=values, mask=mask)
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(mask.bool(), out, torch.zeros_like(out))


def last_token_index(mask: Tensor) -> Tensor:
    """Index [B] (int64) of the last real token of each row of `mask` [B, T].

    Raises ValueError if a row has no real token: its score would have nowhere to go.
    """
    mask_b = mask.bool()
    has_token = mask_b.any(dim=-1)
    if not bool(has_token.all()):
        rows = torch.nonzero(~has_token).flatten().tolist()
        raise ValueError(f"rows {rows} of the response mask have no tokens; drop empty responses first")
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask_b)
    return torch.where(mask_b, positions, torch.full_like(positions, -1)).amax(dim=-1)


def sequence_to_token(per_sequence: Tensor, mask: Tensor) -> Tensor:
    """Broadcast a per-sequence value [B] to every real token: [B, T], zero at padding."""
    if per_sequence.dim() != 1 or per_sequence.shape[0] != mask.shape[0]:
        raise ValueError(
            f"per_sequence must be [B] with B={mask.shape[0]} (the mask's rows), "
            f"got {list(per_sequence.shape)}"
        )
    return per_sequence[:, None] * mask.to(per_sequence.dtype)


# --------------------------------------------------------------------------------------------------
# KL between the policy and the reference
# --------------------------------------------------------------------------------------------------


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log p - log p_ref: unbiased for KL(p || p_ref) under samples of p, can be negative."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 (log p - log p_ref)^2: biased, non-negative, low variance."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = exp(r) - r - 1 with r = log p_ref - log p: unbiased and non-negative (Schulman 2020).

    r is clamped to +-20 (see _MAX_LOG_RATIO) so a token the reference finds near-impossible gives a
    large but finite penalty instead of inf.
    """
    log_ratio = (ref_logprobs - logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return torch.exp(log_ratio) - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k1", mask: Tensor | None = None
) -> Tensor:
    """Per-token estimate of KL(policy || reference) from sampled-token log-probs.

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the policy being scored.
        ref_logprobs: [B, T] log-probs of the same tokens under the frozen reference.
        estimator: "k1" | "k2" | "k3" (see KL_ESTIMATORS).
        mask: optional [B, T]; if given the result is zero at padding.

    Returns:
        [B, T] per-token KL estimates; sum over tokens for a per-sequence KL.
    """
    _check_same_shape(logprobs=logprobs, ref_logprobs=ref_logprobs)
    kl = _choose(KL_ESTIMATORS, estimator, "KL estimator")(logprobs, ref_logprobs)
    if mask is not None:
        kl = torch.where(mask.bool(), kl, torch.zeros_like(kl))
    return kl


def sequence_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """Per-sequence KL [B]: the sum of per-token estimates [B, T] over real tokens (nats per sequence)."""
    return masked_sum(kl, mask, dim=-1)


# --------------------------------------------------------------------------------------------------
# Scores -> token rewards (PPO with KL in the reward)
# --------------------------------------------------------------------------------------------------


def token_rewards_from_scores(scores: Tensor, kl: Tensor, kl_coef: float, mask: Tensor) -> Tensor:
    """Token-level rewards: -kl_coef * kl on every real token, plus the scalar score on the last one.

    Args:
        scores: [B] sequence scores (reward models + reward functions, after normalise/clip).
        kl: [B, T] per-token KL estimate (see kl_penalty); detached, it is a reward, not a loss.
        kl_coef: the KL coefficient (the KL controller's current value).
        mask: [B, T] response mask; every row needs at least one real token.

    Returns:
        [B, T] rewards, zero at padding.
    """
    _check_same_shape(kl=kl, mask=mask)
    if scores.shape != (kl.shape[0],):
        raise ValueError(f"scores must be [B] with B={kl.shape[0]}, got {list(scores.shape)}")
    dtype = _work_dtype(kl)
    rewards = torch.where(
        mask.bool(), -kl_coef * kl.to(dtype), torch.zeros((), dtype=dtype, device=kl.device)
    )
    last = last_token_index(mask)
    rows = torch.arange(kl.shape[0], device=kl.device)
    rewards[rows, last] += scores.to(dtype)
    return rewards


def has_eos(response_token_ids: Tensor, mask: Tensor, eos_token_ids: int | Sequence[int]) -> Tensor:
    """Whether each response ends in an EOS token: bool [B] from token ids [B, T] and mask [B, T].

    Rows with no real token count as not finished.
    """
    _check_same_shape(response_token_ids=response_token_ids, mask=mask)
    eos = torch.as_tensor(
        [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids),
        device=response_token_ids.device,
    )
    mask_b = mask.bool()
    any_token = mask_b.any(dim=-1)
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask_b)
    last = torch.where(mask_b, positions, torch.zeros_like(positions)).amax(dim=-1)
    last_ids = response_token_ids.gather(1, last[:, None]).squeeze(1)
    return any_token & torch.isin(last_ids, eos)


def apply_missing_eos_penalty(scores: Tensor, finished_with_eos: Tensor, penalty: float | None) -> Tensor:
    """Add `penalty` (usually negative, e.g. -1.0) to the score [B] of every response with no EOS.

    Truncated responses otherwise get scored as if complete, and the policy learns to ramble to the
    length limit. `penalty=None` returns the scores unchanged (config `ppo.missing_eos_penalty`).
    """
    if penalty is None:
        return scores
    if finished_with_eos.shape != scores.shape:
        raise ValueError(
            f"finished_with_eos {list(finished_with_eos.shape)} must match scores {list(scores.shape)}"
        )
    return torch.where(finished_with_eos.bool(), scores, scores + penalty)


def clip_scores(scores: Tensor, clip: float | None) -> Tensor:
    """Clamp scores [B] to [-clip, clip] (config `ppo.reward_clip`); None leaves them unchanged."""
    if clip is None:
        return scores
    if clip <= 0:
        raise ValueError(f"reward clip must be > 0 or None, got {clip}")
    return scores.clamp(-clip, clip)


class RunningMeanStd:
    """Running mean and variance of a scalar stream (scores), merged batch by batch (Chan et al. 1979).

    Kept as Python floats (float64) so the state is a tiny JSON-able dict and survives checkpoints.
    Before the first update it is the identity normalisation (mean 0, var 1).
    """

    def __init__(self) -> None:
        self.count: float = 0.0
        self.mean: float = 0.0
        self._m2: float = 0.0  # sum of squared deviations from the mean

    @property
    def var(self) -> float:
        """Population variance of everything seen so far (1.0 before any update)."""
        return self._m2 / self.count if self.count > 0 else 1.0

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def update(self, values: Tensor) -> None:
        """Merge a batch of values (any shape, all elements used)."""
        batch = values.detach().to(torch.float64).flatten()
        n = float(batch.numel())
        if n == 0:
            return
        batch_mean = float(batch.mean())
        batch_m2 = float(((batch - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self._m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def state_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self._m2}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        missing = {"count", "mean", "m2"} - set(state)
        if missing:
            raise ValueError(f"RunningMeanStd state is missing {sorted(missing)}; got keys {sorted(state)}")
        self.count, self.mean, self._m2 = float(state["count"]), float(state["mean"]), float(state["m2"])


def normalize_scores(
    scores: Tensor,
    stats: RunningMeanStd,
    update: bool = True,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """Normalise scores [B] with running statistics: (s - mean) / sqrt(var + eps).

    Args:
        update: merge this batch into `stats` first (so the first batch normalises by itself).
        shift_mean: False divides by the std only, keeping the sign of the raw score.
    """
    if update:
        stats.update(scores)
    centred = scores - stats.mean if shift_mean else scores
    return (centred / math.sqrt(stats.var + eps)).to(scores.dtype)


# --------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def compute_gae(
    token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016), vectorised over the batch.

    A reverse scan over time:  delta_t = r_t + gamma * V_next - V_t,  A_t = delta_t + gamma*lam*A_next,
    where "next" is the next *real* token of the same row. Masked positions are skipped: they get
    A = 0 and return 0 and do not break the chain, so trailing padding after EOS is harmless and
    bootstrapping stops at the last real token (V after it is 0: the episode ended).

    Args:
        token_rewards: [B, T] per-token rewards (see token_rewards_from_scores).
        values: [B, T] critic values V(s_t) from the rollout.
        mask: [B, T] response mask.
        gamma: discount in [0, 1].
        lam: GAE lambda in [0, 1].

    Returns:
        (advantages [B, T], returns [B, T]) with returns = advantages + values on real tokens; both
        zero at padding; float32 at least (bf16 inputs are upcast).
    """
    _check_same_shape(token_rewards=token_rewards, values=values, mask=mask)
    dtype = _work_dtype(values)
    rewards = token_rewards.to(dtype)
    vals = values.to(dtype)
    real = mask.bool()
    batch, length = vals.shape
    zero = torch.zeros(batch, dtype=dtype, device=vals.device)
    next_value, next_adv = zero, zero
    columns: list[Tensor] = []
    for t in reversed(range(length)):
        real_t = real[:, t]
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam * next_adv
        # torch.where (not multiplication by the mask) so NaN in padding cannot leak into real tokens.
        columns.append(torch.where(real_t, adv_t, zero))
        next_value = torch.where(real_t, vals[:, t], next_value)
        next_adv = torch.where(real_t, adv_t, next_adv)
    advantages = torch.stack(columns[::-1], dim=1)
    returns = torch.where(real, advantages + vals, torch.zeros((), dtype=dtype, device=vals.device))
    return advantages, returns


def grpo_advantages(scores: Tensor, group_size: int, scale_std: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages (Shao et al. 2024, DeepSeekMath): centre each score on its group mean.

    Args:
        scores: [B] with B = n_prompts * group_size, laid out group-contiguous: rows
            [g*group_size, (g+1)*group_size) are the completions of prompt g.
        group_size: completions per prompt (>= 2).
        scale_std: divide by the group's std (sample std, n-1) + eps; False is Dr. GRPO's choice
            (Liu et al. 2025), which avoids up-weighting groups that are almost all right or all wrong.
        eps: keeps a group of identical scores at advantage 0 instead of 0/0.

    Returns:
        [B] advantages, one per sequence; broadcast to tokens with sequence_to_token(adv, mask).
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be [B], got shape {list(scores.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if scores.shape[0] % group_size:
        raise ValueError(
            f"{scores.shape[0]} scores are not a whole number of groups of {group_size}; "
            "generate group_size completions for every prompt"
        )
    grouped = scores.to(_work_dtype(scores)).view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_std:
        centred = centred / (grouped.std(dim=1, keepdim=True) + eps)
    return centred.flatten()


# --------------------------------------------------------------------------------------------------
# Loss aggregation across micro-batches and ranks
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TokenCounts:
    """Normalisers of one minibatch: totals over *all* its micro-batches on *all* data-parallel ranks.

    Compute once per minibatch with minibatch_token_counts() and pass to every aggregate_loss call.
    """

    tokens: float  # real response tokens
    sequences: float  # sequences with at least one real response token


def minibatch_token_counts(
    masks: Tensor | Sequence[Tensor], *, all_reduce: bool | None = None, group: Any = None
) -> TokenCounts:
    """Count tokens and sequences of a minibatch across its micro-batches and (optionally) ranks.

    Args:
        masks: the response masks [B_i, T_i] of this rank's micro-batches (or one mask).
        all_reduce: sum the counts over the process group; None = yes if torch.distributed is
            initialised. One all-reduce of 2 numbers per minibatch, not per micro-batch.
        group: process group for the all-reduce (None = the default group).

    Returns:
        TokenCounts with the global totals.
    """
    if isinstance(masks, Tensor):
        masks = [masks]
    if not masks:
        raise ValueError("minibatch_token_counts needs at least one mask")
    device = masks[0].device
    local = torch.zeros(2, dtype=torch.float64, device=device)
    for mask in masks:
        mask_b = mask.bool()
        local[0] += mask_b.sum()
        local[1] += mask_b.any(dim=-1).sum()
    if all_reduce is None:
        all_reduce = dist.is_available() and dist.is_initialized()
    if all_reduce:
        dist.all_reduce(local, op=dist.ReduceOp.SUM, group=group)
    tokens, sequences = local.tolist()
    return TokenCounts(tokens=tokens, sequences=sequences)


def _local_counts(mask: Tensor) -> TokenCounts:
    mask_b = mask.bool()
    return TokenCounts(tokens=float(mask_b.sum()), sequences=float(mask_b.any(dim=-1).sum()))


def aggregate_token_mean(loss: Tensor, mask: Tensor, counts: TokenCounts) -> Tensor:
    """token-mean: every real token of the minibatch weighs the same.

    sum over this micro-batch's real tokens / counts.tokens (the minibatch-wide token count). Long
    responses weigh more than short ones, as in DAPO (Yu et al. 2025).
    """
    return masked_sum(loss, mask) / max(counts.tokens, 1.0)


def aggregate_seq_mean_token_mean(loss: Tensor, mask: Tensor, counts: TokenCounts) -> Tensor:
    """seq-mean-token-mean: average each sequence over its tokens, then average the sequences.

    Every sequence weighs the same regardless of length (the original PPO-for-LMs / GRPO choice).
    """
    per_seq = masked_mean(loss, mask, dim=-1)
    return per_seq.sum() / max(counts.sequences, 1.0)


def aggregate_seq_mean_token_sum(loss: Tensor, mask: Tensor, counts: TokenCounts) -> Tensor:
    """seq-mean-token-sum: sum each sequence over its tokens, then average the sequences.

    The gradient scale grows with response length; use with a small learning rate.
    """
    per_seq = masked_sum(loss, mask, dim=-1)
    return per_seq.sum() / max(counts.sequences, 1.0)


LOSS_AGGREGATIONS: dict[str, Callable[[Tensor, Tensor, TokenCounts], Tensor]] = {
    "token-mean": aggregate_token_mean,
    "seq-mean-token-mean": aggregate_seq_mean_token_mean,
    "seq-mean-token-sum": aggregate_seq_mean_token_sum,
}


def aggregate_loss(
    loss_per_token: Tensor, mask: Tensor, mode: str = "token-mean", counts: TokenCounts | None = None
) -> Tensor:
    """Reduce a per-token loss [B, T] of one micro-batch to its share of the minibatch loss.

    The value is normalised by the *minibatch-wide* counts, so summing it over all micro-batches and
    ranks gives exactly the full-minibatch loss, however unevenly tokens are spread. (Dividing each
    micro-batch by its own token count and averaging those means over-weights tokens in short
    micro-batches.) With counts=None the micro-batch is taken to be the whole minibatch.

    Frameworks that average gradients over the W data-parallel ranks (DDP, DeepSpeed) and divide by the
    gradient-accumulation steps G (DeepSpeed's backward) must have the returned loss multiplied by W*G
    before backward so that the applied gradient is the sum of the shares.

    Args:
        loss_per_token: [B, T].
        mask: [B, T] response mask.
        mode: "token-mean" | "seq-mean-token-mean" | "seq-mean-token-sum" (see LOSS_AGGREGATIONS).
        counts: from minibatch_token_counts() over the whole minibatch.

    Returns:
        0-dim tensor.
    """
    _check_same_shape(loss_per_token=loss_per_token, mask=mask)
    aggregate = _choose(LOSS_AGGREGATIONS, mode, "loss aggregation")
    return aggregate(loss_per_token, mask, counts if counts is not None else _local_counts(mask))


# --------------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------------


def clipped_surrogate(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    clip_range: float,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token PPO clipped surrogate loss (to minimise), with optional dual clip.

    loss_t = max(-A r, -A clip(r, 1-eps, 1+eps)), r = exp(logp - logp_old). With dual clip c > 1
    (Ye et al. 2020) the loss of a token with A < 0 is further capped at -c*A, so a token whose ratio
    has exploded cannot dominate the batch.

    Args:
        logprobs: [B, T] current policy (with grad).
        old_logprobs: [B, T] rollout policy.
        advantages: [B, T].
        clip_range: eps.
        dual_clip: c > 1, or None.

    Returns:
        (loss [B, T], ratio [B, T], clipped [B, T] bool: the clipped branch is active,
        dual_clipped [B, T] bool: the dual-clip cap is active).
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (e.g. 3.0) or None, got {dual_clip}")
    log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = clipped_loss > unclipped
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual_clipped = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_clipped, cap, loss)
    else:
        dual_clipped = torch.zeros_like(clipped)
    return loss, ratio, clipped, dual_clipped


def policy_loss_ppo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_range: float,
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    counts: TokenCounts | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logprobs: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO actor loss: clipped surrogate, minus an entropy bonus, plus (optionally) KL in the loss.

    loss = agg(surrogate) - entropy_coef * agg(entropy) + kl_coef * agg(KL(policy || ref)), each
    aggregated with the same mode and counts (see aggregate_loss).

    Args:
        logprobs: [B, T] log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: [B, T] the same under the rollout policy.
        advantages: [B, T] (already whitened if wanted), or [B] per sequence (GRPO), broadcast.
        mask: [B, T] response mask.
        clip_range: PPO eps (config ppo.clip_range).
        dual_clip: config ppo.dual_clip.
        aggregation: a LOSS_AGGREGATIONS name.
        counts: minibatch-wide TokenCounts (None = this micro-batch is the whole minibatch).
        entropy: optional [B, T] per-token entropy of the policy (with grad).
        entropy_coef: weight of the entropy bonus (config ppo.entropy_coef).
        ref_logprobs: [B, T] reference log-probs, needed when kl_coef > 0 (KL in the loss).
        kl_coef: weight of the KL term (0 = KL lives in the reward instead).
        kl_estimator: a KL_ESTIMATORS name; "k3" by default since it is non-negative and unbiased.
        token_weights: optional [B, T] importance weights (no grad) multiplying each token's surrogate: the
            decoupled objective of off-policy batches, pi_prox / pi_behaviour with `old_logprobs` the
            proximal policy's (see behaviour_weights).

    Returns:
        (loss 0-dim, metrics): losses/actor_loss, losses/policy_loss, losses/approx_kl (k3 between old
        and current policy), losses/clipfrac, losses/dual_clipfrac, losses/ratio_mean, and
        losses/entropy, losses/kl_ref when those terms are present. Metrics are detached local means.
    """
    if advantages.dim() == 1:
        advantages = sequence_to_token(advantages, mask)
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if counts is None:
        counts = _local_counts(mask)
    old_logprobs = _fill_padding(old_logprobs, mask, logprobs.detach())
    advantages = _fill_padding(advantages.to(logprobs.dtype), mask, 0.0)
    surrogate, ratio, clipped, dual_clipped = clipped_surrogate(
        logprobs, old_logprobs, advantages, clip_range, dual_clip
    )
    if token_weights is not None:
        _check_same_shape(token_weights=token_weights, mask=mask)
        surrogate = surrogate * _fill_padding(token_weights.detach().to(surrogate.dtype), mask, 0.0)
    policy_loss = aggregate_loss(surrogate, mask, aggregation, counts)
    loss = policy_loss
    with torch.no_grad():
        log_ratio = (logprobs - old_logprobs).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        metrics: dict[str, Tensor] = {
            "losses/policy_loss": policy_loss.detach(),
            "losses/approx_kl": masked_mean(torch.exp(log_ratio) - 1.0 - log_ratio, mask),
            "losses/clipfrac": masked_mean(clipped.float(), mask),
            "losses/dual_clipfrac": masked_mean(dual_clipped.float(), mask),
            "losses/ratio_mean": masked_mean(ratio, mask),
        }
    if entropy is not None:
        _check_same_shape(entropy=entropy, mask=mask)
        entropy_term = aggregate_loss(entropy, mask, aggregation, counts)
        loss = loss - entropy_coef * entropy_term
        metrics["losses/entropy"] = masked_mean(entropy.detach(), mask)
    if kl_coef != 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 puts the KL in the loss and needs ref_logprobs")
        ref_logprobs = _fill_padding(ref_logprobs, mask, logprobs.detach())
        kl = kl_penalty(logprobs, ref_logprobs, kl_estimator, mask)
        loss = loss + kl_coef * aggregate_loss(kl, mask, aggregation, counts)
        metrics["losses/kl_ref"] = masked_mean(kl.detach(), mask)
    if token_weights is not None:
        metrics["losses/behaviour_weight_mean"] = masked_mean(token_weights.detach(), mask)
    metrics["losses/actor_loss"] = loss.detach()
    return loss, metrics


def behaviour_weights(
    proximal_logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, cap: float
) -> Tensor:
    """Per-token pi_prox / pi_behaviour, truncated at `cap`, zero on padding: the weights of the decoupled PPO
    objective (Hilton et al. 2021) for a batch sampled by an older policy than the one it is clipped against.

    With one-step off-policy rollouts the behaviour policy is one update behind; clipping the ratio against
    it (the plain objective) clips the tokens that update already moved, and the policy learns less per
    iteration. The decoupled objective clips against the proximal policy (the actor before this update) and
    corrects for the sampling policy with these weights. Truncation bounds the variance of rare tokens.
    """
    if cap <= 1.0:
        raise ValueError(f"the behaviour weight cap must be > 1, got {cap}")
    _check_same_shape(proximal_logprobs=proximal_logprobs, behaviour_logprobs=behaviour_logprobs, mask=mask)
    log_weight = (proximal_logprobs - behaviour_logprobs).clamp(-_MAX_LOG_RATIO, math.log(cap))
    return torch.exp(log_weight) * mask


def policy_loss_grpo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    ref_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_range: float,
    kl_coef: float,
    kl_estimator: str = "k3",
    dual_clip: float | None = None,
    aggregation: str = "token-mean",
    counts: TokenCounts | None = None,
    entropy: Tensor | None = None,
    entropy_coef: float = 0.0,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GRPO actor loss: PPO's clipped surrogate on group-relative advantages, KL to the reference in
    the loss (k3 by default, as in DeepSeekMath), no critic.

    Args:
        advantages: [B] from grpo_advantages (broadcast to every real token) or [B, T].
        other arguments: as policy_loss_ppo; ref_logprobs [B, T] is required.

    Returns:
        (loss 0-dim, metrics) as policy_loss_ppo, with losses/kl_ref when kl_coef != 0.
    """
    return policy_loss_ppo(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        clip_range,
        dual_clip=dual_clip,
        aggregation=aggregation,
        counts=counts,
        entropy=entropy,
        entropy_coef=entropy_coef,
        ref_logprobs=ref_logprobs,
        kl_coef=kl_coef,
        kl_estimator=kl_estimator,
        token_weights=token_weights,
    )


def value_loss_clipped(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None,
    aggregation: str = "token-mean",
    counts: TokenCounts | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss with value clipping: 0.5 * max((V - R)^2, (V_clip - R)^2).

    V_clip = V_old + clamp(V - V_old, -clip_range, clip_range) keeps the critic from moving far from
    its rollout-time values in one update (config ppo.value_clip_range; None disables).

    Args:
        values: [B, T] current critic output (with grad).
        old_values: [B, T] critic values at rollout time.
        returns: [B, T] GAE returns.
        mask: [B, T] response mask.

    Returns:
        (loss 0-dim, metrics): losses/value_loss, losses/vf_clipfrac (share of tokens where the clipped
        branch is the larger), losses/value_mean.
    """
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    old_values = _fill_padding(old_values, mask, values.detach())
    returns = _fill_padding(returns, mask, values.detach())
    unclipped = (values - returns) ** 2
    if clip_range is None:
        per_token = 0.5 * unclipped
        clipped_active = torch.zeros_like(mask, dtype=torch.bool)
    else:
        values_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (values_clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clipped_active = clipped > unclipped
    loss = aggregate_loss(per_token, mask, aggregation, counts)
    metrics = {
        "losses/value_loss": loss.detach(),
        "losses/vf_clipfrac": masked_mean(clipped_active.float(), mask),
        "losses/value_mean": masked_mean(values.detach(), mask),
    }
    return loss, metrics


@torch.no_grad()
def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[R - V] / Var[R] over real tokens: 1 = perfect critic, 0 = no better than a constant.

    Args:
        values, returns, mask: [B, T].

    Returns:
        0-dim tensor; NaN when the returns are constant (the ratio is undefined).
    """
    _check_same_shape(values=values, returns=returns, mask=mask)
    dtype = _work_dtype(values)
    var_returns = masked_var(returns.to(dtype), mask)
    if float(var_returns) == 0.0:
        return torch.tensor(float("nan"), dtype=dtype, device=values.device)
    return 1.0 - masked_var((returns - values).to(dtype), mask) / var_returns
