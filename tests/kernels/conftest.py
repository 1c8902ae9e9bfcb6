"""Kernel-test setup: no Triton interpreter under --device cuda; the tolerance table of every kernel test.

TRITON_INTERPRET must be set before triton and the ``alignflow.kernels._triton_*`` modules are imported
(``@triton.jit`` reads it when decorating), so tests/conftest.py's pytest_configure sets it under --device
cpu, before any test module is imported. Under --device cuda the kernels run compiled, as in the engine:
the interpreter stays off, and a TRITON_INTERPRET=1 left in the environment is an error rather than a
run that would check the interpreter instead of the compiled kernels.
"""

import os

import pytest


def pytest_configure(config):
    # config.option.device is resolved ("cpu" or "cuda") by tests/conftest.py's pytest_configure, which runs
    # first and, under cpu, sets TRITON_INTERPRET=1.
    if config.option.device == "cpu":
        return
    from alignflow.kernels._triton_dispatch import interpreter_requested

    if interpreter_requested():
        raise pytest.UsageError(
            f"--device cuda with TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}: the Triton kernels would "
            "run in the interpreter, not compiled; unset TRITON_INTERPRET for the CUDA run"
        )


# (atol, rtol) per comparison, set from measured maxima on the shapes in these tests (V up to 32_771,
# logits ~ N(0, 3^2), temperatures 1.0, 0.8 and 0.7), with 1.5-3x headroom.
TOLERANCES = {
    # fp32 log-probs and entropies: reference vs the plain fp32 log_softmax, and kernel vs reference.
    # Against float64 the fp32 oracle and the torch reference (the same fused log_softmax) are off by up
    # to 1.3e-5 (entropy, V = 32_771, T = 0.7), the Triton kernel by 5.6e-7.
    "value": (2e-5, 1e-6),
    # fp32 gradients: measured 3.3e-6 at most (kernel vs reference, V = 32_771, T = 0.7), mostly the
    # fp32 oracle/reference's own error. Entries on the picked index are O(1), so 1e-5 still catches
    # a wrong 1/T factor or a missing -p term (see the mutation notes in the report).
    "grad_fp32": (1e-5, 1e-5),
    # bf16 gradients: each side rounds an fp32 value to bf16 once, so against the fp32 oracle they are
    # half a bf16 ulp apart and against another bf16 result one ulp (2**-7 relative at worst).
    "grad_bf16": (1e-6, 2**-7),
    # Sampler log-probs (one logsumexp per row), kernel vs reference and vs log_softmax.
    "sample_logprob": (1e-5, 1e-6),
}


@pytest.fixture
def tol():
    """tol(name) -> dict(atol=..., rtol=...) for torch.testing.assert_close."""

    def get(name: str) -> dict:
        atol, rtol = TOLERANCES[name]
        return {"atol": atol, "rtol": rtol}

    return get


@pytest.fixture(autouse=True)
def _few_threads(one_torch_thread):
    yield


@pytest.fixture
def avx2_kernels():
    """The AVX2 extension (rms_norm, silu_mul, rope, logprobs_entropy), or a skip naming why it is
    unavailable. A fixture, not a skipif at import: a --device cuda run (which skips those modules) never
    builds the kernels."""
    from alignflow.kernels import _cpu_extension

    kernels = _cpu_extension.logprob_kernels()
    if kernels is None:
        why = _cpu_extension.logprob_kernels_unavailable_reason()
        pytest.skip(f"the AVX2 CPU kernels are unavailable here: {why}")
    return kernels


@pytest.fixture
def on_threads():
    """on_threads(count, fn): fn() with torch on `count` threads, the previous count restored after (the
    thread-invariance tests: overlap_critic trains on one thread what the in-line run trains on two)."""

    import torch  # here: pytest_configure above must run before triton can be imported

    def run(count: int, fn):
        before = torch.get_num_threads()
        torch.set_num_threads(count)
        try:
            return fn()
        finally:
            torch.set_num_threads(before)

    return run
