"""rms_norm's C++ CPU kernel against F.rms_norm (the reference): outputs and both gradients to float rounding,
the same bits on 1 and 2 threads, the no-grad call equal to the autograd one, and where "auto" keeps torch."""

import pytest
import torch
import torch.nn.functional as F

from alignflow.kernels import _cpu_extension
from alignflow.kernels.rms_norm import rms_norm

pytestmark = pytest.mark.cpu_only("rms_norm's C++ kernel takes CPU tensors")


@pytest.fixture(autouse=True)
def _kernel_builds_here():
    # A fixture, not a skipif at import: a --device cuda run (which skips this module) never builds the
    # kernels.
    if _cpu_extension.logprob_kernels() is None:
        pytest.skip(
            "the AVX2 CPU kernels are unavailable here: "
            f"{_cpu_extension.logprob_kernels_unavailable_reason()}"
        )


def _inputs(shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2).requires_grad_()
    weight = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).requires_grad_()
    grad = torch.randn(shape, generator=gen)
    return x, weight, grad


def _forward_backward(x, weight, grad, impl):
    x.grad = weight.grad = None
    out = rms_norm(x, weight, 1e-6, impl)
    out.backward(grad)
    return out.detach(), x.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("shape", [(640, 64), (7, 13), (2, 37, 256), (300, 1)])
def test_the_kernel_gives_the_references_output_and_gradients(shape):
    x, weight, grad = _inputs(shape)
    ref = _forward_backward(x, weight, grad, "torch")
    got = _forward_backward(x, weight, grad, "cpp")
    for name, a, b in zip(("output", "grad x", "grad weight"), ref, got, strict=True):
        scale = max(1.0, float(a.abs().max()))
        # fp32 rounding: the mean's sum runs in another order; the weight's gradient sums the rows' terms
        assert float((a - b).abs().max()) <= 2e-6 * scale, (name, shape)


def test_a_strided_input_is_normalised_as_its_contiguous_copy():
    x, weight, grad = _inputs((64, 48))
    strided = x.detach().t()  # [48, 64], not contiguous
    w = torch.ones(64)
    assert torch.equal(rms_norm(strided, w, 1e-6, "cpp"), rms_norm(strided.contiguous(), w, 1e-6, "cpp"))


def test_the_same_bits_on_one_and_two_threads(on_threads):
    """Rows split across threads in the forward and dx, columns in dw (each summed over the rows in order)."""
    x, weight, grad = _inputs((1000, 200))
    one, two = (on_threads(count, lambda: _forward_backward(x, weight, grad, "cpp")) for count in (1, 2))
    for a, b in zip(one, two, strict=True):
        assert torch.equal(a, b)


def test_without_autograd_the_kernel_gives_the_autograd_paths_output():
    x, weight, _ = _inputs((33, 64))
    with_graph = rms_norm(x, weight, 1e-5)
    assert with_graph.grad_fn is not None
    with torch.no_grad():
        plain = rms_norm(x, weight, 1e-5)
    assert plain.grad_fn is None and torch.equal(plain, with_graph.detach())


def test_auto_keeps_torch_where_the_kernel_does_not_apply():
    x, weight, _ = _inputs((5, 64))
    half = x.detach().bfloat16()
    assert torch.equal(
        rms_norm(half, weight.detach().bfloat16(), 1e-6),
        F.rms_norm(half, (64,), weight.detach().bfloat16(), 1e-6),
    )
    with pytest.raises(ValueError, match="takes float32 CPU tensors"):
        rms_norm(half, weight.detach().bfloat16(), 1e-6, "cpp")
    with pytest.raises(ValueError, match="impl must be"):
        rms_norm(x, weight, 1e-6, "fast")
