"""selective_log_softmax / entropy_from_logits / logprobs_and_entropy: torch reference vs a plain fp32
log_softmax oracle, and the Triton kernel (compiled under --device cuda, in Triton's CPU interpreter under
--device cpu) and the C++ CPU kernel vs the torch reference, on the device the tests run on."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from alignflow.kernels import entropy_from_logits, logprobs_and_entropy, selective_log_softmax
from alignflow.kernels import logprobs as logprobs_module
from alignflow.kernels._triton_dispatch import cpp_available, resolve_impl  # noqa: F401 - read by NEEDS_CPP

CPP_ONLY = pytest.mark.cpu_only("the C++ log-prob kernels take CPU tensors")
# A string condition: evaluated only for a test that runs, so a --device cuda run never builds the C++
# kernels.
NEEDS_CPP = pytest.mark.skipif("not cpp_available('selective_log_softmax')",
                               reason="the C++ log-prob kernels are unavailable here")


def needs_cpp(test):
    return CPP_ONLY(NEEDS_CPP(test))


CPP = pytest.param("cpp", marks=[CPP_ONLY, NEEDS_CPP])
ODD_SHAPES = [(6,), (3, 42), (2, 123, 431), (2, 32_771)]


def _inputs(shape, dtype, seed=0, scale=3.0, device="cpu"):
    """(logits, index, grad of log-probs, grad of entropy) on `device`, drawn on the CPU:
    the same values anywhere."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(shape, generator=gen) * scale).to(dtype)
    index = torch.randint(0, shape[-1], shape[:-1], generator=gen)
    grad_logp = torch.randn(shape[:-1], generator=gen)
    grad_ent = torch.randn(shape[:-1], generator=gen)
    return tuple(t.to(device) for t in (logits, index, grad_logp, grad_ent))


def _oracle(logits, index, temperature, grad_logp, grad_ent):
    """Plain fp32 log_softmax: values and fp32 gradients w.r.t. the (upcast) logits."""
    x = logits.detach().float().requires_grad_()
    log_p = torch.log_softmax(x / temperature, dim=-1)
    logp = log_p.gather(-1, index[..., None]).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    grad_x_logp = torch.autograd.grad((logp * grad_logp).sum(), x, retain_graph=True)[0]
    grad_x_ent = torch.autograd.grad((entropy * grad_ent).sum(), x, retain_graph=True)[0]
    grad_x_both = torch.autograd.grad((logp * grad_logp).sum() + (entropy * grad_ent).sum(), x)[0]
    return logp.detach(), entropy.detach(), grad_x_logp, grad_x_ent, grad_x_both


def _ours(logits, index, temperature, grad_logp, grad_ent, impl):
    """Values and gradients from all three public ops."""
    x = logits.detach().clone().requires_grad_()
    logp, entropy = logprobs_and_entropy(x, index, temperature, impl=impl)
    grad_both = torch.autograd.grad((logp * grad_logp).sum() + (entropy * grad_ent).sum(), x)[0]
    logp_only = selective_log_softmax(x, index, temperature, impl=impl)
    grad_logp_only = torch.autograd.grad((logp_only * grad_logp).sum(), x)[0]
    entropy_only = entropy_from_logits(x, temperature, impl=impl)
    grad_ent_only = torch.autograd.grad((entropy_only * grad_ent).sum(), x)[0]
    assert logp.dtype == entropy.dtype == torch.float32
    assert grad_both.dtype == logits.dtype and grad_both.shape == logits.shape
    torch.testing.assert_close(logp_only, logp, atol=0, rtol=0)
    torch.testing.assert_close(entropy_only, entropy, atol=0, rtol=0)
    return logp.detach(), entropy.detach(), grad_logp_only, grad_ent_only, grad_both


def _assert_grads(got, expected, dtype, tol):
    name = "grad_bf16" if dtype == torch.bfloat16 else "grad_fp32"
    torch.testing.assert_close(got.float(), expected.float(), **tol(name))


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_torch_reference_matches_fp32_log_softmax(shape, dtype, temperature, tol, device):
    logits, index, g_lp, g_ent = _inputs(shape, dtype, device=device)
    want = _oracle(logits, index, temperature, g_lp, g_ent)
    got = _ours(logits, index, temperature, g_lp, g_ent, impl="torch")
    torch.testing.assert_close(got[0], want[0], **tol("value"))
    torch.testing.assert_close(got[1], want[1], **tol("value"))
    for g, w in zip(got[2:], want[2:], strict=True):
        _assert_grads(g, w, dtype, tol)


@pytest.mark.parametrize("shape", [(6,), (3, 42), (2, 7, 431), (2, 32_771)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_triton_matches_torch_reference(shape, dtype, temperature, tol, device):
    logits, index, g_lp, g_ent = _inputs(shape, dtype, seed=1, device=device)
    ref = _ours(logits, index, temperature, g_lp, g_ent, impl="torch")
    got = _ours(logits, index, temperature, g_lp, g_ent, impl="triton")
    torch.testing.assert_close(got[0], ref[0], **tol("value"))
    torch.testing.assert_close(got[1], ref[1], **tol("value"))
    for g, r in zip(got[2:], ref[2:], strict=True):
        _assert_grads(g, r, dtype, tol)


@needs_cpp
@pytest.mark.parametrize("shape", [(6,), (3, 42), (2, 7, 431), (2, 32_771), (5, 2048)])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cpp_kernel_matches_torch_reference(shape, temperature, tol):
    # V = 6 and 42 end inside one 8-lane vector, 431 and 32_771 in a ragged tail, 2048 is the RL models'
    # vocabulary.
    logits, index, g_lp, g_ent = _inputs(shape, torch.float32, seed=7)
    ref = _ours(logits, index, temperature, g_lp, g_ent, impl="torch")
    got = _ours(logits, index, temperature, g_lp, g_ent, impl="cpp")
    torch.testing.assert_close(got[0], ref[0], **tol("value"))
    torch.testing.assert_close(got[1], ref[1], **tol("value"))
    for g, r in zip(got[2:], ref[2:], strict=True):
        _assert_grads(g, r, torch.float32, tol)


@needs_cpp
def test_cpp_kernel_gives_the_same_bits_on_one_and_two_threads(on_threads):
    # overlap_critic trains the actor on one thread and the in-line run on two: each row is one thread's,
    # reduced in one order, so the two runs must agree bit for bit.
    logits, index, g_lp, g_ent = _inputs((37, 2048), torch.float32, seed=8)
    results = [
        on_threads(count, lambda: _ours(logits, index, 1.0, g_lp, g_ent, impl="cpp")) for count in (1, 2)
    ]
    for one, two in zip(*results, strict=True):
        assert torch.equal(one, two)


@needs_cpp
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_cpp_logprobs_equal_the_avx2_samplers_bit_for_bit(temperature):
    # The engine's sampled log-prob and the training step's come from one log-sum-exp order, so the PPO
    # stage's engine-vs-actor check sees only the forwards' differences (rollout/logprob_engine_vs_actor_max).
    from alignflow.kernels import _cpu_extension, sample_tokens

    sampler = _cpu_extension.sampler()
    if sampler is None or sampler.isa != "AVX2":
        pytest.skip("the sampler here is not the AVX2 build")
    logits = _inputs((16, 2048), torch.float32, seed=9)[0]
    rows = torch.arange(16)
    sampled = sample_tokens(
        logits,
        torch.full((16,), temperature),
        torch.zeros(16, dtype=torch.long),
        torch.ones(16),
        rows,
        3,
        impl="cpp",
    )
    ours = selective_log_softmax(logits, sampled.tokens, temperature, impl="cpp")
    assert torch.equal(ours, sampled.logprobs)


@needs_cpp
def test_auto_takes_the_cpp_kernel_for_float32_rows_only():
    from alignflow.kernels import logprobs as module

    calls = []
    real = module._apply_cpp

    def spy(*args):
        calls.append(args[0].dtype)
        return real(*args)

    logits, index, _, _ = _inputs((4, 64), torch.float32, seed=10)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "_apply_cpp", spy)
        selective_log_softmax(logits, index)
        selective_log_softmax(logits.bfloat16(), index)  # bf16: the torch reference
        selective_log_softmax(logits[:, :-1], index % 63)  # not contiguous: the chunked reference, no copy
    assert calls == [torch.float32]
    with pytest.raises(ValueError, match="impl='cpp' takes float32 logits, got torch.bfloat16"):
        selective_log_softmax(logits.bfloat16(), index, impl="cpp")


@pytest.mark.parametrize("impl", ["torch", "triton", CPP])
def test_sliced_logits_need_no_copy_and_match(impl, tol, device):
    # The usual call: logits[:, :-1] (not viewable as [N, V]) against input_ids[:, 1:].
    logits, _, _, _ = _inputs((3, 9, 57), torch.float32, seed=2, device=device)
    ids = torch.randint(0, 57, (3, 9), generator=torch.Generator().manual_seed(3)).to(device)
    sliced, target = logits[:, :-1], ids[:, 1:]
    g_lp, g_ent = torch.randn(3, 8).to(device), torch.randn(3, 8).to(device)
    want = _oracle(sliced, target, 1.0, g_lp, g_ent)
    got = _ours(sliced, target, 1.0, g_lp, g_ent, impl=impl)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, **tol("value"))


def test_chunk_boundaries_do_not_change_results(monkeypatch, tol, device):
    # 3 rows per chunk over 2 * 11 = 22 rows: 7 full chunks and a remainder of 1.
    logits, index, g_lp, g_ent = _inputs((2, 11, 100), torch.float32, seed=4, device=device)
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 300)
    want = _oracle(logits, index, 1.3, g_lp, g_ent)
    got = _ours(logits, index, 1.3, g_lp, g_ent, impl="torch")
    torch.testing.assert_close(got[0], want[0], **tol("value"))
    torch.testing.assert_close(got[1], want[1], **tol("value"))
    for g, w in zip(got[2:], want[2:], strict=True):
        _assert_grads(g, w, torch.float32, tol)


@pytest.mark.parametrize("impl", ["torch", "triton", CPP])
def test_minus_inf_logits_give_finite_entropy_and_gradients(impl, tol, device):
    # Masked vocab entries (-inf) must count as probability 0, not turn entropy or gradients into NaN.
    logits, index, g_lp, g_ent = _inputs((4, 50), torch.float32, seed=5, device=device)
    logits[:, 30:] = float("-inf")
    index = index % 30
    x = logits.clone().requires_grad_()
    logp, entropy = logprobs_and_entropy(x, index, impl=impl)
    ((logp * g_lp).sum() + (entropy * g_ent).sum()).backward()
    want = _oracle(logits[:, :30], index, 1.0, g_lp, g_ent)
    torch.testing.assert_close(logp, want[0], **tol("value"))
    torch.testing.assert_close(entropy, want[1], **tol("value"))
    torch.testing.assert_close(x.grad[:, :30], want[4], **tol("grad_fp32"))
    assert torch.equal(x.grad[:, 30:], torch.zeros(4, 20, device=device))


class _LargestFloat32(TorchDispatchMode):
    """Records the largest fp32 tensor any op returns while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


def test_bf16_forward_and_backward_never_create_a_full_fp32_tensor(monkeypatch, device):
    # [4, 64, 1000] bf16 with 16k-element chunks: a plain log_softmax(x.float()) would create a
    # 256k-element fp32 tensor; ours may create [16, 1000] fp32 chunks at most.
    monkeypatch.setattr(logprobs_module, "_CHUNK_ELEMENTS", 16_000)
    logits, index, g_lp, g_ent = _inputs((4, 64, 1000), torch.bfloat16, seed=6, device=device)
    x = logits.clone().requires_grad_()
    with _LargestFloat32() as mode:
        logp, entropy = logprobs_and_entropy(x, index, 0.9, impl="torch")
        ((logp * g_lp).sum() + (entropy * g_ent).sum()).backward()
    assert x.grad.dtype == torch.bfloat16
    assert mode.largest <= 16_000, f"an op produced {mode.largest} fp32 elements; chunks hold 16_000"
    # The probe can fail: the naive path trips it.
    with _LargestFloat32() as naive:
        torch.log_softmax(x.float(), -1).gather(-1, index[..., None]).sum().backward()
    assert naive.largest == 4 * 64 * 1000


def test_auto_picks_torch_on_cpu_and_rejects_unknown_impl():
    assert resolve_impl("auto", torch.device("cpu"), "op") == "torch"
    logits, index, _, _ = _inputs((2, 5), torch.float32)
    with pytest.raises(ValueError, match=r"impl='cuda' is not one of \('auto', 'torch', 'cpp', 'triton'\)"):
        selective_log_softmax(logits, index, impl="cuda")


def test_forced_triton_on_cpu_without_interpreter_says_how_to_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    logits, index, _, _ = _inputs((2, 5), torch.float32)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        selective_log_softmax(logits, index, impl="triton")


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"temperature": 0.0}, ValueError, r"temperature=0.0 must be finite and > 0"),
        ({"temperature": -1.0}, ValueError, r"temperature=-1.0"),
        ({"temperature": float("inf")}, ValueError, r"temperature=inf"),
        ({"index": torch.tensor([[0, 1, 5], [0, 0, 0]])}, ValueError, r"outside \[0, 5\) \(e.g. 5\)"),
        ({"index": torch.tensor([[0, -1, 2], [0, 0, 0]])}, ValueError, r"outside \[0, 5\) \(e.g. -1\)"),
        (
            {"index": torch.zeros(2, 4, dtype=torch.long)},
            ValueError,
            r"index shape \(2, 4\) must equal .* \(2, 3\)",
        ),
        ({"index": torch.zeros(2, 3)}, TypeError, r"index must be an integer tensor.*float32"),
        ({"logits": torch.zeros(2, 3, 5, dtype=torch.long)}, TypeError, r"logits must be a floating-point"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    args = {"logits": torch.randn(2, 3, 5), "index": torch.zeros(2, 3, dtype=torch.long), "temperature": 1.0}
    args.update(kwargs)
    with pytest.raises(error, match=message):
        selective_log_softmax(**args)


@needs_cpp
def test_cpp_node_with_one_output_unused_gives_that_outputs_gradient_alone():
    # The C++ autograd node leaves an unused output's gradient undefined: the backward then skips its term.
    logits, index, g_lp, g_ent = _inputs((5, 70), torch.float32, seed=11)
    for used in ("logp", "entropy"):
        got_x = logits.detach().clone().requires_grad_()
        logp, entropy = logprobs_and_entropy(got_x, index, 1.5, impl="cpp")
        ((logp * g_lp).sum() if used == "logp" else (entropy * g_ent).sum()).backward()
        want_x = logits.detach().clone().requires_grad_()
        want_logp, want_entropy = logprobs_and_entropy(want_x, index, 1.5, impl="torch")
        ((want_logp * g_lp).sum() if used == "logp" else (want_entropy * g_ent).sum()).backward()
        torch.testing.assert_close(got_x.grad, want_x.grad, rtol=1e-5, atol=1e-6)
