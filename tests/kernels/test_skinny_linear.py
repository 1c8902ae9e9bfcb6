"""skinny_linear (its AVX-512 or AVX2 build) against F.linear and float64 on odd shapes; layout, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from alignflow.kernels import skinny_linear as skinny

pytestmark = pytest.mark.cpu_only("skinny_linear is a C++ CPU kernel")


@pytest.fixture
def kernel_builds_here():
    # A fixture, not a skipif at import: a --device cuda run (which skips this module) never builds the
    # kernels.
    if not skinny.available():
        pytest.skip(f"skinny_linear: {skinny.unavailable_reason()}")


needs_kernel = pytest.mark.usefixtures("kernel_builds_here")


def test_block_weight_layout_is_16_column_blocks_zero_padded():
    weight = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    blocked = skinny.block_weight(weight)
    assert blocked.shape == (2, 3, 16)
    for n in range(20):
        for k in range(3):
            assert blocked[n // 16, k, n % 16] == weight[n, k]
    assert (blocked[1, :, 4:] == 0).all()
    with pytest.raises(ValueError, match="float32 \\[N, K\\]"):
        skinny.block_weight(weight.double())
    # Into a given tensor (a refit's repack): every element written, the padding zeroed, whatever was there.
    for rows in (20, 32, 5):
        w = torch.randn(rows, 3)
        out = torch.full((-(-rows // 16), 3, 16), float("nan"))
        assert skinny.block_weight(w, out) is out and torch.equal(out, skinny.block_weight(w))
    with pytest.raises(ValueError, match="out must be a contiguous float32 \\(2, 3, 16\\) tensor"):
        skinny.block_weight(weight, torch.empty(1, 3, 16))


# Rows: 1, every tail of the AVX-512 build's 8-row tile and of the AVX2 build's 6-row one, several tiles and
# the largest decode batch; columns: one partial block, exact blocks, tiles of 1, 2 and 3 blocks with a
# partial last one, a vocabulary; K: 1, odd, real.
@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 5, 6, 7, 8, 9, 12, 17, 64, 130])
@pytest.mark.parametrize(
    "out_features, in_features", [(5, 1), (16, 7), (33, 768), (50, 31), (2304, 768), (32_001, 64)]
)
def test_matches_f_linear_and_float64(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 7919 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    got = skinny.skinny_linear(x, skinny.block_weight(weight), out_features)
    exact = x.double() @ weight.double().T
    mkl = skinny.reference(x, weight)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    # A float32 sum over K: error grows like sqrt(K) ulps of the terms' magnitude. Both kernels are held
    # to the same float64 yardstick; measured, both reach at most 0.52 of sqrt(K) * eps * (|x| @ |W|.T).
    bound = (
        4 * in_features**0.5 * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)
    )
    assert ((got.double() - exact).abs() <= bound + 1e-30).all()
    assert ((mkl.double() - exact).abs() <= bound + 1e-30).all()


def _builds_here():
    """(name, module) of each build that runs on this CPU: the AVX-512 one where it does, and the AVX2 one."""
    from alignflow.kernels import _cpu_extension

    builds = [("avx512", _cpu_extension.extension()), ("avx2", _cpu_extension.logprob_kernels())]
    return [(name, module) for name, module in builds if module is not None]


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 8, 9, 17, 130])
@pytest.mark.parametrize("out_features, in_features", [(5, 1), (50, 31), (2304, 768), (3000, 64)])
def test_bfloat16_blocks_compute_the_float32_kernel_on_the_rounded_weight_bit_for_bit(
    rows, out_features, in_features
):
    gen = torch.Generator().manual_seed(rows * 31 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    half = skinny.block_weight(weight, dtype=torch.bfloat16)
    rounded = skinny.block_weight(weight.bfloat16().float())
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), rounded)
    for name, module in _builds_here():
        got = module.skinny_linear(x, half, out_features)
        assert torch.equal(got, module.skinny_linear(x, rounded, out_features)), name
        # ...which is F.linear on the rounded weight up to summation order, and not the unrounded product.
        torch.testing.assert_close(got, skinny.reference(x, weight, torch.bfloat16), rtol=1e-5, atol=1e-5)
        if in_features > 1:
            assert not torch.allclose(got, F.linear(x, weight), rtol=1e-6, atol=1e-6), name


def test_block_weight_in_bfloat16_rounds_and_checks_its_out():
    weight = torch.randn(20, 3)
    half = skinny.block_weight(weight, dtype=torch.bfloat16)
    rounded = skinny.block_weight(weight.bfloat16().float())
    assert half.dtype == torch.bfloat16 and torch.equal(half.float(), rounded)
    out = torch.full((2, 3, 16), float("nan"), dtype=torch.bfloat16)
    assert skinny.block_weight(weight, out, torch.bfloat16) is out and torch.equal(out, half)
    with pytest.raises(ValueError, match="out must be a contiguous bfloat16 \\(2, 3, 16\\)"):
        skinny.block_weight(weight, torch.empty(2, 3, 16), torch.bfloat16)
    with pytest.raises(ValueError, match="float32 or bfloat16, not float16"):
        skinny.block_weight(weight, dtype=torch.float16)


@needs_kernel
def test_leading_dims_and_a_non_contiguous_input():
    x = torch.randn(4, 3, 40)[:, :, ::2]  # [4, 3, 20], not contiguous
    weight = torch.randn(24, 20)
    got = skinny.skinny_linear(x, skinny.block_weight(weight), 24)
    assert got.shape == (4, 3, 24)
    torch.testing.assert_close(got, F.linear(x, weight), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_bad_inputs_name_what_is_wrong():
    weight = torch.randn(32, 8)
    blocked = skinny.block_weight(weight)
    with pytest.raises(RuntimeError, match="contiguous float32 CPU matrix"):
        skinny.skinny_linear(torch.randn(2, 8, dtype=torch.float64), blocked, 32)
    with pytest.raises(RuntimeError, match="blocked as \\[ceil\\(N/16\\), K, 16\\]"):
        skinny.skinny_linear(torch.randn(2, 9), blocked, 32)
    with pytest.raises(RuntimeError, match="out_features 40 does not fit 2 blocks"):
        skinny.skinny_linear(torch.randn(2, 8), blocked, 40)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 with K = 8"):
        skinny.skinny_linear(torch.randn(2, 8), blocked.half(), 32)


@needs_kernel
def test_the_build_that_runs_is_the_cpus_and_sets_the_row_limit():
    from alignflow.kernels import _cpu_extension

    module = _cpu_extension.linear_kernels()
    if torch.cpu._is_avx512_supported():
        assert module is _cpu_extension.extension() and (skinny.isa(), skinny.max_rows()) == ("AVX-512", 128)
    else:
        assert module.__name__ == _cpu_extension.AVX2_NAME and (skinny.isa(), skinny.max_rows()) == (
            "AVX2",
            256,
        )


@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
def test_a_failed_build_warns_once_and_callers_keep_their_torch_paths(monkeypatch, avx512):
    import torch.utils.cpp_extension

    from alignflow.kernels import _cpu_extension
    from alignflow.kernels import decode_attention as da
    from alignflow.stages.common.generation.native import prepack

    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: True)
    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    _cpu_extension.reset()
    try:
        with pytest.warns(RuntimeWarning, match=r"fall back to torch.*Install g\+\+ and ninja"):
            assert not skinny.available()
        assert not da.available() and not da.supports(torch.device("cpu"), torch.float32, 64)
        source = "skinny_linear.cpp" if avx512 else "skinny_linear_avx2.cpp"
        reason = skinny.unavailable_reason()
        assert reason.startswith("building ") and source in reason.split(" failed: ")[0]
        assert "failed: RuntimeError: error: command 'c++' failed" in reason
        assert skinny.isa() is None
        with pytest.raises(RuntimeError, match="skinny_linear is not available: building .* use F.linear"):
            skinny.skinny_linear(torch.randn(2, 8), torch.zeros(2, 8, 16), 32)
        if torch.backends.mkldnn.is_available():
            assert prepack.layout_for(torch.device("cpu"), torch.float32) == "onednn"
    finally:
        _cpu_extension.reset()  # the next caller loads the cached build again
