"""Where a supervised stage's model trains (the stage's `model.device`) and the precision of its forwards.

SFT, the reward model and DPO each call `place_for_training` once, before DeepSpeed wraps the model, and move
their batches with `to_device`; DeepSpeed then trains the model where it is
(stages/common/training/deepspeed_setup.py).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from alignflow.stages.common.devices import device_name
from alignflow.stages.common.training.precision import Precision, resolve_precision


def place_for_training(ctx, model: torch.nn.Module, autocast: str, model_dtype: str, section: str
                       ) -> tuple[torch.nn.Module, Precision]:
    """(`model` on the stage's device, the precision of its forwards: `<section>.autocast`, bf16 by default on
    CUDA).

    Prints one line saying where and in what it trains."""
    device = ctx.compute_device()
    model = model.to(device)
    hidden_size = getattr(getattr(model, "config", None), "hidden_size", None)
    precision = resolve_precision(
        autocast, model_dtype, device, hidden_size, section=section, auto_on_cpu=False
    )
    print(
        f"{section}: trains on {device_name(device)}, forwards in {precision.label} ({precision.reason})",
        file=sys.stderr,
        flush=True,
    )
    return model, precision


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The batch's tensors on `device` (other values as they are)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
