"""Two data-parallel ranks on CPU (gloo): token-level loss aggregation gives the full-batch gradient.

Each rank holds a different number of sequences, tokens and micro-batches. Summing the per-micro-batch
shares (normalised by the all-reduced minibatch counts) and all-reducing the gradients must equal the
single-process gradient of the whole minibatch; the naive "mean of per-micro-batch means, averaged
over ranks" must not (so the test can fail).
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from alignflow.stages.ppo import losses as alg

WORLD_SIZE = 2
# 7 sequences of very different lengths, padded to T=9.
LENGTHS = [1, 9, 3, 7, 2, 8, 5]
# Rank 0: two micro-batches (1+9 and 3 tokens = 13); rank 1: one micro-batch (7+2+8+5 = 22 tokens).
RANK_MICRO_BATCHES = {0: [[0, 1], [2]], 1: [[3, 4, 5, 6]]}
VOCAB, DIM = 6, 4


def _minibatch() -> dict[str, torch.Tensor]:
    """The same full minibatch on every rank (fixed seed), float64 so gradients compare at 1e-10."""
    gen = torch.Generator().manual_seed(0)
    batch, length = len(LENGTHS), max(LENGTHS)
    mask = torch.tensor([[1.0] * n + [0.0] * (length - n) for n in LENGTHS], dtype=torch.float64)
    features = torch.randn(batch, length, DIM, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (batch, length), generator=gen)
    init = torch.randn(DIM, VOCAB, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        logprobs = _logprobs(init, features, tokens)
    return {
        "mask": mask,
        "features": features,
        "tokens": tokens,
        "weight": init,
        # Old policy = current + noise, so some ratios fall outside the clip range.
        "old_logprobs": logprobs
        + 0.4 * (torch.rand(batch, length, generator=gen, dtype=torch.float64) - 0.5),
        "advantages": torch.randn(batch, length, generator=gen, dtype=torch.float64),
    }


def _logprobs(weight: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """A linear 'policy': log softmax(features @ W) at the sampled tokens -> [B, T]."""
    return torch.log_softmax(features @ weight, dim=-1).gather(-1, tokens[..., None]).squeeze(-1)


def _loss(weight: torch.Tensor, data: dict[str, torch.Tensor], rows: list[int] | None, mode: str, counts):
    """Actor loss (surrogate + entropy bonus) of the given rows, trimmed to their longest response."""
    pick = slice(None) if rows is None else rows
    mask = data["mask"][pick]
    width = int(mask.sum(-1).max())  # micro-batches are padded to their own longest row, as in training
    mask = mask[:, :width]
    logits = data["features"][pick][:, :width] @ weight
    logprobs = torch.log_softmax(logits, -1).gather(-1, data["tokens"][pick][:, :width, None]).squeeze(-1)
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    loss, _ = alg.policy_loss_ppo(
        logprobs,
        data["old_logprobs"][pick][:, :width],
        data["advantages"][pick][:, :width],
        mask,
        clip_range=0.1,
        aggregation=mode,
        counts=counts,
        entropy=entropy,
        entropy_coef=0.01,
    )
    return loss


def _worker(rank: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/rendezvous",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        data = _minibatch()
        micro_batches = RANK_MICRO_BATCHES[rank]
        counts = alg.minibatch_token_counts([data["mask"][rows] for rows in micro_batches])
        results: dict[str, object] = {"counts": counts}
        for mode in alg.LOSS_AGGREGATIONS:
            # Global normalisation: sum of shares over micro-batches, then SUM of gradients over ranks.
            weight = data["weight"].clone().requires_grad_(True)
            loss_sum = torch.zeros((), dtype=torch.float64)
            for rows in micro_batches:
                loss = _loss(weight, data, rows, mode, counts)
                loss.backward()
                loss_sum += loss.detach()
            dist.all_reduce(weight.grad, op=dist.ReduceOp.SUM)
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)

            # Naive: each micro-batch is its own mean, averaged over micro-batches then over ranks (DDP).
            naive = data["weight"].clone().requires_grad_(True)
            for rows in micro_batches:
                (_loss(naive, data, rows, mode, None) / len(micro_batches)).backward()
            dist.all_reduce(naive.grad, op=dist.ReduceOp.SUM)
            naive_grad = naive.grad / WORLD_SIZE

            # Reference: one process, the whole minibatch at once.
            full = data["weight"].clone().requires_grad_(True)
            full_loss = _loss(full, data, None, mode, None)
            full_loss.backward()
            results[mode] = {
                "grad": weight.grad.clone(),
                "loss": loss_sum.clone(),
                "naive_grad": naive_grad.clone(),
                "full_grad": full.grad.clone(),
                "full_loss": full_loss.detach().clone(),
            }
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(_worker, args=(str(out_dir),), nprocs=WORLD_SIZE, join=True)
    with torch.serialization.safe_globals([alg.TokenCounts]):  # weights_only, with our one record type
        return [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD_SIZE)]


def test_counts_are_global(rank_results):
    for result in rank_results:
        assert result["counts"] == alg.TokenCounts(tokens=sum(LENGTHS), sequences=len(LENGTHS))


@pytest.mark.parametrize("mode", list(alg.LOSS_AGGREGATIONS))
def test_all_reduced_gradient_equals_full_batch_gradient(rank_results, mode):
    for result in rank_results:
        got = result[mode]
        # float64 throughout: only summation order differs, ~1e-16 relative.
        torch.testing.assert_close(got["grad"], got["full_grad"], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(got["loss"], got["full_loss"], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(rank_results[0][mode]["grad"], rank_results[1][mode]["grad"], rtol=0, atol=0)


@pytest.mark.parametrize("mode", list(alg.LOSS_AGGREGATIONS))
def test_naive_mean_of_means_is_wrong(rank_results, mode):
    got = rank_results[0][mode]
    error = (got["naive_grad"] - got["full_grad"]).norm() / got["full_grad"].norm()
    # With 13 vs 22 tokens and 3 vs 4 sequences per rank the naive weighting is off by well over 5%.
    assert error > 0.05, f"naive aggregation unexpectedly matched ({mode}: relative error {error:.2e})"
