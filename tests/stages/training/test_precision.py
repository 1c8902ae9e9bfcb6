"""ppo.autocast resolves to bf16 autocast only where the hardware has bf16 arithmetic, and says why."""

from __future__ import annotations

import pytest
import torch

from alignflow.stages.training import precision as precision_module
from alignflow.stages.training.precision import resolve_precision

CPU = torch.device("cpu")


@pytest.mark.parametrize(("setting", "model_dtype", "hardware_bf16", "expected"), [
    ("auto", "float32", True, torch.bfloat16),
    ("auto", "float32", False, None),       # emulated bf16 is slower than fp32: stay in fp32
    ("auto", "bfloat16", True, None),       # weights already bf16: nothing to autocast
    ("bf16", "float32", False, torch.bfloat16),  # asked for explicitly: honoured
    ("off", "float32", True, None),
])
def test_autocast_choice(monkeypatch, setting, model_dtype, hardware_bf16, expected):
    monkeypatch.setattr(precision_module, "has_bf16_arithmetic", lambda device: hardware_bf16)
    chosen = resolve_precision(setting, model_dtype, CPU)
    assert chosen.autocast_dtype == expected
    assert chosen.reason  # printed at stage start


def test_auto_keeps_small_models_in_fp32(monkeypatch):
    monkeypatch.setattr(precision_module, "has_bf16_arithmetic", lambda device: True)
    small = resolve_precision("auto", "float32", CPU, hidden_size=64)
    assert small.autocast_dtype is None and "hidden size 64 < 256" in small.reason
    assert resolve_precision("auto", "float32", CPU, hidden_size=256).autocast_dtype == torch.bfloat16
    assert resolve_precision("bf16", "float32", CPU, hidden_size=64).autocast_dtype == torch.bfloat16


def test_forward_context_runs_matmuls_in_the_chosen_dtype():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with resolve_precision("bf16", "float32", CPU).forward():
        assert (x @ w).dtype == torch.bfloat16
    with resolve_precision("off", "float32", CPU).forward():
        assert (x @ w).dtype == torch.float32


def test_unknown_setting_is_named():
    with pytest.raises(ValueError, match="'fp8' is not one of auto, bf16, off"):
        resolve_precision("fp8", "float32", CPU)
