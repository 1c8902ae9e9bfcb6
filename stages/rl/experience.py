"""The experience of one RL iteration, grouped by role with shapes, and the forward passes that fill it.

Layout: every sequence is `[left-padded prompt | right-padded response]`, so column P-1+t of the
logits predicts response token t for every row alike (P = prompt width, R = response width).
Position ids count real tokens only, so left padding does not shift RoPE positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

from alignflow.kernels import logprobs_and_entropy, selective_log_softmax


@dataclass
class Experience:
    """One iteration's rollouts. B = sequences (prompts x group size), R = response width."""

    # sequences
    input_ids: Tensor          # (B, P+R) long: left-padded prompt then right-padded response
    attention_mask: Tensor     # (B, P+R) long
    position_ids: Tensor       # (B, P+R) long
    response_ids: Tensor       # (B, R) long
    response_mask: Tensor      # (B, R) float: 1 on response tokens
    # policy
    rollout_logprobs: Tensor   # (B, R) from the engine (temperature-scaled, full vocabulary)
    old_logprobs: Tensor       # (B, R) recomputed by the actor before the update
    ref_logprobs: Tensor       # (B, R) frozen reference
    # critic (PPO only)
    values: Tensor | None      # (B, R) V(s_t) before each response token
    # rewards
    scores: Tensor             # (B,) combined score (reward models + functions, after shaping)
    token_rewards: Tensor      # (B, R)
    kl: Tensor                 # (B, R) per-token KL estimate to the reference
    advantages: Tensor         # (B, R)
    returns: Tensor | None     # (B, R) PPO only
    prompt_width: int = 0      # P

    def select(self, index: Tensor) -> Experience:
        """The rows `index` (a minibatch); tensors are indexed along dim 0."""
        values = {}
        for f in fields(self):
            item = getattr(self, f.name)
            values[f.name] = item[index] if isinstance(item, Tensor) else item
        return Experience(**values)


def assemble(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int]:
    """(input_ids, attention_mask, position_ids, response_ids, response_mask, P) for the layout above."""
    batch = len(prompt_ids)
    width_p = max(len(p) for p in prompt_ids)
    width_r = max(1, max(len(r) for r in response_ids))
    input_ids = torch.full((batch, width_p + width_r), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width_p + width_r), dtype=torch.long)
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids, strict=True)):
        start = width_p - len(prompt)
        input_ids[row, start:width_p] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, start:width_p] = 1
        if response:
            input_ids[row, width_p:width_p + len(response)] = torch.tensor(response, dtype=torch.long)
            attention_mask[row, width_p:width_p + len(response)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response = input_ids[:, width_p:]
    response_mask = attention_mask[:, width_p:].float()
    return input_ids, attention_mask, position_ids, response, response_mask, width_p


def _response_logits(model, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor, width_p: int) -> Tensor:
    """(B, R, V) logits at the columns that predict the response tokens."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    return logits[:, width_p - 1:-1]


def policy_logprobs(model, exp: Experience, temperature: float, with_entropy: bool = False
                    ) -> tuple[Tensor, Tensor | None]:
    """log pi(response token) under logits / temperature, (B, R); and the entropy (B, R) if asked."""
    logits = _response_logits(model, exp.input_ids, exp.attention_mask, exp.position_ids, exp.prompt_width)
    if with_entropy:
        logp, entropy = logprobs_and_entropy(logits, exp.response_ids, temperature=temperature)
        return logp * exp.response_mask, entropy * exp.response_mask
    return selective_log_softmax(logits, exp.response_ids, temperature=temperature) * exp.response_mask, None


def token_values(critic, exp: Experience) -> Tensor:
    """(B, R) critic values V(s_t) read before each response token, from a sequence-classification model.

    The critic is a separate model initialised from a reward model: its backbone's hidden states go
    through its scalar `score` head at every position, not only the last.
    """
    backbone = critic.base_model
    hidden = backbone(input_ids=exp.input_ids, attention_mask=exp.attention_mask,
                      position_ids=exp.position_ids).last_hidden_state
    values = critic.score(hidden).squeeze(-1).float()
    return values[:, exp.prompt_width - 1:-1] * exp.response_mask
