"""response_logprobs (DPO's and the evaluation's log pi(response | prompt)) against a plain per-row loop."""

from __future__ import annotations

import pytest
import torch

from alignflow.stages.common.training.response_logprobs import response_logprobs
from tests.stages.common.generation.engine_test_models import tiny_config

PAD = 0
# Odd lengths so that right-padding and the prompt/response boundary differ between rows; one row is the
# longest in both parts, one has a one-token response.
PROMPT_LENGTHS = (3, 7, 1, 5, 6, 2)
RESPONSE_LENGTHS = (4, 1, 6, 2, 9, 3)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config("llama_mha_untied")
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _pairs() -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    responses = [torch.randint(3, 256, (n,), generator=g).tolist() for n in RESPONSE_LENGTHS]
    return prompts, responses


def _loop_logprob(model, prompt: list[int], response: list[int], mean: bool) -> torch.Tensor:
    """The slow reference: one unpadded row, a full log-softmax, a Python loop over the response tokens."""
    ids = torch.tensor([prompt + response], device=next(model.parameters()).device)
    logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)  # [T, V]
    total = sum(logp[len(prompt) + j - 1, token] for j, token in enumerate(response))
    return total / len(response) if mean else total


@pytest.mark.parametrize("mean", [False, True])
def test_batched_log_probs_and_gradients_match_a_per_row_loop(model, device, mean):
    model = model.to(device)
    prompts, responses = _pairs()
    fast = response_logprobs(model, prompts, responses, PAD, mean=mean)
    assert fast.shape == (len(prompts),) and fast.dtype == torch.float32
    fast_grad = torch.autograd.grad(fast.sum(), model.lm_head.weight)[0]
    slow_rows = [_loop_logprob(model, p, r, mean) for p, r in zip(prompts, responses, strict=True)]
    slow = torch.stack(slow_rows)
    slow_grad = torch.autograd.grad(slow.sum(), model.lm_head.weight)[0]
    # fp32 logits; padding and the batch change only the summation order of the attention and the GEMMs
    # (~1e-6), while a mask off by one token moves a row by a whole token's log-prob (~5 nats here).
    torch.testing.assert_close(fast, slow.detach(), rtol=0, atol=1e-4)
    torch.testing.assert_close(fast_grad, slow_grad, rtol=0, atol=1e-4)
    assert fast_grad.abs().max() > 1e-2  # the gradient check compares something, not 0 with 0


def test_rows_do_not_depend_on_their_batch(model, device):
    model = model.to(device)
    prompts, responses = _pairs()
    with torch.no_grad():
        together = response_logprobs(model, prompts, responses, PAD)
        alone = torch.cat([response_logprobs(model, [p], [r], PAD)
                           for p, r in zip(prompts, responses, strict=True)])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-4)


def test_one_response_per_prompt():
    with pytest.raises(ValueError, match="one response per prompt; got 2 prompts and 1 responses"):
        response_logprobs(None, [[1], [2]], [[3]], PAD)
