"""Triton kernels behind logprobs.py: one program per row, online logsumexp over vocab blocks (no autograd).

Forward reads each logit once and writes three fp32 numbers per row (log-prob at the index,
entropy, logsumexp); backward reads the logits once more and writes the gradient in the logits'
dtype. Rows are addressed as (row // n_inner) * stride_outer + (row % n_inner) * stride_inner, which
covers contiguous [N, V] inputs and sliced [B, T, V] ones such as ``logits[:, :-1]`` without a copy.

Import this module only after deciding whether TRITON_INTERPRET=1 applies (see _triton_dispatch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from alignflow.kernels._triton_dispatch import check_kernel_mode

# 4096 logits per block: 8 KiB of bf16 per load, 16 fp32 values per thread at 8 warps; fewer, larger
# blocks also keep the interpreter (one Python-level step per block) usable in CPU tests.
_BLOCK_V = 4096
_NUM_WARPS = 8


@triton.jit
def _logprobs_fwd_kernel(
    logits_ptr,
    index_ptr,
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    n_inner,
    stride_outer,
    stride_inner,
    V,
    inv_t,
    HAS_INDEX: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (row // n_inner) * stride_outer + (row % n_inner) * stride_inner
    offs = tl.arange(0, BLOCK_V)
    m = tl.full([], float("-inf"), tl.float32)  # running max of z = logits / T
    s = tl.full([], 0.0, tl.float32)  # sum exp(z - m)
    w = tl.full([], 0.0, tl.float32)  # sum exp(z - m) * (z - m): entropy numerator, relative to m
    for start in range(0, V, BLOCK_V):
        mask = start + offs < V
        z = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        # m == -inf only before the first finite logit; then s = w = 0 and the rescale must be 0, not NaN.
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new))
        finite = z > float("-inf")
        d = tl.where(finite, z - m_new, 0.0)  # -inf logits: d = 0 here, e = 0 below, so e * d = 0, never NaN
        e = tl.where(finite, tl.exp(d), 0.0)
        if HAS_ENTROPY:
            # sum e_i (z_i - m_new) = alpha * (w + s * (m - m_new)) for the old terms, plus the new block.
            shift = tl.where(m == float("-inf"), 0.0, m - m_new)
            w = alpha * (w + s * shift) + tl.sum(e * d, 0)
        s = s * alpha + tl.sum(e, 0)
        m = m_new
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lse_ptr + row, lse)
    if HAS_INDEX:
        idx = tl.load(index_ptr + row).to(tl.int64)
        z_idx = tl.load(base + idx).to(tl.float32) * inv_t
        tl.store(logp_ptr + row, z_idx - lse)
    if HAS_ENTROPY:
        # H = log s - sum p (z - m): both terms O(log V), no cancellation against a large lse.
        tl.store(entropy_ptr + row, log_s - w / s)


@triton.jit
def _logprobs_bwd_kernel(
    logits_ptr,
    index_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    grad_ptr,
    n_inner,
    stride_outer,
    stride_inner,
    V,
    inv_t,
    HAS_LOGP_GRAD: tl.constexpr,
    HAS_ENTROPY_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + (row // n_inner) * stride_outer + (row % n_inner) * stride_inner
    out = grad_ptr + row * V
    offs = tl.arange(0, BLOCK_V)
    lse = tl.load(lse_ptr + row)
    if HAS_LOGP_GRAD:
        idx = tl.load(index_ptr + row).to(tl.int64)
        g_logp = tl.load(grad_logp_ptr + row).to(tl.float32)
    if HAS_ENTROPY_GRAD:
        ent = tl.load(entropy_ptr + row)
        g_ent = tl.load(grad_entropy_ptr + row).to(tl.float32)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        z = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        p = tl.exp(z - lse)
        log_p = tl.where(p > 0.0, z - lse, 0.0)  # p = 0 (logit -inf): 0 instead of -inf, so p * log_p = 0
        gz = tl.zeros([BLOCK_V], dtype=tl.float32)
        if HAS_LOGP_GRAD:
            gz = tl.where(cols == idx, g_logp, 0.0) - p * g_logp
        if HAS_ENTROPY_GRAD:
            gz -= g_ent * p * (log_p + ent)
        tl.store(out + cols, (gz * inv_t).to(grad_ptr.dtype.element_ty), mask=mask)


def _row_layout(logits: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(tensor, n_inner, stride_outer, stride_inner) addressing logits' rows, copying only if unavoidable."""
    vocab = logits.shape[-1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    try:
        flat = logits.view(-1, vocab)
        return logits, max(flat.shape[0], 1), 0, flat.stride(0)
    except RuntimeError:
        pass
    if logits.ndim == 3:
        return logits, logits.shape[1], logits.stride(0), logits.stride(1)
    logits = logits.contiguous()
    return logits, max(logits.numel() // vocab, 1), 0, vocab


def forward(
    logits: torch.Tensor, index: torch.Tensor | None, temperature: float, want_logp: bool, want_entropy: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """Same contract as logprobs._forward_torch: (logp, entropy, lse), fp32 shaped like logits.shape[:-1]."""
    check_kernel_mode(_logprobs_fwd_kernel, logits.device, "selective_log_softmax")
    lead = logits.shape[:-1]
    n_rows, vocab = lead.numel(), logits.shape[-1]
    src, n_inner, stride_outer, stride_inner = _row_layout(logits)
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    logp = torch.empty_like(lse) if want_logp else None
    entropy = torch.empty_like(lse) if want_entropy else None
    if n_rows:
        flat_index = index.reshape(-1).contiguous() if want_logp else lse
        _logprobs_fwd_kernel[(n_rows,)](
            src,
            flat_index,
            logp if want_logp else lse,
            entropy if want_entropy else lse,
            lse,
            n_inner,
            stride_outer,
            stride_inner,
            vocab,
            1.0 / temperature,
            HAS_INDEX=want_logp,
            HAS_ENTROPY=want_entropy,
            BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)),
            num_warps=_NUM_WARPS,
        )
    shape = lambda t: None if t is None else t.view(lead)  # noqa: E731
    return shape(logp), shape(entropy), lse.view(lead)


def backward(
    logits: torch.Tensor,
    index: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Same contract as logprobs._backward_torch: the logits' gradient,
    logits' dtype and shape, contiguous."""
    check_kernel_mode(_logprobs_bwd_kernel, logits.device, "selective_log_softmax")
    vocab = logits.shape[-1]
    n_rows = logits.numel() // vocab
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    if n_rows == 0:
        return grad
    src, n_inner, stride_outer, stride_inner = _row_layout(logits)
    lse = lse.reshape(-1).contiguous()
    has_logp, has_ent = grad_logp is not None, grad_entropy is not None
    _logprobs_bwd_kernel[(n_rows,)](
        src,
        index.reshape(-1).contiguous() if has_logp else lse,
        lse,
        entropy.reshape(-1).contiguous() if has_ent else lse,
        grad_logp.reshape(-1).contiguous() if has_logp else lse,
        grad_entropy.reshape(-1).contiguous() if has_ent else lse,
        grad,
        n_inner,
        stride_outer,
        stride_inner,
        vocab,
        1.0 / temperature,
        HAS_LOGP_GRAD=has_logp,
        HAS_ENTROPY_GRAD=has_ent,
        BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)),
        num_warps=_NUM_WARPS,
    )
    return grad
