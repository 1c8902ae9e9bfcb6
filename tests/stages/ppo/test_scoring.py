"""The stage's scoring: the reward models see each GRPO group's prompt once, with unchanged scores."""

from __future__ import annotations

import torch

from alignflow.config import PPOConfig
from alignflow.stages.common.reward_scoring import RewardModel, raw_scores
from alignflow.stages.ppo.scoring import compute_scores
from tests.stages.common.test_reward_scoring import (
    GROUP_OWNERS,
    GROUP_RESPONSES,
    PAD,
    _classifier,
    _grouped,
    _Spy,
)


def test_compute_scores_shares_each_groups_prompt_with_the_reward_model(monkeypatch):
    model = _classifier(13)
    sequences, prompt_lengths = _grouped([5, 2, 7, 4], GROUP_OWNERS, GROUP_RESPONSES, seed=5)
    responses = [s[p:] for s, p in zip(sequences, prompt_lengths, strict=True)]
    padded = raw_scores(model, sequences, PAD, packed=False)
    spy = _Spy(monkeypatch)
    n = len(sequences)
    total, components = compute_scores(
        [RewardModel("rm", 2.0, 0.5, 4.0, model)], [], [""] * n, [""] * n, sequences, responses,
        ["eos"] * n, PAD, PPOConfig(algorithm="grpo", group_size=4),
    )
    assert spy.prefixed == [True]
    assert spy.tokens[0] < sum(map(len, sequences))  # a prompt went through the model fewer times
    torch.testing.assert_close(components["rm"], (padded - 0.5) / 4.0, rtol=0, atol=1e-5)
    torch.testing.assert_close(total, 2.0 * (padded - 0.5) / 4.0, rtol=0, atol=1e-5)
