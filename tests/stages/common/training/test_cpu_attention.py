"""cpu_attention: SDPA's result and gradients in fp32, autocast, GQA; equal bits on 1 and 2 threads.

Tolerances: fp32 against SDPA's math path, max |diff| measured ~1e-7 (outputs) and ~5e-7 (gradients relative
to the largest); the bound 1e-5 is far below what a wrong scale, mask or softmax term moves (>1e-2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alignflow.stages.common.training import cpu_attention, llama_forward

pytestmark = pytest.mark.cpu_only("cpu_attention is the CPU training step's attention")

FP32 = 1e-5


def inputs(heads: int = 4, kv_heads: int = 4, batch: int = 3, width: int = 37, dim: int = 16, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, width, dim, generator=generator, requires_grad=True)
    k = torch.randn(batch, kv_heads, width, dim, generator=generator, requires_grad=True)
    v = torch.randn(batch, kv_heads, width, dim, generator=generator, requires_grad=True)
    # Two sequences per row and a causal mask, as llama_forward's packed rows have.
    segments = torch.ones(batch, width, dtype=torch.long)
    segments[:, width // 2:] = 2
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = (causal[None] & (segments[:, :, None] == segments[:, None, :])).unsqueeze(1)
    bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
    grad = torch.randn(batch, heads, width, dim, generator=generator)
    return q, k, v, bias, grad


def forward_backward(fn, q, k, v, bias, grad):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v, bias)
    out.backward(grad)
    return out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()


def sdpa(q, k, v, bias):
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, scale=0.3, enable_gqa=k.shape[1] != q.shape[1]
    )


def explicit(q, k, v, bias):
    return cpu_attention.attention(q, k, v, bias, 0.3)


def assert_close(got, want, bound):
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.float32
        assert float((g - w).abs().max()) <= bound * (float(w.abs().max()) or 1.0)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_sdpa_with_gradients_in_fp32(kv_heads):
    q, k, v, bias, grad = inputs(kv_heads=kv_heads)
    assert_close(
        forward_backward(explicit, q, k, v, bias, grad), forward_backward(sdpa, q, k, v, bias, grad), FP32
    )


def test_under_autocast_it_computes_in_fp32_from_the_bf16_inputs():
    q, k, v, bias, grad = inputs(kv_heads=2)
    rounded = [t.detach().bfloat16().float().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = forward_backward(
            lambda *a: explicit(*(t.bfloat16() for t in a[:3]), a[3].bfloat16()), q, k, v, bias, grad
        )
    # fp32 attention of the bf16-rounded inputs; the gradients pass back through the bf16 casts.
    want = forward_backward(sdpa, *rounded, bias, grad)
    assert float((got[0] - want[0]).abs().max()) <= FP32 * float(want[0].abs().max())
    for g, w in zip(got[1:], want[1:], strict=True):
        assert float((g - w).abs().max()) <= 1e-2 * float(w.abs().max())  # each gradient rounded to bf16 once


def test_gives_the_same_bits_on_one_and_two_threads():
    """PPO's critic trains on its own thread with half the threads (overlap_critic), bit-equal to in line."""
    q, k, v, bias, grad = inputs(batch=4, width=131, dim=64)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = forward_backward(explicit, q, k, v, bias, grad)
        torch.set_num_threads(2)
        two = forward_backward(explicit, q, k, v, bias, grad)
    finally:
        torch.set_num_threads(previous)
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


def test_llama_forward_takes_it_in_fp32_and_under_cpu_autocast_within_the_eager_length_and_the_memory_bound(
    monkeypatch,
):
    from tests.stages.common.training.test_llama_forward import causal_lm, rl_batch

    real = cpu_attention.attention
    model = causal_lm("llama_gqa_tied_llama3")
    packed = rl_batch(seed=1).packed
    batch, width = packed.input_ids.shape

    def layers_through_it(autocast: bool = True, on=model) -> int:
        calls = []
        monkeypatch.setattr(cpu_attention, "attention", lambda *a: calls.append(a) or real(*a))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            llama_forward.llama_hidden_states(
                on.model, packed.input_ids, packed.segment_ids, packed.position_ids
            )
        return len(calls)

    assert layers_through_it(autocast=False) == model.config.num_hidden_layers  # fp32
    assert layers_through_it() == model.config.num_hidden_layers
    # bf16 weights outside autocast keep SDPA: cpu_attention's fp32 output would not go into a bf16 o_proj
    assert layers_through_it(autocast=False, on=causal_lm("llama_gqa_tied_llama3").to(torch.bfloat16)) == 0
    with monkeypatch.context() as patch:
        patch.setattr(llama_forward, "EAGER_ATTENTION_MAX_LEN", width - 1)
        assert layers_through_it() == 0  # longer rows keep SDPA (scores are width^2)
    with monkeypatch.context() as patch:
        patch.setattr(
            cpu_attention,
            "MAX_PROBABILITY_BYTES",
            batch * model.config.num_attention_heads * width**2 * 4 - 1,
        )
        assert layers_through_it() == 0  # and so do batches whose probabilities would not fit


def test_fits_bounds_the_probabilities_kept_for_the_backward():
    assert cpu_attention.fits(8, 4, 150)  # the RL benchmark's PPO minibatch: 2.9 MB a layer
    assert not cpu_attention.fits(16, 32, 512)  # 512 MiB a layer
