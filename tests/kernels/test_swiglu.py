"""silu_mul's C++ CPU kernel against F.silu(gate) * up (the reference): the output and both gradients with
the reference's bits where every element is in a full 8-lane group, to float rounding elsewhere; the same
bits on 1 and 2 threads; a gradient only where asked; and where "auto" keeps torch."""

import pytest
import torch
import torch.nn.functional as F

from alignflow.kernels.swiglu import silu_mul

pytestmark = [
    pytest.mark.cpu_only("silu_mul's C++ kernel takes CPU tensors"),
    pytest.mark.usefixtures("avx2_kernels"),  # tests/kernels/conftest.py
]


def _inputs(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=gen) * 4).requires_grad_()  # past SiLU's bend, both signs
    up = torch.randn(shape, generator=gen).requires_grad_()
    grad = torch.randn(shape, generator=gen)
    return gate, up, grad


def _forward_backward(gate, up, grad, impl):
    out = silu_mul(gate, up, impl)
    d_gate, d_up = torch.autograd.grad(out, (gate, up), grad)
    return out.detach(), d_gate, d_up


@pytest.mark.parametrize("shape", [(640, 1024), (7, 13), (3, 5, 17), (1,)])
def test_the_kernel_gives_the_references_output_and_gradients(shape):
    gate, up, grad = _inputs(shape)
    ref = _forward_backward(gate, up, grad, "torch")
    got = _forward_backward(gate, up, grad, "cpp")
    for name, a, b in zip(("output", "grad gate", "grad up"), ref, got, strict=True):
        scale = max(1.0, float(a.abs().max()))
        # torch computes a tensor's last partial lane group its own way (1 ulp apart at most)
        assert float((a - b).abs().max()) <= 1e-6 * scale, (name, shape)
    if gate.numel() % 8 == 0:  # all in full groups: torch's SLEEF exp and operation order, so its bits
        for name, a, b in zip(("output", "grad gate", "grad up"), ref, got, strict=True):
            assert torch.equal(a, b), (name, shape)


def test_the_same_bits_on_one_and_two_threads(on_threads):
    gate, up, grad = _inputs((300, 1000))
    one, two = (on_threads(count, lambda: _forward_backward(gate, up, grad, "cpp")) for count in (1, 2))
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


def test_only_the_asked_gradient_is_computed_and_a_no_grad_call_gives_the_same_output():
    gate, up, grad = _inputs((16, 24))
    frozen_up = up.detach()
    out = silu_mul(gate, frozen_up, "cpp")
    (d_gate,) = torch.autograd.grad(out, (gate,), grad)
    assert torch.equal(d_gate, _forward_backward(gate, up, grad, "cpp")[1])
    with torch.no_grad():
        plain = silu_mul(gate, up, "cpp")
    assert plain.grad_fn is None and torch.equal(plain, out.detach())


def test_a_strided_input_gives_its_contiguous_copys_result():
    gate, up, _ = _inputs((64, 48))
    g, u = gate.detach().t(), up.detach().t()
    assert torch.equal(silu_mul(g, u, "cpp"), silu_mul(g.contiguous(), u.contiguous(), "cpp"))


def test_auto_keeps_torch_where_the_kernel_does_not_apply_and_bad_arguments_are_named():
    gate, up, _ = _inputs((5, 64))
    g16, u16 = gate.detach().bfloat16(), up.detach().bfloat16()
    assert torch.equal(silu_mul(g16, u16), F.silu(g16) * u16)
    with pytest.raises(ValueError, match="takes float32 CPU tensors"):
        silu_mul(g16, u16, "cpp")
    with pytest.raises(ValueError, match="impl must be"):
        silu_mul(gate, up, "fast")
    with pytest.raises(ValueError, match=r"gate \(5, 64\) and up \(5, 63\)"):
        silu_mul(gate, up[:, :63])
