"""SwiGLU's silu(gate) * up as one autograd node: a C++ kernel for float32 on CPU (csrc/avx2/), else torch.

Why: torch computes the pair as silu then mul, and differentiates it through two muls and silu_backward: five
passes over [tokens, intermediate] blocks per layer and step, each bound by memory on a training step (the
blocks are far from any cache), plus silu(gate) kept alive for the backward. The node reads its inputs once
per direction and saves only gate and up: on benchmarks/rl_ladder.py's GRPO step (4.7M model, [640, 1024]
blocks) that is ~1.7 ms a layer on a 2-core AVX2 EPYC (benchmarks/cpu_kernels_bench.py's silu_mul rows).

Same formulas as torch's CPU kernels (silu = gate / (1 + exp(-gate)) with the same SLEEF exp; the backward
torch's silu_backward applied to grad * up); the torch path (`impl="torch"`) is the reference it is tested
against (tests/kernels/test_swiglu.py). "auto" takes the kernel for float32 CPU tensors where the AVX2
extension builds, outside torch.compile; bf16 under autocast, CUDA and the rest keep torch's ops.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignflow.kernels import _cpu_extension


def silu_mul(gate: torch.Tensor, up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """F.silu(gate) * up for tensors of one shape. impl: auto, cpp, torch."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    kernels = _cpu_extension.node_kernels("silu_mul", impl, gate, up)
    if kernels is None:
        return F.silu(gate) * up
    return kernels.silu_mul(gate, up)

