"""The AVX-512 decode-attention kernel against its torch reference: cache views, masks, GQA groups, errors."""

from __future__ import annotations

import pytest
import torch

from alignflow.kernels import _cpu_extension
from alignflow.kernels import decode_attention as da

pytestmark = pytest.mark.cpu_only("the C++ decode-attention kernel takes CPU tensors")


@pytest.fixture(autouse=True)
def _kernel_builds_here():
    # A fixture, not a skipif at import: a --device cuda run (which skips this module) never builds the
    # kernels.
    if not da.available():
        pytest.skip(f"CPU kernels: {_cpu_extension.unavailable_reason()}")


def _case(batch, kv_heads, groups, head_dim, kv_len, slots, seed=0, spread=1.0):
    """q and views [:batch, :, :kv_len] of a larger cache, as the engine passes them; a mask with padding
    (a -inf prefix per row) and a sliding window (-inf in the middle)."""
    gen = torch.Generator().manual_seed(seed)
    cache_k = torch.randn(batch + 3, kv_heads, slots, head_dim, generator=gen) * spread
    cache_v = torch.randn(batch + 3, kv_heads, slots, head_dim, generator=gen)
    q = torch.randn(batch, kv_heads, groups, head_dim, generator=gen)
    slot = torch.arange(kv_len)
    pad = torch.randint(0, kv_len, (batch,), generator=gen)
    allowed = slot[None, :] >= pad[:, None]
    if kv_len > 6:
        allowed[0] &= (slot <= 1) | (slot >= kv_len - 4)  # row 0: a window with a hole
        allowed[0, -1] = True
    mask = torch.zeros(batch, kv_len).masked_fill_(~allowed, float("-inf"))
    return q, cache_k[:batch, :, :kv_len], cache_v[:batch, :, :kv_len], mask


@pytest.mark.parametrize("batch, kv_heads, groups, head_dim, kv_len, slots", [
    (1, 1, 1, 16, 1, 1),        # one key
    (3, 2, 1, 16, 5, 9),        # MHA, short
    (8, 12, 1, 64, 57, 88),     # the ~110M engine mid-generation
    (4, 2, 3, 64, 33, 40),      # GQA, 3 query heads per KV head
    (2, 1, 7, 128, 17, 17),     # 7 groups: a chunk of 4 and a chunk of 3; the cache's full width
    (5, 3, 4, 32, 130, 200),    # longer than a 128-key block
])
def test_matches_the_torch_reference(batch, kv_heads, groups, head_dim, kv_len, slots):
    q, keys, values, mask = _case(batch, kv_heads, groups, head_dim, kv_len, slots)
    scale = head_dim**-0.5
    got = da.decode_attention(q, keys, values, mask, scale)
    want = da.reference(q, keys, values, mask, scale)
    assert got.shape == (batch, kv_heads, groups, head_dim)
    # Same float32 arithmetic in another order, and a polynomial exp: measured <= 5e-7 on these cases.
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert torch.equal(da.op(q, keys, values, mask, scale), got)


def test_peaked_and_flat_softmax():
    """Scores spread over ~100 (most weights underflow to 0) and all equal (uniform weights)."""
    q, keys, values, mask = _case(4, 2, 2, 64, 40, 48, seed=3, spread=20.0)
    torch.testing.assert_close(da.decode_attention(q, keys, values, mask, 1.0),
                               da.reference(q, keys, values, mask, 1.0), rtol=0, atol=2e-6)
    flat = torch.zeros_like(q)
    got = da.decode_attention(flat, keys, values, torch.zeros(4, 40), 1.0)
    torch.testing.assert_close(got, values.mean(dim=2, keepdim=True).expand_as(got), rtol=0, atol=2e-6)


def test_bad_inputs_name_what_is_wrong():
    q, keys, values, mask = _case(2, 2, 1, 16, 5, 5)
    with pytest.raises(RuntimeError, match="float32 CPU tensors only"):
        da.decode_attention(q.double(), keys, values, mask, 0.25)
    with pytest.raises(RuntimeError, match="mask .* is not \\[B, L\\]"):
        da.decode_attention(q, keys, values, mask[:, :4], 0.25)
    with pytest.raises(RuntimeError, match="head_dim 8 must be a multiple of 16"):
        da.decode_attention(q[..., :8], keys[..., :8], values[..., :8], mask, 0.25)
    assert not da.supports(torch.device("cpu"), torch.bfloat16, 64)
    assert not da.supports(torch.device("cpu"), torch.float32, 72)
    assert da.supports(torch.device("cpu"), torch.float32, 128)
