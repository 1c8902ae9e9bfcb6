"""DPO losses against a plain-Python loop and against hand-computed literals, on the session's device."""

from __future__ import annotations

import math

import pytest
import torch

from alignflow.stages.dpo.losses import LOSSES, get_loss, log_ratio_margin, preference_loss


def _log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def _loop_loss(name: str, pc: float, pr: float, rc: float, rr: float, beta: float, eps: float) -> float:
    """One pair, written straight from the papers' formulas."""
    h = (pc - rc) - (pr - rr)
    if name == "sigmoid":
        return -_log_sigmoid(beta * h)
    if name == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    if name == "cdpo":
        return -(1 - eps) * _log_sigmoid(beta * h) - eps * _log_sigmoid(-beta * h)
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("n", [1, 6, 43])
def test_each_loss_matches_its_plain_loop(name, n, device):
    generator = torch.Generator().manual_seed(n)
    # Sequence log-probs are negative sums over tokens: tens of nats, margins of either sign.
    pc, pr, rc, rr = (-30 * torch.rand(n, generator=generator, dtype=torch.float64).to(device)
                      for _ in range(4))
    beta, eps = 0.3, 0.15 if name == "cdpo" else 0.0
    out = preference_loss(name, pc, pr, rc, rr, beta, eps)
    expected = torch.tensor([_loop_loss(name, *(float(t[i]) for t in (pc, pr, rc, rr)), beta, eps)
                             for i in range(n)], dtype=torch.float64, device=device)
    torch.testing.assert_close(out.losses, expected, rtol=1e-5, atol=0)
    torch.testing.assert_close(out.chosen_rewards, beta * (pc - rc), rtol=1e-12, atol=0)
    torch.testing.assert_close(out.rejected_rewards, beta * (pr - rr), rtol=1e-12, atol=0)


def test_hand_computed_literals(device):
    # One pair with margin h = (-10 - -12) - (-20 - -21) = 2 - 1 = 1 nat, beta = 0.1.
    one = [torch.tensor([v], dtype=torch.float64, device=device) for v in (-10.0, -20.0, -12.0, -21.0)]
    assert float(log_ratio_margin(*one)) == 1.0
    # sigmoid: -log sigmoid(0.1) = log(1 + e^-0.1)
    assert float(preference_loss("sigmoid", *one, beta=0.1).losses) == pytest.approx(0.6443966600735709,
                                                                                     rel=1e-12)
    # ipo: (1 - 1 / 0.2)^2 = 16
    assert float(preference_loss("ipo", *one, beta=0.1).losses) == pytest.approx(16.0, rel=1e-12)
    # cdpo, e = 0.1: 0.9 * log(1 + e^-0.1) + 0.1 * log(1 + e^0.1) = 0.57995699 + 0.07443967
    assert float(preference_loss("cdpo", *one, beta=0.1, label_smoothing=0.1).losses) == pytest.approx(
        0.6543966600735709, rel=1e-12)
    # cdpo at e = 0 is the sigmoid loss; rewards are beta * log-ratios: 0.1 * 2 and 0.1 * 1.
    out = preference_loss("cdpo", *one, beta=0.1, label_smoothing=0.0)
    assert float(out.losses) == pytest.approx(0.6443966600735709, rel=1e-12)
    assert out.metrics() == pytest.approx({"rewards/chosen": 0.2, "rewards/rejected": 0.1,
                                           "rewards/margin": 0.1, "rewards/accuracy": 1.0})


def test_gradients_push_the_chosen_response_up(device):
    pc = torch.tensor([-5.0], requires_grad=True, device=device)
    pr = torch.tensor([-5.0], requires_grad=True, device=device)
    for name in LOSSES:
        pc.grad = pr.grad = None
        reference = torch.tensor([-5.0], device=device)
        preference_loss(name, pc, pr, reference, reference, beta=0.5,
                        label_smoothing=0.1 if name == "cdpo" else 0.0).losses.sum().backward()
        # Descent raises log pi(chosen) and lowers log pi(rejected).
        assert float(pc.grad) < 0 < float(pr.grad), name


def test_unknown_loss_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown DPO loss 'kto'; valid losses: sigmoid, ipo, cdpo"):
        get_loss("kto")


def test_rpo_adds_the_weighted_chosen_nll_to_each_pair(device):
    one = [torch.tensor([v], dtype=torch.float64, device=device) for v in (-10.0, -20.0, -12.0, -21.0)]
    nll = torch.tensor([2.5], dtype=torch.float64, device=device)  # e.g. -10 nats over 4 chosen tokens
    out = preference_loss("sigmoid", *one, beta=0.1, chosen_nll=nll, nll_coef=0.4)
    assert float(out.losses) == pytest.approx(0.6443966600735709 + 0.4 * 2.5, rel=1e-12)
    with pytest.raises(ValueError, match="nll_coef > 0 needs chosen_nll"):
        preference_loss("sigmoid", *one, beta=0.1, nll_coef=0.4)
