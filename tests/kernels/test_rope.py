"""apply_rope's C++ CPU kernel against native/model.py's apply_rope (the reference): the output and the
gradient with the reference's bits, for head sizes with and without a full 8-lane half; the same bits on 1 and
2 threads; and where "auto" keeps torch."""

import pytest
import torch

from alignflow.kernels.rope import apply_rope
from alignflow.stages.common.generation.native import model as native_model

pytestmark = [
    pytest.mark.cpu_only("apply_rope's C++ kernel takes CPU tensors"),
    pytest.mark.usefixtures("avx2_kernels"),  # tests/kernels/conftest.py
]


def _inputs(batch, width, heads, head_dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, heads, head_dim, generator=gen).requires_grad_()
    angles = torch.rand(batch, width, 1, head_dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1)
    sin = native_model.signed_sin(torch.cat((angles.sin(), angles.sin()), dim=-1))
    grad = torch.randn(batch, width, heads, head_dim, generator=gen)
    return x, cos, sin, grad


@pytest.mark.parametrize("shape", [(8, 80, 4, 64), (2, 5, 3, 12), (1, 3, 2, 6), (2, 7, 1, 80)])
def test_the_kernel_gives_the_references_bits(shape):
    x, cos, sin, grad = _inputs(*shape)
    ref = native_model.apply_rope(x, cos, sin)
    got = apply_rope(x, cos, sin, "cpp")
    assert torch.equal(got, ref)
    (ref_grad,) = torch.autograd.grad(ref, x, grad)
    (got_grad,) = torch.autograd.grad(got, x, grad)
    assert torch.equal(got_grad, ref_grad)


def test_the_same_bits_on_one_and_two_threads(on_threads):
    x, cos, sin, grad = _inputs(4, 300, 4, 64)

    def forward_backward():
        out = apply_rope(x, cos, sin, "cpp")
        return (out.detach(), *torch.autograd.grad(out, x, grad))

    results = [on_threads(count, forward_backward) for count in (1, 2)]
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_a_strided_input_gives_its_contiguous_copys_result():
    x, cos, sin, _ = _inputs(2, 6, 3, 16)
    strided = x.detach().transpose(0, 1).contiguous().transpose(0, 1)  # same shape, other strides
    assert not strided.is_contiguous()
    assert torch.equal(apply_rope(strided, cos, sin, "cpp"), apply_rope(x.detach(), cos, sin, "cpp"))


def test_auto_keeps_torch_where_the_kernel_does_not_apply_and_bad_arguments_are_named():
    x, cos, sin, _ = _inputs(2, 4, 2, 8)
    half = x.detach().bfloat16()
    assert torch.equal(
        apply_rope(half, cos.bfloat16(), sin.bfloat16()),
        native_model.apply_rope(half, cos.bfloat16(), sin.bfloat16()),
    )
    with pytest.raises(ValueError, match="takes float32 CPU tensors"):
        apply_rope(half, cos.bfloat16(), sin.bfloat16(), "cpp")
    with pytest.raises(ValueError, match="impl must be"):
        apply_rope(x, cos, sin, "fast")
    with pytest.raises(ValueError, match=r"must be \[2, 4, 1, 8\]"):
        apply_rope(x, cos[:, :3], sin[:, :3])
