"""The fused ops of a GPU decode step (one query per row, static cache), each with its torch reference.

Why: on a GPU the CUDA-graph decode step of a 1B model ran at ~20% of the HBM roofline (issue "Speed at
the limit"). Its linears are cuBLAS GEMVs near the bandwidth limit; the rest is a few dozen small kernels
per layer, each a launch and a round trip through memory, and attention over every slot of the static
cache behind a mask. These four ops replace those runs (engine.gpu_decode_kernels: triton):

- rope_cache_write: RoPE on the query and key heads of the fused QKV output, the keys and values written
  into the cache slot of the step; returns the rotated queries.
- live_attention: softmax(q k^T * scale + mask) v over cache slots 0..slot only, the slot read from device
  memory (so one captured graph serves every step), split over the keys (flash-decoding).
- add_rms_norm: x + delta and the next RMSNorm of that sum, in one pass.
- silu_mul: SiLU(gate) * up of the fused gate/up output.

impl: "torch" (the reference: the eager model's own ops, model.py), "triton" (_triton_decode.py: CUDA, or
Triton's interpreter on CPU tensors under TRITON_INTERPRET=1, as the tests run it), "auto" (triton on a
CUDA tensor where triton imports, else torch). Results agree with the reference to float rounding
(tests/kernels/test_decode_step.py states the bounds): fp32 arithmetic inside, one rounding to the row
dtype where the eager op rounds, different summation orders.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignflow.kernels._triton_dispatch import resolve_impl

# The ops in the order a decode step runs them (engine.gpu_fused_ops names a subset: alignflow/config.py).
FUSED_OPS = ("rope_cache_write", "live_attention", "add_rms_norm", "silu_mul")

# Keys per block of live_attention: small enough that a 64-slot cache still splits in several blocks, large
# enough that a block's loads are 4 KB of bf16 keys at head_dim 64.
BLOCK_N = 32


def _triton_module(op: str, device: torch.device, impl: str):
    """The Triton kernels' module where `impl` resolves to triton, else None (raises where it cannot run)."""
    if resolve_impl(impl, device, op) != "triton":
        return None
    from alignflow.kernels import _triton_decode

    return _triton_decode


def _check_head_dim(op: str, D: int) -> None:
    """The Triton kernels hold a head in one block, whose size must be a power of two."""
    if D & (D - 1):
        raise ValueError(f"{op}: head_dim {D} is not a power of two, which the Triton kernels' blocks need; "
                         "use engine.gpu_decode_kernels: torch for this model")


def rope_cache_write(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot: torch.Tensor, heads: int, kv_heads: int,
                     impl: str = "auto") -> torch.Tensor:
    """Rotated queries [B, heads, D] of a decode step; rotated keys and the values go into the caches.

    qkv [B, (heads + 2 kv_heads) D]: the fused projection of one token per row (queries, keys, values);
    cos, sin_signed [B, D]: the RoPE tables at each row's position (model.signed_sin's sign);
    k_cache, v_cache [B, kv_heads, S, D]: views of the cache's first B rows; slot: [1] long, the cache slot
    written (the same for every row: slots are columns of the left-padded batch).
    """
    B, width = qkv.shape
    D = k_cache.shape[-1]
    if width != (heads + 2 * kv_heads) * D or qkv.stride(1) != 1:
        raise ValueError(f"rope_cache_write: qkv {tuple(qkv.shape)} is not [B, (heads + 2 kv_heads) x D] = "
                         f"[{B}, {(heads + 2 * kv_heads) * D}] with contiguous rows")
    kernels = _triton_module("rope_cache_write", qkv.device, impl)
    if kernels is not None:
        _check_head_dim("rope_cache_write", D)
        return kernels.rope_cache_write(qkv, cos, sin_signed, k_cache, v_cache, slot, heads, kv_heads)
    from alignflow.stages.common.generation.native.model import apply_rope

    rotated = apply_rope(qkv[:, : (heads + kv_heads) * D].view(B, 1, heads + kv_heads, D),
                         cos[:, None, None], sin_signed[:, None, None])
    k_cache.index_copy_(2, slot, rotated[:, :, heads:].transpose(1, 2))
    v_cache.index_copy_(2, slot, qkv[:, (heads + kv_heads) * D :].view(B, kv_heads, 1, D))
    return rotated[:, 0, :heads].contiguous()


def default_splits(pairs: int, max_len: int, device: torch.device) -> int:
    """Key ranges per (row, KV head) of live_attention: enough programs for two per streaming
    multiprocessor, never more ranges than BLOCK_N blocks in the cache."""
    programs = 4  # the interpreter's CPU tests
    if device.type == "cuda":
        programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(-(-programs // pairs), -(-max_len // BLOCK_N), 64))


def live_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                   slot: torch.Tensor, scale: float, splits: int | None = None, impl: str = "auto"
                   ) -> torch.Tensor:
    """Attention of one query per row over cache slots 0..slot: [B, kv_heads, G, D].

    q [B, kv_heads, G, D] (the G query heads of each KV group); k_cache, v_cache [B, kv_heads, S, D] (views
    of the cache); mask [B, S] additive (0 / -inf: padding, sliding window), read at slots 0..slot; slot [1]
    long. Slots past `slot` are never read, where the reference reads them all behind the mask (the static
    CUDA-graph step's form: model.decode_attention). splits: key ranges per (row, KV head), default_splits.
    """
    from alignflow.stages.common.generation.native.model import decode_attention

    B, kv_heads, groups, D = q.shape
    if k_cache.shape[:2] != (B, kv_heads) or k_cache.shape[-1] != D or v_cache.shape != k_cache.shape:
        raise ValueError(f"live_attention: caches {tuple(k_cache.shape)} and {tuple(v_cache.shape)} do not "
                         f"match q {tuple(q.shape)} as [B, kv_heads, S, D]")
    if mask.shape != (B, k_cache.shape[2]) or mask.stride(1) != 1:
        raise ValueError(f"live_attention: mask {tuple(mask.shape)} is not [B, S] = [{B}, {k_cache.shape[2]}]"
                         " with contiguous rows")
    kernels = _triton_module("live_attention", q.device, impl)
    if kernels is None:
        return decode_attention(q, k_cache, v_cache, _through(mask, slot)[:, None, None], scale)
    _check_head_dim("live_attention", D)
    if q.stride(3) != 1 or q.stride(2) != D or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("live_attention: q's (G, D) and the caches' D must be contiguous")
    splits = splits or default_splits(B * kv_heads, k_cache.shape[2], q.device)
    return kernels.live_attention(q, k_cache, v_cache, mask, slot, scale, splits, BLOCK_N)


def _through(mask: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The additive mask with the slots after `slot` set to -inf (the static step's masks already are)."""
    later = torch.arange(mask.shape[1], device=mask.device) > slot
    return mask.masked_fill(later, float("-inf"))


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto"
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta) * weight) of rows [N, H]: the residual add and the next norm."""
    if x.shape != delta.shape or x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)}, delta {tuple(delta.shape)} and weight "
                         f"{tuple(weight.shape)} are not [N, H], [N, H], [H]")
    kernels = _triton_module("add_rms_norm", x.device, impl)
    if kernels is not None:
        return kernels.add_rms_norm(x.contiguous(), delta.contiguous(), weight, float(eps))
    from alignflow.stages.common.generation.native.model import rms_norm

    total = x + delta
    return total, rms_norm(total, weight, eps)


def silu_mul(gate_up: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """SiLU(gate) * up of a fused [N, 2F] gate/up output (gate first): [N, F]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up {tuple(gate_up.shape)} is not [N, 2F]")
    kernels = _triton_module("silu_mul", gate_up.device, impl)
    if kernels is not None:
        return kernels.silu_mul(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
