"""A float32 x @ W.T for the few rows of a decode step on AVX-512 CPUs (C++ kernel), with F.linear as reference.

Why: a decode step of batch B is a chain of [B, K] x [K, N] products that read every weight once.
On the 2-core Ice Lake CI box oneDNN's packed fp32 kernel streams the ~110M engine's weights at
~17 GB/s at B = 8, where a plain read runs at 22-27 GB/s. This kernel (csrc/skinny_linear.cpp) reads W
in 16-column blocks and keeps a tile of 3 blocks x 8 rows in registers. The 49 linears of one step,
2 threads, ms (`python benchmarks/cpu_kernels_bench.py`; two runs, the second in brackets):

    rows               1            8           32           64           128          512
    this kernel    19.4 (18.3)  18.1 (17.5)  41.2 (34.1)  64.9 (62.9)  106.6 (101.1)  449.0
    oneDNN         25.0 (20.7)  31.2 (26.1)  47.8 (44.9)  62.9 (69.5)  139.1 (112.2)  430.1
    F.linear       19.8 (16.7)  54.2 (47.3)  56.5 (50.0)  80.1 (85.9)  151.3 (113.2)  452.1

From 64 rows on the product is compute-bound and the three are within run-to-run noise of each other;
callers use this kernel up to MAX_ROWS and F.linear above. (At 1 row MKL's GEMV is as fast; the
engine's decode batches are larger.) Numerics: each output is one float32 fused multiply-add chain
over k, another summation order than MKL's; tests bound both against float64.

The C++ is built on first use (kernels/_cpu_extension.py). Where it cannot be built or the CPU lacks
AVX-512, `available()` is False with the reason in `unavailable_reason()`, and callers keep their
other path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignflow.kernels import _cpu_extension

BLOCK = 16  # output columns per block of the blocked layout (one AVX-512 register of float32)
MAX_ROWS = 128  # measured at least even with oneDNN and F.linear up to here (table above); above, F.linear


def available() -> bool:
    """True when the kernel can run here (AVX-512 CPU, extension built); builds it on the first call."""
    return _cpu_extension.extension() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (no AVX-512, or the compiler's error), else None."""
    return _cpu_extension.unavailable_reason()


def block_weight(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] float32 -> [ceil(N / 16), K, 16]: block b, row k holds W[16b : 16b + 16, k] (zero-padded)."""
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(f"block_weight: expected a float32 [N, K] weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    blocks = -(-n // BLOCK)
    padded = weight.new_zeros(blocks * BLOCK, k)
    padded[:n] = weight
    return padded.view(blocks, BLOCK, k).transpose(1, 2).contiguous()


def skinny_linear(x: torch.Tensor, blocked: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., out_features] float32, W given as block_weight(W). Raises if not available()."""
    module = _cpu_extension.extension()
    if module is None:
        raise RuntimeError(f"skinny_linear is not available: {_cpu_extension.unavailable_reason()}; use F.linear")
    rows = x.reshape(-1, x.shape[-1])
    return module.skinny_linear(rows.contiguous(), blocked, out_features).view(*x.shape[:-1], out_features)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What skinny_linear computes, from the plain [N, K] weight."""
    return F.linear(x, weight)
