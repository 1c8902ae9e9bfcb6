"""ppo.autocast resolves to bf16 autocast only where the hardware has bf16 arithmetic, and says why."""

from __future__ import annotations

import pytest
import torch

from alignflow.stages.common.training import precision as precision_module
from alignflow.stages.common.training.precision import resolve_precision

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


def test_auto_on_cuda_autocasts_any_width_and_supervised_stages_stay_in_fp32_on_a_cpu(monkeypatch):
    """On a GPU `auto` is bf16 whatever the width (the CPU-measured width rule is for CPUs); the supervised
    stages' auto autocasts on CUDA only."""
    monkeypatch.setattr(precision_module, "has_bf16_arithmetic", lambda device: True)
    cuda = torch.device("cuda", 0)
    assert resolve_precision("auto", "float32", cuda, hidden_size=64).autocast_dtype == torch.bfloat16
    assert resolve_precision("auto", "float32", cuda, 64, section="sft", auto_on_cpu=False).autocast_dtype \
        == torch.bfloat16
    on_cpu = resolve_precision("auto", "float32", CPU, 4096, section="sft", auto_on_cpu=False)
    assert on_cpu.autocast_dtype is None and "sft.autocast: bf16" in on_cpu.reason
    assert resolve_precision("bf16", "float32", CPU, 64, section="dpo", auto_on_cpu=False).autocast_dtype \
        == torch.bfloat16
    monkeypatch.setattr(precision_module, "has_bf16_arithmetic", lambda device: False)  # e.g. a V100
    assert resolve_precision("auto", "float32", cuda, 4096).autocast_dtype is None
