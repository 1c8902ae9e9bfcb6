"""A float32 x @ W.T for a decode step's few rows on AVX-512 and AVX2 CPUs (C++), F.linear the reference.

Why: a decode step of batch B is a chain of [B, K] x [K, N] products that read every weight once, so
it runs at the speed the weights stream from memory, and oneDNN's packed fp32 kernel streams them well
below what a plain read reaches. This kernel (csrc/skinny_linear.cpp) reads W in 16-column blocks and
keeps a tile of 3 blocks x 8 rows in registers. From 64 rows on the product is compute-bound and this
kernel, oneDNN and F.linear run about even; callers use this kernel up to max_rows() (MAX_ROWS) and
F.linear above. (At 1 row MKL's GEMV is as fast; the engine's decode batches are larger.)

The AVX2 build (csrc/avx2/skinny_linear_avx2.cpp: one 16-column block x 6 rows, 12 of the 16 registers)
reads the same blocked layout. On a CPU with AVX2 and no AVX-512 it leads oneDNN and F.linear at every
size up to 256 rows (a prefill of 16 prompts is ~190), so the AVX2 build's limit is MAX_ROWS_AVX2.

Numerics: each output is one float32 fused multiply-add chain over k in order in both builds (the same
bits), another summation order than MKL's; tests bound both against float64.

bfloat16 weights: block_weight(W, dtype=torch.bfloat16) keeps the blocks in bf16 (W rounded to nearest even),
and the kernel widens each to float32 as it reads it, exactly, so it computes what it computes on the fp32
blocks of the rounded weight, bit for bit, while streaming half the bytes (engine.cpu_linear_weights;
a decode step of a model whose weights do not fit in cache runs at the speed they stream).

Timings of both builds per row count: docs/performance.md#cpu-kernels
(`python benchmarks/cpu_kernels_bench.py`, with `--model rl-4.7m --rows 4,16,40,64,128,256` for AVX2).

The C++ is built on first use (kernels/_cpu_extension.py). Where it cannot be built or the CPU has
neither AVX-512 nor AVX2, `available()` is False with the reason in `unavailable_reason()`, and callers
keep their other path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignflow.kernels import _cpu_extension

BLOCK = 16  # output columns per block of the blocked layout (one AVX-512 register of float32)
# The AVX-512 build runs at least even with oneDNN and F.linear up to here; above, F.linear. The AVX2
# build leads both up to its own limit (module docstring, docs/performance.md#cpu-kernels).
MAX_ROWS = 128
MAX_ROWS_AVX2 = 256


def available() -> bool:
    """True when the kernel can run here (AVX-512 or AVX2 CPU, extension built);
    builds it on the first call."""
    return _cpu_extension.linear_kernels() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (neither AVX-512 nor AVX2, or the compiler's error), else None."""
    return _cpu_extension.linear_kernels_unavailable_reason()


def isa() -> str | None:
    """The instruction set of the build that runs here ("AVX-512" or "AVX2"), None where none does."""
    module = _cpu_extension.linear_kernels()
    return None if module is None else module.isa


def max_rows() -> int:
    """The most rows callers give the kernel (F.linear above): the limit of the build that runs here."""
    return MAX_ROWS_AVX2 if isa() == "AVX2" else MAX_ROWS


BLOCKED_DTYPES = (torch.float32, torch.bfloat16)


def block_weight(
    weight: torch.Tensor, out: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W [N, K] float32 -> [ceil(N / 16), K, 16] of `dtype`: block b, row k holds W[16b : 16b + 16, k]
    (zero-padded; rounded to nearest even for bfloat16).

    out: a [ceil(N / 16), K, 16] tensor of `dtype` to write into (an engine's refit repacks into the copies
    it has): one strided copy instead of a zeroed, padded copy and a transposing one into fresh memory, which
    makes a refit's repack several times cheaper.
    """
    if weight.dim() != 2 or weight.dtype != torch.float32:
        raise ValueError(
            f"block_weight: expected a float32 [N, K] weight, got {tuple(weight.shape)} {weight.dtype}"
        )
    dtype_name = str(dtype).removeprefix("torch.")
    if dtype not in BLOCKED_DTYPES:
        raise ValueError(f"block_weight: blocks are float32 or bfloat16, not {dtype_name}")
    n, k = weight.shape
    blocks, full = -(-n // BLOCK), n // BLOCK
    if out is None:
        out = weight.new_empty(blocks, k, BLOCK, dtype=dtype)
    elif out.shape != (blocks, k, BLOCK) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"block_weight: out must be a contiguous {dtype_name} {(blocks, k, BLOCK)} tensor for a "
            f"{(n, k)} weight, got {tuple(out.shape)} {out.dtype}"
        )
    # Rounded first, then blocked: a contiguous conversion and a same-dtype transposing copy beat one
    # converting, transposing copy (a refit of the 114.8M model: ~85 against ~95 ms)
    source = weight if dtype == torch.float32 else weight.to(dtype)
    if full:
        out[:full].copy_(source[: full * BLOCK].view(full, BLOCK, k).transpose(1, 2))
    if n % BLOCK:  # the last block's columns past N are zeros
        out[full].zero_()
        out[full, :, : n % BLOCK].copy_(source[full * BLOCK :].t())
    return out


def skinny_linear(x: torch.Tensor, blocked: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [..., K] @ W.T -> [..., out_features] float32,
    W given as block_weight(W) (float32 or bfloat16 blocks). Raises if not available()."""
    module = _cpu_extension.linear_kernels()
    if module is None:
        raise RuntimeError(f"skinny_linear is not available: {unavailable_reason()}; use F.linear")
    # a decode step's [B, K] goes in as it is, without reshape and view
    if x.dim() == 2 and x.is_contiguous():
        return module.skinny_linear(x, blocked, out_features)
    rows = x.reshape(-1, x.shape[-1])
    return module.skinny_linear(rows.contiguous(), blocked, out_features).view(*x.shape[:-1], out_features)


def reference(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """What skinny_linear computes, from the plain [N, K] weight and the blocks' dtype."""
    return F.linear(x, weight.to(dtype).float())
