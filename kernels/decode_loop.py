"""A Llama-family fp32 decode loop in one C++ call (AVX-512 or AVX2); the engine's torch loop its reference.

Why: the eager decode step is ~280 operator calls, each paying Python and the dispatcher, and on a small
model (the demo's: hidden 64, 2 layers) that is nearly all of the step. csrc/decode_loop.cpp runs sampling,
the stop check and the forward of every step by pointer through the same kernels (skinny_linear's tiles,
decode_attention's body, the sampler's row function), in one OpenMP team. The same loop is compiled into the
AVX2 extension over its own pieces (csrc/avx2/: skinny_linear, the sampler, an attention body), so CPUs
without AVX-512 run it too. stages/common/generation/native/decode_loop.py decides where the engine uses it.

On the small model it removes most of each step; on the ~110M one the linears dominate and it gains only
what the ~280 calls per step cost. Tokens/s of each path: docs/performance.md#generation-engine-throughput
(`benchmarks/engine_throughput.py --dtypes float32`).

Numerics: the linears and attention are those kernels' (bit for bit); RMSNorm, RoPE and SiLU are written
out here with other rounding and summation orders than torch's, so logits agree with the eager step to
~1e-6 and the tokens are the sampler's function of them
(tests/stages/common/generation/test_engine_decode_loop.py).
"""

from __future__ import annotations

import torch

from alignflow.kernels import _cpu_extension


def _module():
    """The extension that runs the loop here: the AVX-512 build where it runs, else the AVX2 one (or None)."""
    return _cpu_extension.linear_kernels()


def available() -> bool:
    """True where the loop can run (AVX-512 or AVX2 CPU, extension built);
    builds the extension on the first call."""
    return _module() is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (neither AVX-512 nor AVX2, or the compiler's error), else None."""
    return _cpu_extension.linear_kernels_unavailable_reason()


def isa() -> str | None:
    """The instruction set of the build that runs the loop here ("AVX-512" or "AVX2"),
    None where none does."""
    module = _module()
    return None if module is None else module.isa


def decode_loop(
    first_logits: torch.Tensor,
    layers: list[torch.Tensor],
    embed: torch.Tensor,
    norm: torch.Tensor,
    lm_head: torch.Tensor,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    cos: torch.Tensor,
    sin_signed: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    first_slot: int,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    ends: torch.Tensor,
    max_new_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    kept_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(tokens [B, new], log-probs [B, new], lengths [B], steps run);
    the arguments are csrc/decode_loop.cpp's."""
    module = _module()
    if module is None:
        raise RuntimeError(f"decode_loop is not available: {unavailable_reason()}")
    kept = first_logits.new_empty(0) if kept_logits is None else kept_logits
    return module.decode_loop(
        first_logits,
        layers,
        embed,
        norm,
        lm_head,
        k_cache,
        v_cache,
        cos,
        sin_signed,
        mask,
        positions,
        first_slot,
        temperature,
        seeds,
        ends,
        max_new_tokens,
        num_heads,
        num_kv_heads,
        eps,
        kept,
    )
