"""Log pi(response | prompt) of a causal LM for a batch of (prompt, response) token-id pairs.

One function, used where a policy's log-probability of whole responses is needed outside the RL
loop: DPO's policy and reference terms, and the evaluation stage's KL to the SFT policy. What it
is not: batching over many pairs (the callers cut their own batches) or the RL stage's per-token
log-probs of rollouts (stages/ppo/).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from alignflow.kernels import selective_log_softmax
from alignflow.stages.common.devices import device_of
from alignflow.stages.common.tokenization import pad_right
from alignflow.stages.common.training.precision import Precision


def response_logprobs(model: Any, prompts: list[list[int]], responses: list[list[int]], pad_id: int,
                      mean: bool = False, precision: Precision | None = None) -> torch.Tensor:
    """[N] float32 log pi(response_i | prompt_i) under `model` at temperature 1: the sum over the response
    tokens of log p(token | prefix), or their per-token mean when `mean`.

    One forward over the N sequences prompt_i + response_i, right-padded with `pad_id` to the longest
    length T: input_ids and attention_mask [N, T], logits [N, T, V]. Position t's logits predict token
    t + 1, so response token j of row i (at position P_i + j, P_i = len(prompt_i)) is scored by the logits
    at P_i + j - 1: the response mask [N, T - 1] is P_i - 1 <= t < P_i + R_i - 1. The batch goes to the
    model's device (`model` may be a DeepSpeed engine) and the forward runs in `precision` (None: the
    model's dtype). Differentiable with respect to the model's parameters; wrap in torch.no_grad() to only
    evaluate. A row with an empty response sums to 0 (its mean is not a number).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"response_logprobs needs one response per prompt; got {len(prompts)} prompts and "
                         f"{len(responses)} responses")
    device = device_of(model)
    sequences = [p + r for p, r in zip(prompts, responses, strict=True)]
    input_ids = pad_right(sequences, pad_id).to(device)  # [N, T]
    attention_mask = pad_right([[1] * len(s) for s in sequences], 0).to(device)  # [N, T]
    with precision.forward() if precision is not None else contextlib.nullcontext():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # [N, T, V]
    logp = selective_log_softmax(logits[:, :-1], input_ids[:, 1:])  # [N, T-1] fp32: log p(input_ids[:, t+1])
    positions = torch.arange(input_ids.shape[1] - 1, device=device).unsqueeze(0)  # [1, T-1]
    first = torch.tensor([len(p) - 1 for p in prompts], device=device).unsqueeze(1)  # [N, 1]
    response = (positions >= first) & (attention_mask[:, 1:] > 0)  # [N, T-1]: the response tokens
    per_row = (logp * response).sum(-1)  # [N]
    return per_row / response.sum(-1) if mean else per_row
