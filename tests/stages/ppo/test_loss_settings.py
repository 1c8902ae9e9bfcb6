"""ppo.loss_aggregation and ppo.kl_estimator reach the losses train_on optimises (none silently ignored)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from alignflow.config import PPOConfig
from alignflow.stages.ppo import losses as rl
from alignflow.stages.ppo.experience import policy_logprobs
from alignflow.stages.ppo.scoring import kl_estimator
from alignflow.stages.ppo.training_loop import train_on
from tests.stages.ppo.test_train_shortcuts import (
    FP32,
    PlainTrainEngine,
    actor_model,
    checkpoint,
    ppo_config,
    rollout,
)

__all__ = ["checkpoint", "rollout"]  # module fixtures shared with the shortcut tests


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    yield


def test_each_algorithm_has_its_own_kl_estimator_and_a_chosen_one_is_honoured():
    assert kl_estimator(PPOConfig()) == "k1"  # PPO: the KL in the reward
    assert kl_estimator(PPOConfig(algorithm="grpo", group_size=2)) == "k3"  # GRPO: in the loss, non-negative
    assert kl_estimator(PPOConfig(algorithm="grpo", group_size=2, kl_estimator="k2")) == "k2"
    assert kl_estimator(PPOConfig(kl_estimator="k3")) == "k3"


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("estimator", [None, "k1"])
def test_the_policy_loss_of_train_on_is_the_chosen_aggregation_and_estimator(
    checkpoint, rollout, device, mode, estimator
):
    """One epoch of one minibatch holding every row: train_on's loss is taken before its only step, so it
    equals the pure loss function's at the starting weights with that aggregation and KL estimator (GRPO, KL
    in the loss); the three aggregations give three different numbers on rows of different lengths."""
    cfg = ppo_config(
        ppo_epochs=1, kl_coef=0.1, loss_aggregation=mode, kl_estimator=estimator, fast_train_step=False
    )
    model = actor_model(checkpoint, device)
    exp = copy.copy(rollout)
    # Rows of different lengths (the losses count the first 3, 4, ... tokens of each), where the aggregations
    # differ.
    columns = torch.arange(exp.response_mask.shape[1], device=exp.response_mask.device)
    lengths = torch.arange(exp.response_mask.shape[0], device=columns.device)[:, None] + 3
    exp.response_mask = mask = exp.response_mask * (columns[None, :] < lengths)
    # A reference the policy has moved from, by more on later tokens and rows.
    exp.ref_logprobs = (
        exp.rollout_logprobs - torch.linspace(0.0, 0.5, mask.numel(), device=mask.device).reshape(mask.shape)
    ) * mask
    with torch.no_grad():
        logp = policy_logprobs(model, exp, temperature=1.0)[0]
    expected = {
        m: float(
            rl.policy_loss_grpo(
                logp,
                exp.old_logprobs,
                exp.ref_logprobs,
                exp.advantages,
                exp.response_mask,
                0.2,
                kl_coef=0.1,
                kl_estimator=estimator or "k3",
                aggregation=m,
            )[0]
        )
        for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
    }
    assert len({round(v, 6) for v in expected.values()}) == 3, expected  # the modes differ on these rows
    metrics = train_on(exp, PlainTrainEngine(model), None, cfg, 0.1, 1, FP32)
    assert math.isclose(metrics["losses/actor_loss"], expected[mode], rel_tol=1e-5, abs_tol=1e-7), (
        metrics,
        expected,
    )
