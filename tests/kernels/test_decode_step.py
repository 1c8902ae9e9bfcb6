"""kernels/decode_step.py: each fused decode op's Triton kernel (compiled under --device cuda, Triton's CPU
interpreter under --device cpu) against its torch reference, the eager model's own ops."""

import pytest
import torch

from alignflow.kernels import decode_step

DTYPES = [torch.float32, torch.bfloat16]


def _close(dtype: torch.dtype, device: str = "cuda") -> dict:
    """Kernel vs reference: fp32 differs in summation order and FMA contraction (measured <= 5e-7 on these
    shapes); bf16 by a rounding of the row dtype (one bf16 ulp, 2**-8 relative, of O(1) values). Triton's
    interpreter truncates fp32 to bf16 where the GPU rounds to nearest: up to one more ulp per rounding
    (silu_mul rounds twice) under --device cpu."""
    if dtype == torch.float32:
        return {"atol": 2e-6, "rtol": 1e-5}
    return {"atol": 2e-2, "rtol": 2**-7 if device == "cuda" else 2**-6}


def _rope_tables(rows: int, D: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    from alignflow.stages.common.generation.native.model import signed_sin

    angles = torch.rand(rows, D // 2, generator=torch.Generator().manual_seed(7)) * 6.0
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(device), signed_sin(angles.sin()).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,D", [(4, 2, 16), (2, 2, 64), (8, 1, 32)])
def test_rope_cache_write_matches_the_eager_ops(dtype, heads, kv_heads, D, device):
    g = torch.Generator().manual_seed(0)
    B, S, slot = 3, 10, 6
    qkv = torch.randn(B, (heads + 2 * kv_heads) * D, generator=g).to(device, dtype)
    cos, sin = (t.to(dtype) for t in _rope_tables(B, D, device))
    caches = torch.randn(2, B, kv_heads, S, D, generator=g).to(device, dtype)
    slot_t = torch.tensor([slot], device=device)
    results = {}
    for impl in ("torch", "triton"):
        k_cache, v_cache = caches[0].clone(), caches[1].clone()
        q = decode_step.rope_cache_write(qkv, cos, sin, k_cache, v_cache, slot_t, heads, kv_heads, impl=impl)
        results[impl] = (q, k_cache, v_cache)
    (q_ref, k_ref, v_ref), (q, k, v) = results["torch"], results["triton"]
    torch.testing.assert_close(q, q_ref, **_close(dtype, device))
    torch.testing.assert_close(k, k_ref, **_close(dtype, device))
    assert torch.equal(v, v_ref)  # values are copied, not computed
    others = torch.arange(S, device=device) != slot
    assert torch.equal(k[:, :, others], caches[0][:, :, others])  # only the step's slot is written
    assert not torch.equal(k[:, :, slot], caches[0][:, :, slot])


def _attention_case(B, kv_heads, groups, D, S, slot, dtype, device, window=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, kv_heads, groups, D, generator=g).to(device, dtype)
    k_cache = torch.randn(B, kv_heads, S, D, generator=g).to(device, dtype)
    v_cache = torch.randn(B, kv_heads, S, D, generator=g).to(device, dtype)
    pad = torch.randint(0, slot + 1, (B,), generator=g)
    slots = torch.arange(S)
    allowed = (slots[None] >= pad[:, None]) & (slots[None] <= slot)
    if window is not None:
        allowed &= slots[None] > slot - window
    mask = torch.zeros(B, S).masked_fill_(~allowed, float("-inf")).to(device, dtype)
    return q, k_cache, v_cache, mask, torch.tensor([slot], device=device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "B,kv_heads,groups,D,S,slot,splits",
    [
        (2, 2, 2, 16, 40, 0, 3),  # the first step: one key
        (3, 2, 4, 32, 70, 41, 4),  # ranges that end mid-block
        (1, 1, 1, 64, 96, 95, 1),  # the whole cache, one range
        (2, 4, 3, 16, 64, 20, 8),  # more ranges than blocks of the live length: later ones empty
    ],
)
def test_live_attention_matches_the_static_step(dtype, B, kv_heads, groups, D, S, slot, splits, device):
    q, k_cache, v_cache, mask, slot_t = _attention_case(B, kv_heads, groups, D, S, slot, dtype, device)
    reference = decode_step.live_attention(q, k_cache, v_cache, mask, slot_t, D**-0.5, impl="torch")
    got = decode_step.live_attention(q, k_cache, v_cache, mask, slot_t, D**-0.5, splits=splits, impl="triton")
    torch.testing.assert_close(got, reference, **_close(dtype, device))


def test_live_attention_applies_a_sliding_window_given_in_the_mask(device):
    q, k_cache, v_cache, mask, slot_t = _attention_case(2, 2, 2, 16, 64, 50, torch.float32, device, window=9)
    reference = decode_step.live_attention(q, k_cache, v_cache, mask, slot_t, 0.25, impl="torch")
    got = decode_step.live_attention(q, k_cache, v_cache, mask, slot_t, 0.25, splits=4, impl="triton")
    torch.testing.assert_close(got, reference, **_close(torch.float32))


def test_live_attention_never_reads_the_slots_after_the_step(device):
    """NaN keys and values past the slot: the reference's masked read gives NaN; the kernel stays exact."""
    q, k_cache, v_cache, mask, slot_t = _attention_case(2, 2, 2, 16, 64, 30, torch.float32, device)
    reference = decode_step.live_attention(q, k_cache, v_cache, mask, slot_t, 0.25, impl="torch")
    k_cache[:, :, 31:] = float("nan")
    v_cache[:, :, 31:] = float("nan")
    mask[:, 31:] = float("nan")
    got = decode_step.live_attention(q, k_cache, v_cache, mask, slot_t, 0.25, splits=3, impl="triton")
    masked_read = decode_step.live_attention(q, k_cache, v_cache, mask, slot_t, 0.25, impl="torch")
    assert torch.isnan(masked_read).all()
    torch.testing.assert_close(got, reference, **_close(torch.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("H", [64, 96])
def test_add_rms_norm_matches_the_eager_add_and_norm(dtype, H, device):
    g = torch.Generator().manual_seed(1)
    x, delta = (torch.randn(5, H, generator=g).to(device, dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(H, generator=g)).to(device, dtype)
    total_ref, normed_ref = decode_step.add_rms_norm(x, delta, weight, 1e-5, impl="torch")
    total, normed = decode_step.add_rms_norm(x, delta, weight, 1e-5, impl="triton")
    if dtype == torch.float32 or device == "cuda":
        assert torch.equal(total, total_ref)  # one add, rounded once: the same bits
    torch.testing.assert_close(total, total_ref, **_close(dtype, device))
    torch.testing.assert_close(normed, normed_ref, **_close(dtype, device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("F", [48, 1500])
def test_silu_mul_matches_the_eager_ops(dtype, F, device):
    gate_up = (3 * torch.randn(4, 2 * F, generator=torch.Generator().manual_seed(2))).to(device, dtype)
    reference = decode_step.silu_mul(gate_up, impl="torch")
    got = decode_step.silu_mul(gate_up, impl="triton")
    torch.testing.assert_close(got, reference, **_close(dtype, device))


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: decode_step.silu_mul(torch.zeros(2, 5)), r"gate_up \(2, 5\) is not \[N, 2F\]"),
        (lambda: decode_step.add_rms_norm(torch.zeros(2, 4), torch.zeros(2, 3), torch.ones(4), 1e-5),
         r"delta \(2, 3\)"),
        (lambda: decode_step.rope_cache_write(torch.zeros(2, 40), torch.zeros(2, 8), torch.zeros(2, 8),
                                              torch.zeros(2, 1, 4, 8), torch.zeros(2, 1, 4, 8),
                                              torch.tensor([0]), 2, 1),
         r"qkv \(2, 40\) is not \[B, \(heads \+ 2 kv_heads\) x D\] = \[2, 32\]"),
        (lambda: decode_step.live_attention(torch.zeros(2, 1, 2, 16), torch.zeros(2, 1, 8, 16),
                                            torch.zeros(2, 1, 8, 16), torch.zeros(2, 9), torch.tensor([0]),
                                            1.0),
         r"mask \(2, 9\) is not \[B, S\] = \[2, 8\]"),
    ],
)
def test_bad_shapes_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_a_head_size_the_kernels_cannot_block_is_refused_with_the_fix(device):
    """head_dim 80 (a power of two is needed for the kernels' blocks): the Triton path says which setting to
    change; the torch reference takes it."""
    q, k_cache, v_cache, mask, slot_t = _attention_case(1, 1, 2, 80, 8, 3, torch.float32, device)
    with pytest.raises(ValueError, match=r"head_dim 80 is not a power of two.*gpu_decode_kernels: torch"):
        decode_step.live_attention(q, k_cache, v_cache, mask, slot_t, 0.1, impl="triton")
    assert decode_step.live_attention(q, k_cache, v_cache, mask, slot_t, 0.1, impl="torch").shape == q.shape
