"""From a rollout's completions to the learning signal; not the forwards that give log-probs and values.

The combined score of the reward models and functions, its shaping, the KL to the reference, advantages and
returns. The tensor algebra is in losses.py (pure functions, tested against plain loops); this module applies
the stage's settings (ppo.*) to it in the iteration's order. The forwards are experience_passes.py's.
"""

from __future__ import annotations

import torch

from alignflow.config import PPOConfig
from alignflow.stages.common.reward_scoring import score_with_reward_models
from alignflow.stages.ppo import losses as rl
from alignflow.stages.ppo.checkpoints import RLState
from alignflow.stages.ppo.experience import Experience
from alignflow.stages.ppo.nan_guard import check_finite
from alignflow.stages.ppo.reward_functions import call_reward_function


def compute_scores(
    reward_models,
    reward_fns,
    prompts: list[str],
    completions: list[str],
    sequences: list[list[int]],
    response_ids: list[list[int]],
    finish_reasons: list[str],
    pad_id: int,
    cfg: PPOConfig,
    columns: dict[str, list] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(B,) combined raw score and each component (B,): weighted, z-scored reward models plus reward functions
    (called as TRL calls them, with the prompts' dataset `columns`: name -> one value per row).

    sequences[b] is the prompt's tokens followed by response_ids[b]."""
    if reward_models:
        # with the prompt lengths, a GRPO group's sequences share one copy of their prompt
        prompt_lengths = [len(s) - len(r) for s, r in zip(sequences, response_ids, strict=True)]
        components, total = score_with_reward_models(
            reward_models, sequences, pad_id, prompt_lengths=prompt_lengths
        )
    else:  # GRPO on reward functions alone
        components, total = {}, torch.zeros(len(sequences))
    weights = cfg.reward_function_weights or [1.0] * len(reward_fns)
    for (name, fn), weight in zip(reward_fns, weights, strict=True):
        values = torch.tensor(
            call_reward_function(
                name,
                fn,
                prompts,
                completions,
                completion_ids=response_ids,
                finish_reasons=finish_reasons,
                **(columns or {}),
            ),
            dtype=torch.float32,
        )
        components[name] = values
        total = total + weight * values
    return total, components


def shape_scores(
    raw: torch.Tensor, finished_with_eos: torch.Tensor, state: RLState, cfg: PPOConfig
) -> torch.Tensor:
    """Missing-EOS penalty, then running normalisation (optional), then clipping."""
    scores = rl.apply_missing_eos_penalty(raw, finished_with_eos, cfg.missing_eos_penalty)
    if cfg.normalize_reward:
        scores = rl.normalize_scores(scores, state.score_stats, update=True)
    return rl.clip_scores(scores, cfg.reward_clip)


def kl_estimator(cfg: PPOConfig) -> str:
    """ppo.kl_estimator, or the algorithm's own when unset: k1 for PPO (the KL in the reward), k3 for GRPO
    (in the loss, where a non-negative estimate keeps the penalty from rewarding a move away from the
    reference)."""
    return cfg.kl_estimator or ("k3" if cfg.algorithm == "grpo" else "k1")


def needs_reference(cfg: PPOConfig) -> bool:
    """Whether the reference forward runs: not when the KL can play no part (coefficient 0, not adaptive, no
    metric asked)."""
    return cfg.kl_coef > 0 or cfg.adaptive_kl or cfg.kl_metric


def kl_shapes_advantages(cfg: PPOConfig) -> bool:
    """Whether the advantages depend on the KL to the reference: PPO's KL in the reward. GRPO's KL and PPO's
    kl_in_reward: false are terms of the loss, which reads the reference's log-probs itself."""
    return cfg.algorithm == "ppo" and cfg.kl_in_reward


def kl_and_advantages(
    exp: Experience,
    cfg: PPOConfig,
    kl_coef: float,
    with_reference: bool,
    iteration: int,
    values_known: bool = True,
) -> None:
    """KL to the reference (zero when the reference is skipped), then advantages; both checked for NaN.
    values_known False: the KL only (train_on fills the advantages once the critic's first forward gave
    values)."""
    estimator = kl_estimator(cfg)
    if with_reference:
        exp.kl = rl.kl_penalty(exp.old_logprobs, exp.ref_logprobs, estimator, exp.response_mask)
        check_finite("the KL to the reference", exp.kl, iteration)
    if values_known:
        checked_advantages(exp, cfg, kl_coef, iteration)


def checked_advantages(exp: Experience, cfg: PPOConfig, kl_coef: float, iteration: int) -> None:
    """advantages_for, then the NaN check."""
    advantages_for(exp, cfg, kl_coef)
    check_finite("the advantages", exp.advantages, iteration)


def advantages_for(exp: Experience, cfg: PPOConfig, kl_coef: float) -> None:
    """Fill token_rewards, advantages and returns: GAE for PPO, group-relative for GRPO."""
    mask = exp.response_mask
    if cfg.algorithm == "grpo":
        exp.token_rewards = rl.token_rewards_from_scores(
            exp.scores, exp.kl, 0.0, mask
        )  # GRPO: KL is in the loss
        exp.advantages = rl.sequence_to_token(
            rl.grpo_advantages(exp.scores, cfg.group_size, cfg.grpo_scale_std), mask
        )
        exp.returns = None
        return
    coef = kl_coef if cfg.kl_in_reward else 0.0
    exp.token_rewards = rl.token_rewards_from_scores(exp.scores, exp.kl, coef, mask)
    advantages, returns = rl.compute_gae(exp.token_rewards, exp.values, mask, cfg.gamma, cfg.lam)
    exp.advantages = rl.whiten(advantages, mask) if cfg.whiten_advantages else advantages
    exp.returns = returns
