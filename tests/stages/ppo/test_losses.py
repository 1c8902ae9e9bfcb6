"""Tests of the RL algorithms: each vectorised function against a plain Python loop, plus hand-worked numbers.

The tensors are on the session's device (--device); the references are plain Python, compared on the CPU.
Argument checks that raise before any arithmetic stay on the CPU."""

from __future__ import annotations

import math

import pytest
import torch

from alignflow.stages.ppo import losses as alg

# Vectorised float32 vs a float64 Python loop: float32 keeps ~7 significant digits, so rtol=1e-5 is tight;
# atol=1e-6 only covers values that are ~0 (e.g. advantages that cancel), where rtol means nothing.
RTOL, ATOL = 1e-5, 1e-6

# Odd shapes on purpose (B=5, T=11) and rows that end early, have one token, or have a hole mid-row.
LENGTH_PATTERNS = [
    [1] * 11,
    [1] * 7 + [0] * 4,
    [1] + [0] * 10,
    [1, 1, 1, 0, 1, 1, 0, 0, 0, 0, 0],  # a hole (e.g. a tool output that is not a policy token)
    [1] * 10 + [0],
]


def close(actual: torch.Tensor, expected, rtol: float = RTOL, atol: float = ATOL) -> None:
    expected_t = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.to("cpu", torch.float64), expected_t, rtol=rtol, atol=atol)


@pytest.fixture
def batch(device):
    """One minibatch's tensors on the session's device, drawn on the CPU (the same values on every device)."""
    gen = torch.Generator().manual_seed(0)
    mask = torch.tensor(LENGTH_PATTERNS, dtype=torch.float32)
    shape = mask.shape
    data = {
        "mask": mask,
        "rewards": torch.randn(shape, generator=gen),
        "values": torch.randn(shape, generator=gen),
        "logprobs": -torch.rand(shape, generator=gen) * 3,
        "ref_logprobs": -torch.rand(shape, generator=gen) * 3,
        "advantages": torch.randn(shape, generator=gen),
        "entropy": torch.rand(shape, generator=gen) * 2,
        "returns": torch.randn(shape, generator=gen),
    }
    # old = current + noise of +-0.5 so that ratios land on both sides of the 0.8/1.2 clip range.
    data["old_logprobs"] = data["logprobs"] + (torch.rand(shape, generator=gen) - 0.5)
    data["old_values"] = data["values"] + (torch.rand(shape, generator=gen) - 0.5)
    # Garbage in padding must never leak into results.
    for key in ("rewards", "values"):
        data[key] = torch.where(mask.bool(), data[key], torch.full_like(mask, float("nan")))
    return {key: value.to(device) for key, value in data.items()}


# ------------------------------------------------------------------------------------------------
# Plain-loop references
# ------------------------------------------------------------------------------------------------


def loop_gae(rewards, values, mask, gamma, lam):
    rewards, values, mask = rewards.tolist(), values.tolist(), mask.tolist()
    adv = [[0.0] * len(row) for row in mask]
    ret = [[0.0] * len(row) for row in mask]
    for b in range(len(mask)):
        real = [t for t in range(len(mask[b])) if mask[b][t]]
        next_value, next_adv = 0.0, 0.0
        for t in reversed(real):
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[b][t]
            adv[b][t] = next_adv
            ret[b][t] = next_adv + values[b][t]
    return adv, ret


def loop_kl(logp, ref, estimator):
    out = []
    for row_p, row_r in zip(logp.tolist(), ref.tolist(), strict=True):
        row = []
        for p, r in zip(row_p, row_r, strict=True):
            if estimator == "k1":
                row.append(p - r)
            elif estimator == "k2":
                row.append(0.5 * (p - r) ** 2)
            else:
                row.append(math.exp(r - p) - (r - p) - 1)
        out.append(row)
    return out


def loop_aggregate(per_token, mask, mode):
    """The minibatch loss of a nested list [B][T] under an aggregation mode, written out plainly."""
    if mode == "token-mean":
        total, count = 0.0, 0
        for b in range(len(mask)):
            for t in range(len(mask[b])):
                if mask[b][t]:
                    total += per_token[b][t]
                    count += 1
        return total / count
    seq_values = []
    for b in range(len(mask)):
        tokens = [per_token[b][t] for t in range(len(mask[b])) if mask[b][t]]
        if tokens:
            seq_values.append(sum(tokens) / len(tokens) if mode == "seq-mean-token-mean" else sum(tokens))
    return sum(seq_values) / len(seq_values)


def loop_masked_mean(values, mask):
    picked = [
        v for row_v, row_m in zip(values, mask, strict=True) for v, m in zip(row_v, row_m, strict=True) if m
    ]
    return sum(picked) / len(picked)


def loop_ppo_per_token(logp, old, adv, clip, dual_clip):
    """Per-token surrogate loss, clip flags and ratios as nested lists."""
    loss, clipped, dual, ratios = [], [], [], []
    for b in range(len(logp)):
        lr, cr, dr, rr = [], [], [], []
        for t in range(len(logp[b])):
            ratio = math.exp(logp[b][t] - old[b][t])
            a = adv[b][t]
            unclipped = -a * ratio
            clipped_value = -a * min(max(ratio, 1 - clip), 1 + clip)
            value = max(unclipped, clipped_value)
            is_dual = False
            if dual_clip is not None and a < 0 and value > -dual_clip * a:
                value, is_dual = -dual_clip * a, True
            lr.append(value)
            cr.append(clipped_value > unclipped)
            dr.append(is_dual)
            rr.append(ratio)
        loss.append(lr)
        clipped.append(cr)
        dual.append(dr)
        ratios.append(rr)
    return loss, clipped, dual, ratios


# ------------------------------------------------------------------------------------------------
# GAE
# ------------------------------------------------------------------------------------------------


def test_gae_hand_computed(device):
    # Row 0, 3 real tokens, gamma=0.9, lam=0.8 (gamma*lam = 0.72), V = [0.5, 0.6, 0.7], r = [0, 0, 1]:
    #   t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                 A2 = 0.3
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03              A1 = 0.03 + 0.72*0.3   = 0.246
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04              A0 = 0.04 + 0.72*0.246 = 0.21712
    #   returns = A + V = [0.71712, 0.846, 1.0]
    # Row 1, 2 real tokens then padding holding garbage (r=9, V=99 must be ignored), r = [0, 2]:
    #   t=1: delta = 2 + 0 - 0.6 = 1.4                     A1 = 1.4
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04              A0 = 0.04 + 0.72*1.4 = 1.048
    #   returns = [1.548, 2.0, 0]
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]], device=device)
    values = torch.tensor([[0.5, 0.6, 0.7], [0.5, 0.6, 99.0]], device=device)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], device=device)
    adv, ret = alg.compute_gae(rewards, values, mask, gamma=0.9, lam=0.8)
    close(adv, [[0.21712, 0.246, 0.3], [1.048, 1.4, 0.0]])
    close(ret, [[0.71712, 0.846, 1.0], [1.548, 2.0, 0.0]])


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0), (1.0, 0.0)])
def test_gae_matches_loop(batch, gamma, lam):
    adv, ret = alg.compute_gae(batch["rewards"], batch["values"], batch["mask"], gamma, lam)
    exp_adv, exp_ret = loop_gae(batch["rewards"], batch["values"], batch["mask"], gamma, lam)
    close(adv, exp_adv)
    close(ret, exp_ret)
    assert adv.dtype == torch.float32


def test_gae_upcasts_bf16(batch):
    rewards = torch.nan_to_num(batch["rewards"]).to(torch.bfloat16)
    values = torch.nan_to_num(batch["values"]).to(torch.bfloat16)
    adv, _ = alg.compute_gae(rewards, values, batch["mask"], 1.0, 0.95)
    assert adv.dtype == torch.float32
    exp_adv, _ = loop_gae(rewards.float(), values.float(), batch["mask"], 1.0, 0.95)
    close(adv, exp_adv)


def test_gae_shape_mismatch_is_named():
    with pytest.raises(ValueError, match=r"shape mismatch: token_rewards=\[2, 3\], values=\[2, 4\]"):
        alg.compute_gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), 1.0, 1.0)


# ------------------------------------------------------------------------------------------------
# KL, token rewards, EOS penalty, score normalisation
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimators_match_loop(batch, estimator):
    kl = alg.kl_penalty(batch["logprobs"], batch["ref_logprobs"], estimator)
    close(kl, loop_kl(batch["logprobs"], batch["ref_logprobs"], estimator))
    assert alg.KL_ESTIMATORS[estimator] is not None


def test_kl_hand_computed_and_masked(device):
    # logp - ref = 0.5: k1 = 0.5, k2 = 0.125, k3 = exp(-0.5) + 0.5 - 1 = 0.10653066
    logp, ref = torch.tensor([[-1.0, -1.0]], device=device), torch.tensor([[-1.5, -1.5]], device=device)
    mask = torch.tensor([[1, 0]], device=device)
    close(alg.kl_penalty(logp, ref, "k1", mask), [[0.5, 0.0]])
    close(alg.kl_penalty(logp, ref, "k2", mask), [[0.125, 0.0]])
    close(alg.kl_penalty(logp, ref, "k3", mask), [[0.10653066, 0.0]])


def test_unknown_kl_estimator_lists_valid():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; valid choices: k1, k2, k3"):
        alg.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_token_rewards_hand_computed(device):
    # kl_coef=0.1: every real token gets -0.1*kl; the score lands on the last real token.
    scores = torch.tensor([1.0, -2.0], device=device)
    kl = torch.tensor([[0.5, 1.0, 7.0], [0.2, -0.4, 0.1]], device=device)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], device=device)
    rewards = alg.token_rewards_from_scores(scores, kl, 0.1, mask)
    close(rewards, [[-0.05, -0.1 + 1.0, 0.0], [-0.02, 0.04, -0.01 - 2.0]])


def test_token_rewards_match_loop(batch, device):
    gen = torch.Generator().manual_seed(1)
    scores = torch.randn(batch["mask"].shape[0], generator=gen).to(device)
    kl = alg.kl_penalty(batch["logprobs"], batch["ref_logprobs"], "k1")
    rewards = alg.token_rewards_from_scores(scores, kl, 0.05, batch["mask"])
    expected = []
    for b, row in enumerate(batch["mask"].tolist()):
        last = max(t for t, m in enumerate(row) if m)
        expected.append(
            [
                (-0.05 * kl[b, t].item() if m else 0.0) + (scores[b].item() if t == last else 0.0)
                for t, m in enumerate(row)
            ]
        )
    close(rewards, expected)


def test_token_rewards_reject_empty_response():
    with pytest.raises(ValueError, match=r"rows \[1\] of the response mask have no tokens"):
        alg.token_rewards_from_scores(
            torch.ones(2), torch.zeros(2, 3), 0.1, torch.tensor([[1, 0, 0], [0, 0, 0]])
        )


def test_has_eos_and_missing_eos_penalty(device):
    ids = torch.tensor([[5, 2, 0], [5, 6, 7], [2, 9, 9], [0, 0, 0]], device=device)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]], device=device)
    finished = alg.has_eos(ids, mask, eos_token_ids=2)
    assert finished.tolist() == [True, False, True, False]
    assert alg.has_eos(ids, mask, eos_token_ids=[7, 2]).tolist() == [True, True, True, False]
    scores = torch.tensor([1.0, 1.0, 0.5, 0.0], device=device)
    close(alg.apply_missing_eos_penalty(scores, finished, -1.0), [1.0, 0.0, 0.5, -1.0])
    assert alg.apply_missing_eos_penalty(scores, finished, None) is scores


def test_clip_scores(device):
    close(alg.clip_scores(torch.tensor([-20.0, 3.0, 12.0], device=device), 10.0), [-10.0, 3.0, 10.0])
    with pytest.raises(ValueError, match="reward clip must be > 0 or None, got -1"):
        alg.clip_scores(torch.zeros(1), -1)


def test_running_mean_std_matches_whole_batch_and_round_trips(device):
    gen = torch.Generator().manual_seed(2)
    chunks = [(torch.randn(n, generator=gen) * 3 + 1).to(device) for n in (1, 7, 16, 5)]
    stats = alg.RunningMeanStd()
    assert (stats.mean, stats.var) == (0.0, 1.0)  # identity before any data
    for chunk in chunks:
        stats.update(chunk)
    everything = [x for chunk in chunks for x in chunk.tolist()]
    mean = sum(everything) / len(everything)
    var = sum((x - mean) ** 2 for x in everything) / len(everything)
    assert stats.count == 29
    assert stats.mean == pytest.approx(mean, rel=1e-12)
    assert stats.var == pytest.approx(var, rel=1e-12)
    restored = alg.RunningMeanStd()
    restored.load_state_dict(stats.state_dict())
    assert restored.state_dict() == stats.state_dict()
    with pytest.raises(ValueError, match=r"missing \['m2'\]"):
        restored.load_state_dict({"count": 1.0, "mean": 0.0})


def test_normalize_scores_hand_computed(device):
    # First batch [1, 3]: mean 2, population var 1 -> (s - 2) / 1 = [-1, 1]; std-only: [1, 3].
    stats = alg.RunningMeanStd()
    scores = torch.tensor([1.0, 3.0], device=device)
    close(alg.normalize_scores(scores, stats, eps=0.0), [-1.0, 1.0])
    close(
        alg.normalize_scores(scores, stats, update=False, shift_mean=False, eps=0.0),
        [1.0, 3.0],
    )


def test_whiten_matches_loop(batch):
    values = batch["advantages"]
    mask = batch["mask"]
    flat = [
        v
        for rv, rm in zip(values.tolist(), mask.tolist(), strict=True)
        for v, m in zip(rv, rm, strict=True)
        if m
    ]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((v - mean) ** 2 for v in flat) / len(flat) + 1e-8)
    for shift in (True, False):
        expected = [
            [((v - mean) / std + (0.0 if shift else mean)) if m else 0.0 for v, m in zip(rv, rm, strict=True)]
            for rv, rm in zip(values.tolist(), mask.tolist(), strict=True)
        ]
        close(alg.whiten(values, mask, shift_mean=shift), expected)


# ------------------------------------------------------------------------------------------------
# GRPO advantages
# ------------------------------------------------------------------------------------------------


def test_grpo_advantages_hand_computed(device):
    # Group [1, 2, 3]: mean 2, sample std 1 -> [-1, 0, 1].
    # Group [0, 0, 6]: mean 2, deviations [-2, -2, 4], sample var (4+4+16)/2 = 12, std 2*sqrt(3) = 3.4641016
    #   -> [-0.57735027, -0.57735027, 1.15470054]. eps=1e-6 moves these by < 1e-6 relative.
    scores = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 6.0], device=device)
    close(alg.grpo_advantages(scores, 3), [-1.0, 0.0, 1.0, -0.57735027, -0.57735027, 1.15470054])
    close(alg.grpo_advantages(scores, 3, scale_std=False), [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0])
    # A group where every completion scored the same carries no signal: advantage exactly 0.
    close(
        alg.grpo_advantages(torch.tensor([5.0, 5.0, 5.0, 1.0, 2.0, 3.0], device=device), 3)[:3],
        [0.0, 0.0, 0.0],
        atol=0,
    )


def test_grpo_advantages_match_loop(device):
    gen = torch.Generator().manual_seed(3)
    group_size, groups = 4, 5
    scores = torch.randn(group_size * groups, generator=gen).to(device)
    got = alg.grpo_advantages(scores, group_size, eps=1e-6)
    values = scores.tolist()
    expected = []
    for g in range(groups):
        members = values[g * group_size : (g + 1) * group_size]
        mean = sum(members) / group_size
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (group_size - 1))
        expected += [(x - mean) / (std + 1e-6) for x in members]
    close(got, expected)


def test_grpo_advantages_reject_bad_groups():
    with pytest.raises(ValueError, match="5 scores are not a whole number of groups of 2"):
        alg.grpo_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        alg.grpo_advantages(torch.zeros(4), 1)


def test_sequence_to_token(device):
    close(
        alg.sequence_to_token(
            torch.tensor([2.0, -1.0], device=device), torch.tensor([[1, 1, 0], [1, 0, 0]], device=device)
        ),
        [[2, 2, 0], [-1, 0, 0]],
    )


# ------------------------------------------------------------------------------------------------
# Losses
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(alg.LOSS_AGGREGATIONS))
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_policy_loss_ppo_matches_loop(batch, mode, dual_clip):
    mask = batch["mask"]
    logprobs = batch["logprobs"].clone().requires_grad_(True)
    loss, metrics = alg.policy_loss_ppo(
        logprobs,
        batch["old_logprobs"],
        batch["advantages"],
        mask,
        clip_range=0.2,
        dual_clip=dual_clip,
        aggregation=mode,
    )
    per_token, clipped, dual, ratios = loop_ppo_per_token(
        batch["logprobs"].tolist(),
        batch["old_logprobs"].tolist(),
        batch["advantages"].tolist(),
        0.2,
        dual_clip,
    )
    m = mask.tolist()
    assert loss.item() == pytest.approx(loop_aggregate(per_token, m, mode), rel=RTOL)
    assert metrics["losses/clipfrac"].item() == pytest.approx(loop_masked_mean(clipped, m), rel=RTOL)
    assert metrics["losses/dual_clipfrac"].item() == pytest.approx(
        loop_masked_mean(dual, m), rel=RTOL, abs=ATOL
    )
    assert metrics["losses/ratio_mean"].item() == pytest.approx(loop_masked_mean(ratios, m), rel=RTOL)
    approx_kl = [[r - 1 - math.log(r) for r in row] for row in ratios]
    assert metrics["losses/approx_kl"].item() == pytest.approx(loop_masked_mean(approx_kl, m), rel=RTOL)
    # Both cases must really occur in this batch, or the test would not exercise the clipping.
    assert 0 < metrics["losses/clipfrac"].item() < 1
    if dual_clip is not None:
        assert metrics["losses/dual_clipfrac"].item() > 0

    if mode == "token-mean":
        # d loss / d logp = -A * ratio on tokens where the unclipped branch is active, 0 where clipped.
        loss.backward()
        n_tokens = sum(sum(row) for row in m)
        adv = batch["advantages"].tolist()
        expected = [
            [
                (-adv[b][t] * ratios[b][t] / n_tokens)
                if m[b][t] and not clipped[b][t] and not dual[b][t]
                else 0.0
                for t in range(len(m[b]))
            ]
            for b in range(len(m))
        ]
        close(logprobs.grad, expected)


def test_entropy_bonus_and_kl_in_loss(batch):
    mask = batch["mask"]
    args = (batch["logprobs"], batch["old_logprobs"], batch["advantages"], mask, 0.2)
    base, _ = alg.policy_loss_ppo(*args)
    with_entropy, metrics = alg.policy_loss_ppo(*args, entropy=batch["entropy"], entropy_coef=0.01)
    mean_entropy = loop_masked_mean(batch["entropy"].tolist(), mask.tolist())
    assert with_entropy.item() == pytest.approx(base.item() - 0.01 * mean_entropy, rel=RTOL)
    assert metrics["losses/entropy"].item() == pytest.approx(mean_entropy, rel=RTOL)
    with_kl, metrics = alg.policy_loss_ppo(
        *args, ref_logprobs=batch["ref_logprobs"], kl_coef=0.1, kl_estimator="k2"
    )
    mean_kl = loop_masked_mean(loop_kl(batch["logprobs"], batch["ref_logprobs"], "k2"), mask.tolist())
    assert with_kl.item() == pytest.approx(base.item() + 0.1 * mean_kl, rel=RTOL)
    assert metrics["losses/kl_ref"].item() == pytest.approx(mean_kl, rel=RTOL)
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        alg.policy_loss_ppo(*args, kl_coef=0.1)


def test_policy_loss_grpo_matches_loop(batch, device):
    mask = batch["mask"]
    seq_adv = torch.tensor([1.0, -0.5, 0.25, -2.0, 0.75], device=device)
    loss, metrics = alg.policy_loss_grpo(
        batch["logprobs"],
        batch["old_logprobs"],
        batch["ref_logprobs"],
        seq_adv,
        mask,
        clip_range=0.2,
        kl_coef=0.04,
    )
    m = mask.tolist()
    token_adv = [[seq_adv[b].item()] * len(m[b]) for b in range(len(m))]
    surrogate, *_ = loop_ppo_per_token(
        batch["logprobs"].tolist(), batch["old_logprobs"].tolist(), token_adv, 0.2, None
    )
    k3 = loop_kl(batch["logprobs"], batch["ref_logprobs"], "k3")
    per_token = [
        [s + 0.04 * k for s, k in zip(rs, rk, strict=True)] for rs, rk in zip(surrogate, k3, strict=True)
    ]
    assert loss.item() == pytest.approx(loop_aggregate(per_token, m, "token-mean"), rel=RTOL)
    assert metrics["losses/kl_ref"].item() == pytest.approx(loop_masked_mean(k3, m), rel=RTOL)


@pytest.mark.parametrize("mode", list(alg.LOSS_AGGREGATIONS))
def test_decoupled_objective_weights_each_token_surrogate(batch, mode):
    """Off-policy batches: the surrogate clipped against the proximal policy, times pi_prox / pi_behaviour."""
    mask = batch["mask"]
    behaviour = batch["old_logprobs"] + 0.3 * torch.randn_like(batch["old_logprobs"])
    weights = alg.behaviour_weights(batch["old_logprobs"], behaviour, mask, cap=2.0)
    m, w = mask.tolist(), weights.tolist()
    loop_weights = [
        [min(math.exp(p - q), 2.0) * m[b][t] for t, (p, q) in enumerate(zip(rp, rq, strict=True))]
        for b, (rp, rq) in enumerate(zip(batch["old_logprobs"].tolist(), behaviour.tolist(), strict=True))
    ]
    close(weights, loop_weights)
    # the cap bites on some only
    assert max(max(row) for row in w) <= 2.0 and min(max(row) for row in w) < 2.0
    loss, metrics = alg.policy_loss_ppo(
        batch["logprobs"],
        batch["old_logprobs"],
        batch["advantages"],
        mask,
        0.2,
        aggregation=mode,
        token_weights=weights,
    )
    per_token, *_ = loop_ppo_per_token(
        batch["logprobs"].tolist(), batch["old_logprobs"].tolist(), batch["advantages"].tolist(), 0.2, None
    )
    weighted = [[s * wt for s, wt in zip(rs, rw, strict=True)] for rs, rw in zip(per_token, w, strict=True)]
    assert loss.item() == pytest.approx(loop_aggregate(weighted, m, mode), rel=RTOL)
    assert metrics["losses/behaviour_weight_mean"].item() == pytest.approx(loop_masked_mean(w, m), rel=RTOL)
    unweighted, _ = alg.policy_loss_ppo(
        batch["logprobs"],
        batch["old_logprobs"],
        batch["advantages"],
        mask,
        0.2,
        aggregation=mode,
        token_weights=torch.ones_like(mask, dtype=torch.float32),
    )
    plain, _ = alg.policy_loss_ppo(
        batch["logprobs"], batch["old_logprobs"], batch["advantages"], mask, 0.2, aggregation=mode
    )
    assert unweighted.item() == pytest.approx(plain.item(), rel=RTOL)
    with pytest.raises(ValueError, match="cap must be > 1"):
        alg.behaviour_weights(batch["old_logprobs"], behaviour, mask, cap=1.0)


def test_dual_clip_must_exceed_one(batch):
    with pytest.raises(ValueError, match=r"dual_clip must be > 1 \(e.g. 3.0\) or None, got 0.5"):
        alg.policy_loss_ppo(
            batch["logprobs"], batch["old_logprobs"], batch["advantages"], batch["mask"], 0.2, 0.5
        )


@pytest.mark.parametrize("mode", list(alg.LOSS_AGGREGATIONS))
def test_value_loss_clipped_matches_loop(batch, mode):
    values = torch.nan_to_num(batch["values"])
    loss, metrics = alg.value_loss_clipped(
        values, batch["old_values"], batch["returns"], batch["mask"], 0.2, mode
    )
    v, old, ret, m = (
        values.tolist(),
        batch["old_values"].tolist(),
        batch["returns"].tolist(),
        batch["mask"].tolist(),
    )
    per_token, clipped = [], []
    for b in range(len(v)):
        row_loss, row_clip = [], []
        for t in range(len(v[b])):
            v_clip = old[b][t] + min(max(v[b][t] - old[b][t], -0.2), 0.2)
            unclipped_sq, clipped_sq = (v[b][t] - ret[b][t]) ** 2, (v_clip - ret[b][t]) ** 2
            row_loss.append(0.5 * max(unclipped_sq, clipped_sq))
            row_clip.append(clipped_sq > unclipped_sq)
        per_token.append(row_loss)
        clipped.append(row_clip)
    assert loss.item() == pytest.approx(loop_aggregate(per_token, m, mode), rel=RTOL)
    assert metrics["losses/vf_clipfrac"].item() == pytest.approx(loop_masked_mean(clipped, m), rel=RTOL)
    assert 0 < metrics["losses/vf_clipfrac"].item() < 1


def test_value_loss_hand_computed(device):
    # V_old = 0, V = 1, R = 2, clip 0.2: unclipped 0.5*(1-2)^2 = 0.5; clipped V = 0.2 -> 0.5*1.8^2 = 1.62.
    loss, metrics = alg.value_loss_clipped(
        *(torch.tensor([[v]], device=device) for v in (1.0, 0.0, 2.0, 1)), 0.2
    )
    assert loss.item() == pytest.approx(1.62, rel=RTOL)
    assert metrics["losses/vf_clipfrac"].item() == 1.0


def test_explained_variance_matches_loop(batch):
    values = torch.nan_to_num(batch["values"])
    got = alg.explained_variance(values, batch["returns"], batch["mask"])
    m = batch["mask"].tolist()
    ret = [
        x
        for rr, rm in zip(batch["returns"].tolist(), m, strict=True)
        for x, k in zip(rr, rm, strict=True)
        if k
    ]
    val = [x for rv, rm in zip(values.tolist(), m, strict=True) for x, k in zip(rv, rm, strict=True) if k]
    diff = [r - v for r, v in zip(ret, val, strict=True)]

    def var(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    assert got.item() == pytest.approx(1 - var(diff) / var(ret), rel=RTOL)
    assert math.isnan(alg.explained_variance(values, torch.ones_like(values), batch["mask"]).item())
    perfect = alg.explained_variance(batch["returns"], batch["returns"], batch["mask"])
    assert perfect.item() == 1.0


# ------------------------------------------------------------------------------------------------
# Aggregation over micro-batches (single process; the two-rank version is in its own file)
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(alg.LOSS_AGGREGATIONS))
def test_aggregation_over_uneven_micro_batches_sums_to_full(batch, mode):
    per_token = batch["advantages"]
    mask = batch["mask"]
    full = alg.aggregate_loss(per_token, mask, mode)
    assert full.item() == pytest.approx(loop_aggregate(per_token.tolist(), mask.tolist(), mode), rel=RTOL)
    splits = [slice(0, 1), slice(1, 4), slice(4, 5)]  # 11, 1+1+5 and 10 tokens: very uneven
    counts = alg.minibatch_token_counts([mask[s] for s in splits])
    assert counts == alg.TokenCounts(tokens=sum(sum(r) for r in LENGTH_PATTERNS), sequences=5)
    shares = sum(alg.aggregate_loss(per_token[s], mask[s], mode, counts) for s in splits)
    assert shares.item() == pytest.approx(full.item(), rel=RTOL)


def test_unknown_aggregation_lists_valid():
    with pytest.raises(
        ValueError,
        match="unknown loss aggregation 'mean'; valid choices: "
        "seq-mean-token-mean, seq-mean-token-sum, token-mean",
    ):
        alg.aggregate_loss(torch.zeros(1, 1), torch.ones(1, 1), "mean")


def test_garbage_in_padding_cannot_reach_the_gradient(batch):
    mask = batch["mask"]
    nan = torch.full_like(mask, float("nan"))

    def pad_nan(x):
        return torch.where(mask.bool(), x, nan)

    logprobs = batch["logprobs"].clone().requires_grad_(True)
    loss, _ = alg.policy_loss_ppo(
        logprobs,
        pad_nan(batch["old_logprobs"]),
        pad_nan(batch["advantages"]),
        mask,
        0.2,
        dual_clip=2.0,
        ref_logprobs=pad_nan(batch["ref_logprobs"]),
        kl_coef=0.1,
    )
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
    assert (logprobs.grad[~mask.bool()] == 0).all()
    values = torch.nan_to_num(batch["values"]).requires_grad_(True)
    vloss, _ = alg.value_loss_clipped(
        values, pad_nan(batch["old_values"]), pad_nan(batch["returns"]), mask, 0.2
    )
    vloss.backward()
    assert torch.isfinite(vloss) and torch.isfinite(values.grad).all()
