"""A float32 x @ W.T for the few rows of a decode step on AVX-512 CPUs (C++ kernel), with F.linear as reference.

Why: a decode step of batch B is a chain of [B, K] x [K, N] products that read every weight once.
On the 2-core Ice Lake CI box oneDNN's packed fp32 kernel streams the ~110M engine's weights at
~14 GB/s at B = 8, where a plain read runs at ~22 GB/s. This kernel (csrc/skinny_linear.cpp) reads W
in 16-column blocks and keeps a tile of 3 blocks x 8 rows in registers. The 49 linears of one step,
2 threads, ms (`python benchmarks/linear_bench.py`):

    rows            1      8     16     32     64    128    512
    this kernel  19.4   18.1   27.0   41.2   64.9  106.6  449.0
    oneDNN       25.0   31.2   38.1   47.8   62.9  139.1  430.1
    F.linear     19.8   54.2   45.0   56.5   80.1  151.3  452.1

At 64 rows and beyond the product is compute-bound and the three are within run-to-run noise of each
other (64 rows: 65 vs 79 ms for oneDNN in another run); callers use this kernel up to MAX_ROWS and
F.linear above. Numerics: each output is one float32 fused multiply-add chain over k, another
summation order than MKL's; tests bound both against float64.

The extension is compiled on first use with torch.utils.cpp_extension (g++, ninja; ~30 s, then cached
in TORCH_EXTENSIONS_DIR). Where it cannot be built or the CPU lacks AVX-512, `available()` is False
with the reason in `unavailable_reason()`, and callers keep their other path.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

BLOCK = 16  # output columns per block of the blocked layout (one AVX-512 register of float32)
MAX_ROWS = 128  # measured at least even with oneDNN and F.linear up to here (table above); above, F.linear
SOURCE = Path(__file__).parent / "csrc" / "skinny_linear.cpp"
_FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]


@functools.cache
def _extension() -> tuple[object | None, str | None]:
    """(compiled module, None) or (None, why not); built once per process, cached on disk across them."""
    if not torch.cpu._is_avx512_supported():
        return None, "this CPU has no AVX-512"
    try:
        from torch.utils.cpp_extension import load

        module = load("alignflow_skinny_linear", sources=[str(SOURCE)], extra_cflags=_FLAGS,
                      extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as exc:  # no compiler, no ninja, no headers: the caller keeps its other path
        why = f"building {SOURCE} failed: {type(exc).__name__}: {str(exc).strip()[-500:]}"
        warnings.warn(f"{why}; float32 CPU linears fall back to oneDNN (slower at small batch). Install g++ and "
                      "ninja, and make TORCH_EXTENSIONS_DIR writable, to use the skinny_linear kernel",
                      RuntimeWarning, stacklevel=2)
        return None, why
    return module, None


def available() -> bool:
    """True when the kernel can run here (AVX-512 CPU, extension built); builds it on the first call."""
    return _extension()[0] is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (no AVX-512, or the compiler's error), else None."""
    return _extension()[1]


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
    module, why = _extension()
    if module is None:
        raise RuntimeError(f"skinny_linear is not available: {why}; use F.linear")
    rows = x.reshape(-1, x.shape[-1])
    return module.skinny_linear(rows.contiguous(), blocked, out_features).view(*x.shape[:-1], out_features)


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What skinny_linear computes, from the plain [N, K] weight."""
    return F.linear(x, weight)
