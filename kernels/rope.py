"""Rotate-half RoPE of float32 heads as one autograd node: a C++ kernel on CPU (csrc/avx2/), torch elsewhere.

Why: the training forward applies RoPE to q and k in every layer; torch runs it as a roll (two slices and a
cat), two broadcasting muls and an add, and its backward as about as many, each a pass over [tokens, heads,
head_dim]. The node is one pass each way, reading the position's cos and sin once for all its heads: on
benchmarks/rl_ladder.py's GRPO step (4.7M model) that takes ~3 ms off a ~140 ms step on a 2-core AVX2 EPYC.

Same arithmetic as native/model.py's apply_rope (x * cos + roll(x, D/2) * sin_signed), the reference it is
tested against (tests/kernels/test_rope.py). "auto" takes the kernel for float32 CPU tensors where the AVX2
extension builds, outside torch.compile; bf16 under autocast, CUDA and the rest keep the torch ops.
"""

from __future__ import annotations

import torch

from alignflow.kernels import _cpu_extension


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, impl: str = "auto"
) -> torch.Tensor:
    """x [B, T, heads, D]; cos, sin_signed [B, T, 1, D] (native/model.py's signed_sin table).
    impl: auto, cpp, torch."""
    batch, width, heads, head_dim = x.shape
    if cos.shape != (batch, width, 1, head_dim) or sin_signed.shape != cos.shape:
        raise ValueError(
            f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin_signed.shape)} must be "
            f"[{batch}, {width}, 1, {head_dim}] for x {tuple(x.shape)}"
        )
    kernels = _cpu_extension.node_kernels("apply_rope", impl, x, cos, sin_signed)
    if kernels is None:
        return x * cos + x.roll(head_dim // 2, dims=-1) * sin_signed
    tokens = batch * width
    rotated = kernels.rope(
        x.reshape(tokens, heads, head_dim),
        cos.reshape(tokens, head_dim),
        sin_signed.reshape(tokens, head_dim),
    )
    return rotated.view(batch, width, heads, head_dim)

