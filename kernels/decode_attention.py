"""One decode step's float32 attention over the KV cache on AVX-512 CPUs (C++ kernel), with a torch reference.

Why: with one query per row, attention reads every cached key and value once and does ~2 flops per
element, so it is bound by that read. This kernel (csrc/decode_attention.cpp) reads each key row once
for all query heads of its KV group, prefetches the next keys and this row's values in software (the
hardware prefetcher stops at 4 KB pages, and one (row, head) block of the cache spans only a few),
does the softmax vectorised (its own polynomial exp; outputs within 5e-7 of the reference in the
tests) and streams the values once. Its speed against the torch reference, eager and compiled, is in
docs/performance.md#cpu-kernels (`python benchmarks/cpu_kernels_bench.py`).

Layout: q [B, kv_heads, G, D] (the G query heads of a KV group), keys/values [B, kv_heads, L, D] as
views of the cache (strided over B, heads and L), mask [B, L] additive (0 / -inf). D must be a
multiple of 16 (Llama-family head sizes 64 and 128 are).
"""

from __future__ import annotations

import torch

from alignflow.kernels import _cpu_extension


def available() -> bool:
    """True when the kernel can run here (AVX-512 CPU, extension built); builds it on the first call."""
    return _cpu_extension.extension() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (no AVX-512: the kernel has no AVX2 build,
    or the compiler's error), else None."""
    return _cpu_extension.unavailable_reason()


def supports(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel runs queries of this device, dtype and head size here (building it if needed)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and head_dim % 16 == 0
        and head_dim <= 256
        and available()
    )


def decode_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(scale * q K^T + mask) V per (row, KV head) -> [B, kv_heads, G, D]; see the module docstring."""
    module = _cpu_extension.extension()
    if module is None:
        raise RuntimeError(f"decode_attention is not available: {_cpu_extension.unavailable_reason()}")
    return module.decode_attention(q, keys, values, mask, scale)


# The op the compiled decode step calls: opaque to torch.compile, which would otherwise fuse the torch
# form into its own (slower) loop. A fragment of the "alignflow" namespace (prepack.py defines linear).
_LIBRARY = torch.library.Library("alignflow", "FRAGMENT")
_LIBRARY.define("decode_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale) -> Tensor")
_LIBRARY.impl("decode_attention", decode_attention, "CPU")


@torch.library.register_fake("alignflow::decode_attention")
def _(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    return q.new_empty(q.shape)


op = torch.ops.alignflow.decode_attention


def reference(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """The same in torch: two batched matmuls and a float32 softmax (what the engine runs elsewhere)."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale + mask[:, None, None, :]
    return torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)
