"""Which precision the trained models' forwards run in: bf16 autocast where the hardware has bf16 arithmetic.

Autocast keeps fp32 master weights and the fp32 optimizer; only the matmuls (and what autocast lists
with them) run in bf16. On a CPU with bf16 arithmetic (AVX512-BF16 or AMX) that makes the training step
of a model wide enough faster (docs/performance.md#the-training-step); on one without it oneDNN emulates
bf16 through fp32 and is several times slower, so `auto` stays in fp32 there.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


def has_bf16_arithmetic(device: torch.device) -> bool:
    """True on CUDA devices with bf16 support and on CPUs with AVX512-BF16 or AMX."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return False


@dataclass(frozen=True)
class Precision:
    """The resolved choice: `autocast_dtype` None means the model's own dtype;
    `reason` says why, for the log."""

    autocast_dtype: torch.dtype | None
    device_type: str
    reason: str

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Context for a training or log-prob forward."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(self.device_type, dtype=self.autocast_dtype):
            yield

    @property
    def label(self) -> str:
        return "bf16 autocast" if self.autocast_dtype is not None else "model dtype"


# `auto` autocasts only models at least this wide. At hidden 256 (the 4.7M benchmark model) autocast makes
# a step markedly faster; at hidden 64 (configs/tiny.yaml) a step is per-operator dispatch and autocast
# gains nothing, while it lowered the demo's held-out gold gain over SFT for PPO and GRPO
# (benchmarks/alignment_seeds.py over seeds), so small models keep fp32.
AUTOCAST_MIN_HIDDEN_SIZE = 256


def resolve_precision(
    setting: str,
    model_dtype: str,
    device: torch.device,
    hidden_size: int | None = None,
    *,
    section: str = "ppo",
    auto_on_cpu: bool = True,
) -> Precision:
    """`setting` is <section>.autocast ('auto' | 'bf16' | 'off'); `model_dtype` is model.dtype; `hidden_size`
    the trained model's width (None: not known, not checked).

    auto: bf16 on a CUDA device with bf16 (any width: the GPU's tensor cores are what bf16 is for), and on a
    CPU with bf16 arithmetic where `auto_on_cpu` (the RL stage, whose CPU figures chose it) and the model is
    at least AUTOCAST_MIN_HIDDEN_SIZE wide; model dtype elsewhere."""
    if setting not in ("auto", "bf16", "off"):
        raise ValueError(f"{section}.autocast '{setting}' is not one of auto, bf16, off")
    if setting == "off":
        return Precision(None, device.type, f"autocast off ({section}.autocast: off)")
    if model_dtype != "float32":
        return Precision(None, device.type, f"model.dtype is {model_dtype}: weights already in low precision")
    if setting == "bf16":
        return Precision(torch.bfloat16, device.type, f"{section}.autocast: bf16")
    if not has_bf16_arithmetic(device):
        return Precision(
            None, device.type, f"auto: {device.type} has no bf16 arithmetic (bf16 would be emulated)"
        )
    if device.type == "cuda":
        return Precision(torch.bfloat16, device.type, "auto: cuda has bf16 arithmetic")
    if not auto_on_cpu:
        return Precision(
            None,
            device.type,
            f"auto: bf16 autocast of {section} is for CUDA; on a CPU {section}.autocast: bf16 forces it",
        )
    if hidden_size is not None and hidden_size < AUTOCAST_MIN_HIDDEN_SIZE:
        return Precision(
            None,
            device.type,
            f"auto: hidden size {hidden_size} < {AUTOCAST_MIN_HIDDEN_SIZE}, too "
            f"small for bf16 to pay on a CPU; {section}.autocast: bf16 forces it",
        )
    return Precision(torch.bfloat16, device.type, f"auto: {device.type} has bf16 arithmetic")


# Longest sequence for which the RL trainer's models use eager (matmul + softmax) attention instead of SDPA:
# transformers' 'eager' where their own forward runs, and llama_forward's cpu_attention under CPU autocast.
# At the RL benchmark's short sequences SDPA's CPU flash-attention backward is a sizeable share of the step,
# and the step is faster eager, in bf16 and fp32 alike (log-probs equal to 1e-6;
# docs/performance.md#the-training-step). Eager materialises B x heads x T x T scores, so long sequences
# keep SDPA.
EAGER_ATTENTION_MAX_LEN = 512


def training_attention(max_sequence_length: int) -> str:
    """The attention implementation of the RL trainer's models for sequences up to `max_sequence_length`."""
    return "eager" if max_sequence_length <= EAGER_ATTENTION_MAX_LEN else "sdpa"
