"""Training attention on CPU (fp32, or under autocast): fp32 matmul, softmax and matmul, thread-invariant.

Why: under bf16 autocast torch's CPU flash attention (SDPA) has a slow backward, several times the cost of
fp32 matmuls at the RL benchmark's shapes and a large share of the actor's step; in fp32 it is ~20% slower
than these matmuls at those shapes (a packed GRPO minibatch's [8, 4, 80, 64], 2-core AVX2 EPYC)
(docs/performance.md#the-training-step). fp32 rather than bf16 matmuls: oneDNN compiles a bf16 kernel per
shape and the attention width changes every minibatch (llama_forward.pads_rows), and fp32 scores are the more
exact of the two.

The backward is written out, softmax's as p * (g - sum(g * p)), because torch's softmax backward gave
other bits on 1 and 2 threads: PPO's critic trains on its own thread with half the
threads (overlap_critic) and must train bit for bit as it does in line. Every operation here reduces a row
within one thread, so the result does not depend on the thread count
(tests/stages/common/training/test_cpu_attention.py).
"""

from __future__ import annotations

import torch
from torch import Tensor


class _Attention(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)  # fp32 inside, autocast or not
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
        # q, k, v come in as transposed views of the projections ([B, T, heads, D] memory): torch.matmul
        # copies such an operand into a contiguous one on every call, so once here, and the saved copies
        # serve the backward's four matmuls (~10% of this function's time at the RL benchmark's shapes).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        p = torch.softmax(torch.matmul(q, k.transpose(-1, -2)).mul_(scale).add_(bias), dim=-1)
        ctx.save_for_backward(q, k, v, p)
        ctx.scale = scale
        return torch.matmul(p, v)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:
        q, k, v, p = ctx.saved_tensors
        grad = grad.contiguous()  # the output's transposed gradient: one copy, not one per matmul below
        grad_v = torch.matmul(p.transpose(-1, -2), grad)
        grad_p = torch.matmul(grad, v.transpose(-1, -2))
        grad_scores = grad_p.sub_((grad_p * p).sum(-1, keepdim=True)).mul_(p).mul_(ctx.scale)
        return (
            torch.matmul(grad_scores, k),
            torch.matmul(grad_scores.transpose(-1, -2), q),
            grad_v,
            None,
            None,
        )


# The backward keeps the fp32 probabilities, batch x heads x width^2 x 4 bytes a layer (SDPA keeps a
# log-sum-exp per row): the RL benchmark's PPO minibatch (8 rows of ~150, 4 heads) keeps 2.9 MB a layer. Past
# this, SDPA: a 7B model's 32 heads over 16 rows of 512 would keep 512 MiB a layer.
MAX_PROBABILITY_BYTES = 64 * 2**20


def fits(batch: int, heads: int, width: int) -> bool:
    """Whether a layer's saved probabilities stay within MAX_PROBABILITY_BYTES."""
    return batch * heads * width * width * 4 <= MAX_PROBABILITY_BYTES


def attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """softmax(q k^T * scale + bias) v in fp32, [B, heads, T, D] (k, v with fewer heads under GQA; bias
    [B, 1, T, T] additive, no row all -inf; fp32 spares a cast per call). Returns fp32; autocast casts it
    where the next matmul runs."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if kv_heads != heads:  # GQA: each KV head serves heads // kv_heads query heads; autograd sums them back
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    return _Attention.apply(q.float(), k.float(), v.float(), bias.float(), scale)
