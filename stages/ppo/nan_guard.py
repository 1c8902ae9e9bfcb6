"""The RL stage's NaN guard: the error that stops training and the checks that raise it; not what follows.

A NaN or inf in a reward, the KL, the advantages or a loss raises NonFiniteError; the stage then publishes the
last good state (checkpoints.publish_last_good) and exits with the error.
"""

from __future__ import annotations

import torch

from alignflow.stages.common.ranks import sum_over_ranks, world_size


class NonFiniteError(RuntimeError):
    """NaN or inf in a reward, a loss or the KL: training stops after publishing the last good state."""


def check_finite(what: str, value: torch.Tensor | float, iteration: int) -> None:
    """Raise NonFiniteError naming `what` and the iteration when `value` holds a NaN or inf."""
    tensor = torch.as_tensor(value)
    if not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise NonFiniteError(f"iteration {iteration}: {what} is not finite ({bad} NaN/inf value(s))")


def finite_on_every_rank(loss: torch.Tensor) -> torch.Tensor | float:
    """`loss`, or NaN when any rank's loss is not finite, so that every rank stops alike (one rank raising
    alone would leave the others waiting in the next collective)."""
    if world_size() == 1:
        return loss
    bad = sum_over_ranks(0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0)[0]
    return float("nan") if bad else loss
