"""Triton kernels behind decode_step.py: the fused ops of one CUDA-graph decode step (no autograd).

Each replaces a run of small eager kernels of a layer (model.LlamaFamilyModel.forward's static step):
- _rope_cache_kernel: RoPE on the query and key heads of the fused QKV output, the rotated keys and the
  values written into the cache at the step's slot (eager: ~10 kernels: slices, roll, two muls, add,
  two transposes, two index_copy_);
- _attention_split_kernel + _attention_merge_kernel: attention of one query per row over the cache slots
  0..slot only (eager: all S_max slots behind a mask), cut into SPLITS key ranges sized at run time from
  the live length (flash-decoding: the ranges fill the GPU when B x KV heads alone would not), merged by
  their log-sum-exp;
- _add_rms_norm_kernel: the residual add and the next RMSNorm in one pass over the row (eager: ~7);
- _silu_mul_kernel: SiLU(gate) x up of the fused gate/up output (eager: chunk, silu, mul).

Every size that varies per step (the slot) is read from device memory, so one captured graph serves
every step. Import this module only after deciding whether TRITON_INTERPRET=1 applies (_triton_dispatch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from alignflow.kernels._triton_dispatch import check_kernel_mode


@triton.jit
def _rope_cache_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_qkv, stride_rope, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, D)
    rolled = (offs + D // 2) % D  # apply_rope: x * cos + roll(x, D/2) * signed sin
    source = qkv_ptr + row * stride_qkv + head * D
    if head < HEADS + KV_HEADS:
        cos = tl.load(cos_ptr + row * stride_rope + offs).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_rope + offs).to(tl.float32)
        x = tl.load(source + offs).to(tl.float32)
        turned = tl.load(source + rolled).to(tl.float32)
        rotated = x * cos + turned * sin
        if head < HEADS:
            tl.store(q_out_ptr + (row * HEADS + head) * D + offs, rotated.to(q_out_ptr.dtype.element_ty))
        else:
            slot = tl.load(slot_ptr).to(tl.int64)
            kv = head - HEADS
            target = k_cache_ptr + row * stride_kb + kv * stride_kh + slot * stride_ks
            tl.store(target + offs, rotated.to(k_cache_ptr.dtype.element_ty))
    else:  # a value head: copied as is
        slot = tl.load(slot_ptr).to(tl.int64)
        kv = head - HEADS - KV_HEADS
        value = tl.load(source + offs)
        tl.store(v_cache_ptr + row * stride_vb + kv * stride_vh + slot * stride_vs + offs,
                 value.to(v_cache_ptr.dtype.element_ty))


def rope_cache_write(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot: torch.Tensor, heads: int, kv_heads: int) -> torch.Tensor:
    """decode_step.rope_cache_write's kernel; arguments checked there."""
    check_kernel_mode(_rope_cache_kernel, qkv.device, "rope_cache_write")
    rows, D = qkv.shape[0], k_cache.shape[-1]
    q = torch.empty((rows, heads, D), dtype=qkv.dtype, device=qkv.device)
    _rope_cache_kernel[(rows, heads + 2 * kv_heads)](
        qkv, cos, sin_signed, q, k_cache, v_cache, slot,
        qkv.stride(0), cos.stride(0), *k_cache.stride()[:3], *v_cache.stride()[:3],
        HEADS=heads, KV_HEADS=kv_heads, D=D,
    )
    return q


@triton.jit
def _attention_split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, slot_ptr, o_ptr, m_ptr, l_ptr,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_mask,
    scale,
    KV_HEADS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):
    pair = tl.program_id(0)  # row * KV_HEADS + kv head
    split = tl.program_id(1)
    row = (pair // KV_HEADS).to(tl.int64)
    kv = pair % KV_HEADS
    live = tl.load(slot_ptr).to(tl.int32) + 1  # keys 0..slot
    # Ranges of whole blocks sized from the live length: a short cache leaves the later splits empty.
    per_split = tl.cdiv(tl.cdiv(live, SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, live)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + row * stride_qb + kv * stride_qh + g[:, None] * D + d[None, :],
                mask=g[:, None] < G, other=0.0).to(tl.float32)
    keys = k_ptr + row * stride_kb + kv * stride_kh
    values = v_ptr + row * stride_vb + kv * stride_vh
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for first in range(start, end, BLOCK_N):
        slots = first + n
        inside = slots < end
        k = tl.load(keys + slots[:, None] * stride_ks + d[None, :], mask=inside[:, None], other=0.0)
        # Products summed in fp32 rather than tl.dot: G is 1-8 query heads, where tl.dot pads to 16 rows,
        # and the step is bound by reading the keys and values, not by this arithmetic.
        scores = tl.sum(q[:, None, :] * k.to(tl.float32)[None, :, :], 2)
        bias = tl.load(mask_ptr + row * stride_mask + slots, mask=inside, other=float("-inf")).to(tl.float32)
        scores = scores * scale + bias[None, :]
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        # Until a finite score is seen m is -inf: subtract 0 instead, so that exp(-inf - 0) = 0 rescales the
        # (empty) sums and weighs -inf scores, where -inf - -inf would be NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - shift)
        p = tl.exp(scores - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(values + slots[:, None] * stride_vs + d[None, :], mask=inside[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
        m_i = m_new
    part = pair * SPLITS + split
    tl.store(o_ptr + (part * BLOCK_G + g[:, None]) * D + d[None, :], acc)
    tl.store(m_ptr + part * BLOCK_G + g, m_i)
    tl.store(l_ptr + part * BLOCK_G + g, l_i)


@triton.jit
def _attention_merge_kernel(
    o_ptr, m_ptr, l_ptr, out_ptr, stride_ob, stride_oh,
    KV_HEADS: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
):
    pair = tl.program_id(0)
    row = (pair // KV_HEADS).to(tl.int64)
    kv = pair % KV_HEADS
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    top = tl.full([BLOCK_G], float("-inf"), tl.float32)
    for split in range(SPLITS):
        top = tl.maximum(top, tl.load(m_ptr + (pair * SPLITS + split) * BLOCK_G + g))
    total = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    for split in range(SPLITS):
        part = pair * SPLITS + split
        m = tl.load(m_ptr + part * BLOCK_G + g)
        weight = tl.exp(m - tl.where(top == float("-inf"), 0.0, top))  # an empty split weighs nothing
        total += tl.load(l_ptr + part * BLOCK_G + g) * weight
        acc += tl.load(o_ptr + (part * BLOCK_G + g[:, None]) * D + d[None, :]) * weight[:, None]
    out = acc / total[:, None]
    tl.store(out_ptr + row * stride_ob + kv * stride_oh + g[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g[:, None] < G)


def live_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, mask: torch.Tensor,
                   slot: torch.Tensor, scale: float, splits: int, block_n: int) -> torch.Tensor:
    """decode_step.live_attention's kernels; arguments checked there."""
    check_kernel_mode(_attention_split_kernel, q.device, "live_attention")
    B, kv_heads, groups, D = q.shape
    block_g = triton.next_power_of_2(groups)
    pairs = B * kv_heads
    partial = torch.empty((pairs, splits, block_g, D), dtype=torch.float32, device=q.device)
    maxima = torch.empty((pairs, splits, block_g), dtype=torch.float32, device=q.device)
    sums = torch.empty_like(maxima)
    _attention_split_kernel[(pairs, splits)](
        q, k_cache, v_cache, mask, slot, partial, maxima, sums,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], mask.stride(0),
        scale, KV_HEADS=kv_heads, G=groups, BLOCK_G=block_g, D=D, BLOCK_N=block_n, SPLITS=splits,
    )
    out = torch.empty_like(q)
    _attention_merge_kernel[(pairs,)](
        partial, maxima, sums, out, out.stride(0), out.stride(1),
        KV_HEADS=kv_heads, G=groups, BLOCK_G=block_g, D=D, SPLITS=splits,
    )
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, sum_ptr, normed_ptr, H, eps,
                         BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    inside = offs < H
    # The sum rounded to the row dtype first, as the eager `x + delta` stores it, then normalised in fp32.
    total = (tl.load(x_ptr + row * H + offs, mask=inside, other=0.0).to(tl.float32)
             + tl.load(delta_ptr + row * H + offs, mask=inside, other=0.0).to(tl.float32)
             ).to(sum_ptr.dtype.element_ty)
    tl.store(sum_ptr + row * H + offs, total, mask=inside)
    xf = total.to(tl.float32)
    scaled = xf * tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)
    # transformers' LlamaRMSNorm: the normalised row cast to the row dtype, then times the weight.
    weight = tl.load(weight_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    normed = scaled.to(sum_ptr.dtype.element_ty).to(tl.float32) * weight
    tl.store(normed_ptr + row * H + offs, normed.to(normed_ptr.dtype.element_ty), mask=inside)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """decode_step.add_rms_norm's kernel; arguments checked there."""
    check_kernel_mode(_add_rms_norm_kernel, x.device, "add_rms_norm")
    rows, H = x.shape
    total = torch.empty_like(x)
    normed = torch.empty_like(x)
    _add_rms_norm_kernel[(rows,)](x, delta, weight, total, normed, H, eps, BLOCK_H=triton.next_power_of_2(H))
    return total, normed


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, F, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < F
    gate = tl.load(gate_up_ptr + row * 2 * F + offs, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * F + F + offs, mask=inside, other=0.0).to(tl.float32)
    # F.silu's result is rounded to the row dtype before the product, as eager `F.silu(gate) * up` does.
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * F + offs, (silu * up).to(out_ptr.dtype.element_ty), mask=inside)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """decode_step.silu_mul's kernel; arguments checked there."""
    check_kernel_mode(_silu_mul_kernel, gate_up.device, "silu_mul")
    rows, width = gate_up.shape
    F = width // 2
    out = torch.empty((rows, F), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(F))
    _silu_mul_kernel[(rows, triton.cdiv(F, block))](gate_up, out, F, BLOCK=block)
    return out
