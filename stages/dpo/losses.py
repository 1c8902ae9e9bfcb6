"""DPO-family losses as pure tensor functions of policy and reference log-probs, chosen by name.

Every function takes per-pair sequence log-probs ([N] each: log pi(y|x) of the chosen and the
rejected response under the policy and the frozen reference) and returns per-pair losses [N];
the stage averages them over the pairs of an optimizer step. The implicit reward of a response is
beta * (log pi(y|x) - log ref(y|x)); a pair's margin is the chosen reward minus the rejected one,
divided by beta (`log_ratio_margin`). What this module is not: tokenisation or batching.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def log_ratio_margin(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
                     ref_rejected: torch.Tensor) -> torch.Tensor:
    """[N] h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)): how much more the policy prefers
    the chosen response than the reference does, in nats."""
    return (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)


def sigmoid_loss(margin: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """[N] DPO (Rafailov et al. 2023): -log sigmoid(beta * h), the Bradley-Terry likelihood of the label."""
    return -F.logsigmoid(beta * margin)


def ipo_loss(margin: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """[N] IPO (Azar et al. 2023): (h - 1 / (2 beta))^2, a squared loss that regresses the margin to a finite
    target instead of pushing it to infinity on deterministic preferences. The stage feeds it per-token
    mean log-probs (as the IPO paper's experiments and TRL do), so beta means the same at any length."""
    return (margin - 1.0 / (2.0 * beta)) ** 2


def cdpo_loss(margin: torch.Tensor, beta: float, label_smoothing: float = 0.0) -> torch.Tensor:
    """[N] conservative DPO (Mitchell 2023): the sigmoid loss with each label flipped with probability
    label_smoothing, -(1 - e) log sigmoid(beta h) - e log sigmoid(-beta h); the optimum margin is finite."""
    return (-(1.0 - label_smoothing) * F.logsigmoid(beta * margin)
            - label_smoothing * F.logsigmoid(-beta * margin))


LOSSES: dict[str, Callable[..., torch.Tensor]] = {"sigmoid": sigmoid_loss, "ipo": ipo_loss, "cdpo": cdpo_loss}
# Losses computed on per-token mean log-probs instead of sequence sums (see ipo_loss).
LENGTH_NORMALISED: frozenset[str] = frozenset({"ipo"})


def get_loss(name: str) -> Callable[..., torch.Tensor]:
    """The loss function called `name`; an unknown name raises a ValueError listing the valid ones."""
    if name not in LOSSES:
        raise ValueError(f"unknown DPO loss {name!r}; valid losses: {', '.join(LOSSES)}")
    return LOSSES[name]


@dataclass(frozen=True)
class PreferenceLoss:
    """Per-pair outputs of one DPO loss evaluation ([N] each)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor  # beta * (log pi(y_w) - log ref(y_w)), detached
    rejected_rewards: torch.Tensor  # beta * (log pi(y_l) - log ref(y_l)), detached

    def metrics(self, prefix: str = "rewards/") -> dict[str, float]:
        """Means over the pairs: the implicit rewards, their margin and how often the chosen one is higher."""
        return {f"{prefix}chosen": float(self.chosen_rewards.mean()),
                f"{prefix}rejected": float(self.rejected_rewards.mean()),
                f"{prefix}margin": float((self.chosen_rewards - self.rejected_rewards).mean()),
                f"{prefix}accuracy": float((self.chosen_rewards > self.rejected_rewards).float().mean())}


def preference_loss(name: str, policy_chosen: torch.Tensor, policy_rejected: torch.Tensor,
                    ref_chosen: torch.Tensor, ref_rejected: torch.Tensor, beta: float,
                    label_smoothing: float = 0.0, chosen_nll: torch.Tensor | None = None,
                    nll_coef: float = 0.0) -> PreferenceLoss:
    """Loss `name` ('sigmoid' | 'ipo' | 'cdpo') of N pairs and their implicit rewards; inputs [N] each.

    nll_coef > 0 adds nll_coef * chosen_nll ([N], the chosen response's per-token mean negative log-likelihood
    under the policy) to each pair's loss: RPO (Pang et al. 2024). The preference loss alone can raise the
    margin by lowering both responses' likelihood; the NLL term keeps the chosen ones likely.
    """
    loss_fn = get_loss(name)
    margin = log_ratio_margin(policy_chosen, policy_rejected, ref_chosen, ref_rejected)
    losses = loss_fn(margin, beta, label_smoothing)
    if nll_coef:
        if chosen_nll is None:
            raise ValueError("nll_coef > 0 needs chosen_nll, the chosen responses' per-token mean NLL")
        losses = losses + nll_coef * chosen_nll
    return PreferenceLoss(losses=losses,
                          chosen_rewards=(beta * (policy_chosen - ref_chosen)).detach(),
                          rejected_rewards=(beta * (policy_rejected - ref_rejected)).detach())
