"""sample_tokens: greedy, full-vocabulary log-probs, kept sets against a plain sort-based oracle, sample
frequencies, batch-independence of seeds, and exact Triton vs torch agreement, on the device the tests run on
(Triton compiled under --device cuda, in its CPU interpreter under --device cpu). The C++ and chunked samplers
are the CPU's: their tests are cpu_only."""

import math

import pytest
import torch

from alignflow.kernels import SampleOutput, rng, sample_tokens, sampling
from alignflow.kernels._triton_dispatch import cpp_available

CPP_ONLY = pytest.mark.cpu_only("the C++ sampler takes CPU tensors")
# Skipped where the extension does not build (no AVX2, no compiler). A string condition: evaluated only for a
# test that runs, so a --device cuda run never builds the C++ kernels.
NEEDS_CPP = pytest.mark.skipif("not cpp_available()", reason="C++ CPU kernels unavailable")
CPP = pytest.param("cpp", marks=[CPP_ONLY, NEEDS_CPP])
CHUNKED_ONLY = pytest.mark.cpu_only("the chunked sampler is the eager CPU path")
CHUNKED = pytest.param("chunked", marks=CHUNKED_ONLY)


def needs_cpp(test):
    return CPP_ONLY(NEEDS_CPP(test))


def _logits(batch, vocab, seed=0, scale=2.0, dtype=torch.float32, device="cpu"):
    """[batch, vocab] logits on `device`, drawn on the CPU: the same values on every device."""
    return (
        (torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * scale)
        .to(dtype)
        .to(device)
    )


def _oracle_kept(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """Kept set by the definition, one row, plain Python over a float64 sort.

    top-k: values >= the k-th largest; top-p: over the renormalised top-k survivors, the highest
    values until their mass reaches top_p, plus everything tied with the last one.
    """
    values = row.double().tolist()
    order = sorted(range(len(values)), key=lambda j: -values[j])
    keep = (
        order
        if not (0 < top_k < len(values))
        else [j for j in order if values[j] >= values[order[top_k - 1]]]
    )
    if top_p < 1.0:
        zmax = values[keep[0]] / temperature
        mass = [math.exp(values[j] / temperature - zmax) for j in keep]
        target, running, cut = top_p * sum(mass), 0.0, len(keep) - 1
        for i, m in enumerate(mass):
            running += m
            if running >= target:
                cut = i
                break
        keep = [j for j in keep if values[j] >= values[keep[cut]]]
    return set(keep)


def _kept_from_tau(logits: torch.Tensor, tau: torch.Tensor) -> list[set[int]]:
    keys = sampling.ordered_keys(logits.float())
    return [set((keys[b] >= tau[b]).nonzero().flatten().tolist()) for b in range(logits.shape[0])]


def _rows(logits, temperature, top_k, top_p, seeds, step):
    return sampling.sampling_rows("test", logits, temperature, top_k, top_p, seeds, step)


# ----------------------------------------------------------------------------------------------
# The counter-based hash


def test_mul32_matches_python_integers_at_the_extremes(device):
    xs = [0, 1, 2**16 - 1, 2**31, 2**32 - 1, 0x12345678, 0xDEADBEEF]
    for c in (rng.FMIX_M1, rng.FMIX_M2, rng.GOLDEN, 0xFFFFFFFF):
        got = rng._mul32(torch.tensor(xs, dtype=torch.int64, device=device), c).tolist()
        assert got == [(x * c) % 2**32 for x in xs]


def test_fmix32_matches_a_python_murmur3_finaliser(device):
    def fmix(h):
        h ^= h >> 16
        h = (h * 0x85EBCA6B) & 0xFFFFFFFF
        h ^= h >> 13
        h = (h * 0xC2B2AE35) & 0xFFFFFFFF
        return h ^ (h >> 16)

    xs = [0, 1, 7, 2**31 - 1, 2**31, 2**32 - 1, 0xCAFEBABE]
    assert rng.fmix32(torch.tensor(xs, dtype=torch.int64, device=device)).tolist() == [fmix(x) for x in xs]


def test_triton_hash_reproduces_torch_hash_bit_for_bit(device):
    from alignflow.kernels import _triton_sampling

    constants = ("FMIX_M1", "FMIX_M2", "GOLDEN", "SEED_SALT", "STEP_SALT")
    assert [getattr(_triton_sampling, "_" + c).value for c in constants] == [
        getattr(rng, c) for c in constants
    ]
    seeds = torch.tensor([0, 1, -1, 2**40 + 3, -(2**62), 12345], device=device)
    steps = torch.tensor([0, 1, 2**32 + 5, 7, 0, 2**20], device=device)
    k1, k2 = rng.row_keys(seeds, steps)
    assert int(k1.min()) >= 0 and int(k1.max()) < 2**32 and int(k2.max()) < 2**32
    vocab = 5003
    want = rng.uniforms_from_hash(rng.token_hash(k1, k2, vocab))
    got = _triton_sampling.uniforms(seeds, steps, vocab)  # keys derived in-kernel
    assert torch.equal(got, want)


def test_uniforms_are_uniform_and_distinct_within_a_row(device):
    k1, k2 = rng.row_keys(torch.arange(4, device=device), torch.zeros(4, dtype=torch.long, device=device))
    u = rng.uniforms_from_hash(rng.token_hash(k1, k2, 100_000))
    assert float(u.min()) >= 2**-24 and float(u.max()) <= 1 - 2**-24
    # 100k uniforms per row: mean within 5 sigma (sigma = 0.29 / sqrt(1e5) = 9e-4), deciles near 0.1.
    assert torch.allclose(u.mean(1), torch.full((4,), 0.5, device=device), atol=5 * 9.1e-4)
    deciles = torch.stack([torch.histc(r, bins=10, min=0, max=1) for r in u]) / 100_000
    assert float((deciles - 0.1).abs().max()) < 5 * math.sqrt(0.1 * 0.9 / 100_000)
    # The hash is a bijection of the vocab index for a fixed row: 23-bit uniforms collide only by chance.
    assert all(len(set(r.tolist())) > 99_000 for r in u)
    # Rows with neighbouring seeds are uncorrelated.
    assert abs(float(torch.corrcoef(u)[0, 1])) < 0.02


# ----------------------------------------------------------------------------------------------
# Behaviour of the torch reference (and the kernel where cheap)


@pytest.mark.parametrize("impl", ["torch", "triton", CPP])
def test_greedy_rows_take_the_argmax_with_temperature_one_logprob(impl, tol, device):
    logits = _logits(5, 300, seed=1, device=device)
    out = sample_tokens(logits, 0.0, 7, 0.5, torch.arange(5), 3, impl=impl)
    assert isinstance(out, SampleOutput)
    assert torch.equal(out.tokens, logits.argmax(1))
    want = torch.log_softmax(logits, 1).gather(1, out.tokens[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, want, **tol("sample_logprob"))


@pytest.mark.parametrize("impl", ["torch", "triton", CPP])
def test_ties_go_to_the_lowest_index_even_across_vocab_blocks(impl, device):
    # 9000 is in a later Triton block (4096 wide in the interpreter, 1024 on GPU) than 100.
    logits = torch.zeros(2, 10_000, device=device)
    logits[:, 100] = logits[:, 9000] = 5.0
    out = sample_tokens(logits, 0.0, 0, 1.0, torch.arange(2), 0, impl=impl)
    assert out.tokens.tolist() == [100, 100]


@pytest.mark.parametrize("impl", ["torch", "triton", CPP])
def test_logprobs_are_over_the_full_vocabulary_not_the_kept_set(impl, tol, device):
    logits = _logits(4, 500, seed=2, device=device)
    temperature = torch.tensor([1.0, 0.6, 1.4, 0.9], device=device)
    out = sample_tokens(
        logits,
        temperature,
        torch.tensor([0, 5, 0, 40]),
        torch.tensor([0.7, 1.0, 0.5, 0.9]),
        torch.arange(4),
        0,
        impl=impl,
    )
    want = torch.log_softmax(logits / temperature[:, None], 1).gather(1, out.tokens[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, want, **tol("sample_logprob"))


def test_top_k_one_is_greedy_and_top_k_at_least_vocab_is_off(device):
    logits = _logits(6, 64, seed=3, device=device)
    seeds = torch.arange(6) * 11
    assert torch.equal(sample_tokens(logits, 1.0, 1, 1.0, seeds, 0, impl="torch").tokens, logits.argmax(1))
    off = sample_tokens(logits, 1.0, 0, 1.0, seeds, 0, impl="torch").tokens
    assert torch.equal(sample_tokens(logits, 1.0, 64, 1.0, seeds, 0, impl="torch").tokens, off)
    assert torch.equal(sample_tokens(logits, 1.0, 10_000, 1.0, seeds, 0, impl="torch").tokens, off)


@pytest.mark.parametrize("top_p_on", [True, False], ids=["top_k_and_top_p_sort", "top_k_only_topk"])
@pytest.mark.parametrize("rounding", [None, 1])
def test_kept_set_matches_the_sort_oracle_including_ties(rounding, top_p_on, device):
    # rounding=1 rounds logits to one decimal, so many tokens tie at the top-k / top-p boundary.
    # Without top-p, kept_thresholds takes torch.topk instead of the sort: same thresholds expected.
    logits = _logits(24, 200, seed=4, device=device)
    if rounding is not None:
        logits = torch.round(logits, decimals=rounding)
    gen = torch.Generator().manual_seed(5)
    temperature = torch.rand(24, generator=gen) * 1.5 + 0.2
    top_k = torch.randint(0, 60, (24,), generator=gen)
    top_p = torch.where(
        torch.rand(24, generator=gen) < 0.3, torch.ones(24), torch.rand(24, generator=gen) * 0.95 + 0.02
    )
    if not top_p_on:
        top_p = torch.ones(24)
    inv_t, _, k, p = sampling.normalised_rows(_rows(logits, temperature, top_k, top_p, 0, 0), 200)
    x = logits.float()
    tau = sampling.kept_thresholds(sampling.ordered_keys(x), x * inv_t[:, None], k, p)
    kept = _kept_from_tau(logits, tau)
    for b in range(24):
        assert kept[b] == _oracle_kept(logits[b], float(temperature[b]), int(top_k[b]), float(top_p[b])), (
            f"row {b}"
        )


def _threshold_inputs(logits, top_k, top_p, temperature=0.8):
    rows = _rows(logits, temperature, top_k, top_p, 0, 0)
    inv_t, _, k, p = sampling.normalised_rows(rows, logits.shape[1])
    x = logits.float()
    return sampling.ordered_keys32(x), x * inv_t[:, None], k, p


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [8.0, 3.0, 0.3], ids=["peaked", "spread", "flat"])
def test_prefix_thresholds_equal_the_full_sort_bit_for_bit(dtype, scale, device):
    # bf16 logits tie often (8-bit mantissa): ties at the k-th key and at the top-p cut are common.
    # "peaked" rows are decided by the 256-key prefix, "spread" ones partly by the 2048-key one,
    # "flat" ones (nucleus beyond 2048 keys) by the final sort of the rows still undecided.
    batch, vocab = 32, 5000
    logits = _logits(batch, vocab, seed=6, scale=scale, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(7)
    top_k = torch.where(
        torch.rand(batch, generator=gen) < 0.5, torch.randint(1, 300, (batch,), generator=gen), 0
    )
    top_p = torch.rand(batch, generator=gen) * 0.98 + 0.01
    top_k[:4], top_p[:4] = torch.tensor([1, 2, 0, 0]), torch.tensor([0.5, 1.0, 1.0, 0.999])
    args = _threshold_inputs(logits, top_k, top_p)
    want = sampling.kept_thresholds(*args, method="sort")
    assert torch.equal(sampling.kept_thresholds(*args), want)
    assert torch.equal(sampling.kept_thresholds(args[0].to(torch.int64), *args[1:]), want)  # int64 keys too


def test_top_p_cut_falls_through_the_prefixes_to_the_sort_per_row(device):
    # A nucleus of ~all 3000 tokens (flat row, top_p 0.99) is decided by no prefix; a peaked row by
    # the first. Each must still equal the sort, and the flat one keep > 2048 tokens.
    logits = torch.cat([_logits(1, 3000, seed=8, scale=0.01), _logits(1, 3000, seed=9, scale=8.0)]).to(device)
    args = _threshold_inputs(logits, torch.tensor([0, 0]), torch.tensor([0.99, 0.9]))
    tau = sampling.kept_thresholds(*args)
    assert torch.equal(tau, sampling.kept_thresholds(*args, method="sort"))
    flat, peaked = (len(s) for s in _kept_from_tau(logits, tau))
    assert flat > 2048 and peaked < 256
    # 200 tokens tied at the top with top_k 5: all are kept, by either method.
    tied = _logits(2, 3000, seed=10, device=device)
    tied[:, :200] = 9.0
    args = _threshold_inputs(tied, torch.tensor([5, 5]), torch.tensor([0.9, 0.99]))
    tau = sampling.kept_thresholds(*args)
    assert torch.equal(tau, sampling.kept_thresholds(*args, method="sort"))
    assert [len(s) for s in _kept_from_tau(tied, tau)] == [200, 200]


def test_top_p_rows_take_the_prefix_their_masses_allow(monkeypatch, device):
    """Which prefixes a row tries follows from bounds on its masses; every route ends at the sort's cut."""
    vocab = 5000
    logits = torch.full((4, vocab), -20.0, device=device)
    logits[:, 0] = 0.0
    logits[0, 1:1000] = math.log(0.5)  # total ~500 top masses, target 450: beyond 256 keys, within 2048
    logits[1, 1:2500] = math.log(0.5)  # target ~1188: the 256 prefix shows 2048 cannot reach it -> sort
    logits[2, 1:4999] = math.log(0.9)  # target ~4050 > 2048 top masses: straight to the sort
    logits[3, 1:50] = math.log(0.5)  # decided by the first prefix
    widths = []
    real = sampling._sorted_prefix
    monkeypatch.setattr(
        sampling, "_sorted_prefix", lambda k, m, w: widths.append((k.shape[0], w)) or real(k, m, w)
    )
    args = _threshold_inputs(
        logits, torch.zeros(4, dtype=torch.long), torch.tensor([0.9, 0.95, 0.9, 0.9]), 1.0
    )
    tau = sampling.kept_thresholds(*args)
    assert widths == [(3, 256), (1, 2048), (2, vocab)]  # rows {0, 1, 3}, then row 0, then rows {2, 1}
    assert torch.equal(tau, sampling.kept_thresholds(*args, method="sort"))


def test_top_p_masses_are_exact_fixed_point_sums():
    # The whole point of fixed point: a row's total and running sums do not depend on the order of
    # summation, so a prefix, a sort and a plain sum agree. 2**mass_bits(V) * V stays below 2**52.
    for vocab in (1, 2, 1000, 32000, 128256, 256000):
        assert (2 ** sampling.mass_bits(vocab)) * vocab <= 2**52, vocab
    assert sampling.mass_bits(32000) == 37
    with pytest.raises(ValueError, match="method must be 'auto' or 'sort'"):
        sampling.kept_thresholds(*_threshold_inputs(_logits(1, 10), 0, 0.5), method="topk")


@pytest.mark.parametrize("impl", ["torch", CHUNKED])
@pytest.mark.parametrize("top_k, top_p", [(40, 1.0), (40, 0.8), (0, 0.8)])
def test_precomputed_thresholds_give_the_same_samples(top_k, top_p, impl, device):
    logits = _logits(6, 2000, seed=9, scale=3.0, device=device)
    seeds = torch.arange(6, device=device) * 5
    flags = sampling.uniform_flags(0.9, top_k, top_p, 2000)
    tau = sampling.kept_set_thresholds(logits, 0.9, top_k, top_p, flags)
    want = sample_tokens(logits, 0.9, top_k, top_p, seeds, 3, impl=impl)
    got = sample_tokens(logits, 0.9, top_k, top_p, seeds, 3, impl=impl, flags=flags, thresholds=tau)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs)
    with pytest.raises(ValueError, match="thresholds= is for the torch and chunked impls"):
        sample_tokens(logits, 0.9, top_k, top_p, seeds, 3, impl="triton", thresholds=tau)


def test_row_keys_per_step_equal_row_keys_at_each_step(device):
    # negative and > 32-bit seeds too
    seeds = torch.tensor([0, 1, -1, 2**40 + 7, -(2**62), 12345], device=device)
    k1, k2 = rng.row_keys_per_step(seeds, 70)
    assert k2.shape == (6, 70)
    for t in (0, 1, 33, 69):
        want1, want2 = rng.row_keys(seeds, torch.full((6,), t, device=device))
        assert torch.equal(k1, want1) and torch.equal(k2[:, t], want2), t


@pytest.mark.parametrize("impl", ["torch", CHUNKED])
@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_precomputed_row_keys_give_the_same_samples(top_p, impl, device):
    logits = _logits(5, 3000, seed=4, scale=2.0, device=device)
    seeds = torch.arange(5, device=device) * 11 + 3
    k1, k2 = rng.row_keys_per_step(seeds, 8)
    for step in (0, 7):
        want = sample_tokens(logits, 0.8, 0, top_p, seeds, step, impl=impl)
        got = sample_tokens(logits, 0.8, 0, top_p, seeds, step, impl=impl, row_keys=(k1, k2[:, step]))
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs), step
    # The keys decide the draw: another step's keys give other tokens (the check is not vacuous).
    other = sample_tokens(logits, 0.8, 0, top_p, seeds, 0, impl=impl, row_keys=(k1, k2[:, 5]))
    assert not torch.equal(other.tokens, sample_tokens(logits, 0.8, 0, top_p, seeds, 0, impl=impl).tokens)
    with pytest.raises(
        ValueError, match="row_keys= is for the torch and chunked impls; triton hashes in-kernel"
    ):
        sample_tokens(logits, 0.8, 0, 1.0, seeds, 0, impl="triton", row_keys=(k1, k2[:, 0]))
    with pytest.raises(ValueError, match=r"row_keys must be two int64 \[5\] tensors"):
        sample_tokens(logits, 0.8, 0, 1.0, seeds, 0, impl="chunked", row_keys=(k1, k2))


def test_samples_never_leave_the_kept_set(device):
    # 3000 draws of one row: any token outside the 12 kept ones would show up.
    logits = _logits(1, 80, seed=6, device=device).expand(3000, 80)
    out = sample_tokens(logits, 0.9, 20, 0.8, torch.arange(3000, device=device), 0, impl="torch")
    allowed = _oracle_kept(logits[0], 0.9, 20, 0.8)
    assert set(out.tokens.tolist()) <= allowed
    assert len(set(out.tokens.tolist())) == len(allowed)  # and every kept token does occur


def _chi_square_bound(dof: int) -> float:
    """Chi-square quantile at 1 - 1e-4 (Wilson-Hilferty): a correct sampler fails 1 run in 10_000."""
    z = 3.719
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def _filtered_probs(row, temperature, top_k, top_p):
    kept = sorted(_oracle_kept(row, temperature, top_k, top_p))
    probs = torch.softmax(row.double()[kept] / temperature, 0)
    return kept, probs


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.7, 12, 1.0), (1.3, 0, 0.85), (0.8, 25, 0.9)]
)
def test_sample_frequencies_match_the_filtered_distribution_across_seeds(temperature, top_k, top_p, device):
    n = 20_000
    row = _logits(1, 40, seed=7, scale=1.0)[0]
    out = sample_tokens(
        row.to(device).expand(n, 40),
        temperature,
        top_k,
        top_p,
        torch.arange(n, device=device) + 1000,
        5,
        impl="torch",
    )
    kept, probs = _filtered_probs(row, temperature, top_k, top_p)
    counts = torch.bincount(out.tokens.cpu(), minlength=40).double()
    assert float(counts.sum() - counts[kept].sum()) == 0.0
    expected = probs * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < _chi_square_bound(len(kept) - 1), f"chi2={chi2:.1f} over {len(kept) - 1} dof"


def test_sample_frequencies_match_across_steps_of_one_seed(device):
    # One request decoding 20k steps on the same logits: the step counter alone must give fresh draws.
    n = 20_000
    row = _logits(1, 30, seed=8, scale=1.0)[0]
    out = sample_tokens(
        row.to(device).expand(n, 30), 1.1, 0, 0.95, 42, torch.arange(n, device=device), impl="torch"
    )
    kept, probs = _filtered_probs(row, 1.1, 0, 0.95)
    counts = torch.bincount(out.tokens.cpu(), minlength=30).double()[kept]
    chi2 = float(((counts - probs * n) ** 2 / (probs * n)).sum())
    assert chi2 < _chi_square_bound(len(kept) - 1), f"chi2={chi2:.1f} over {len(kept) - 1} dof"


def test_chi_square_check_rejects_a_wrong_temperature(device):
    # The frequency check above can fail: samples at T = 1.0 judged against T = 0.7 do.
    n = 20_000
    row = _logits(1, 40, seed=7, scale=1.0)[0]
    out = sample_tokens(
        row.to(device).expand(n, 40), 1.0, 0, 1.0, torch.arange(n, device=device), 0, impl="torch"
    )
    kept, probs = _filtered_probs(row, 0.7, 0, 1.0)
    counts = torch.bincount(out.tokens.cpu(), minlength=40).double()[kept]
    chi2 = float(((counts - probs * n) ** 2 / (probs * n)).sum())
    assert chi2 > _chi_square_bound(len(kept) - 1)


@pytest.mark.parametrize("impl", ["torch", CHUNKED, "triton", CPP])
def test_same_seed_gives_same_token_in_any_batch_position_or_company(impl, device):
    logits = _logits(6, 257, seed=9, device=device)
    temperature = torch.tensor([1.0, 0.8, 1.2, 0.5, 1.0, 0.9], device=device)
    top_k = torch.tensor([0, 30, 0, 5, 100, 0], device=device)
    top_p = torch.tensor([1.0, 0.9, 0.7, 1.0, 0.95, 1.0], device=device)
    seeds = torch.tensor([3, 1, 4, 1, 5, 9], device=device)
    step = torch.tensor([0, 5, 2, 5, 8, 13], device=device)
    full = sample_tokens(logits, temperature, top_k, top_p, seeds, step, impl=impl)
    perm = torch.tensor([4, 2, 0, 5, 1, 3], device=device)
    permuted = sample_tokens(
        logits[perm], temperature[perm], top_k[perm], top_p[perm], seeds[perm], step[perm], impl=impl
    )
    assert torch.equal(permuted.tokens, full.tokens[perm])
    alone = sample_tokens(
        logits[2:3], temperature[2:3], top_k[2:3], top_p[2:3], seeds[2:3], step[2:3], impl=impl
    )
    assert int(alone.tokens[0]) == int(full.tokens[2])


def test_different_seeds_and_steps_give_different_draws(device):
    logits = torch.zeros(200, 1000, device=device)  # uniform: any two draws collide with probability 1/1000
    by_seed = sample_tokens(logits, 1.0, 0, 1.0, torch.arange(200, device=device), 0, impl="torch").tokens
    by_step = sample_tokens(logits, 1.0, 0, 1.0, 7, torch.arange(200, device=device), impl="torch").tokens
    assert len(set(by_seed.tolist())) > 150 and len(set(by_step.tolist())) > 150


# ----------------------------------------------------------------------------------------------
# Chunked CPU path vs torch reference: equal, not close


@CHUNKED_ONLY
@pytest.mark.parametrize(
    ("batch", "vocab", "dtype"),
    [
        (1, 50, torch.float32),
        (7, 1000, torch.bfloat16),
        (3, 32_771, torch.float32),  # several chunks with a ragged last one
        (70, 5003, torch.float32),  # chunk narrower than the vocab at this batch size
        (9, 32_000, torch.bfloat16),
    ],
)
def test_chunked_sampler_equals_the_reference_bit_for_bit(batch, vocab, dtype):
    from alignflow.kernels import _chunked_sampling

    gen = torch.Generator().manual_seed(batch * vocab)
    logits = _logits(batch, vocab, seed=vocab + 1, scale=2.5, dtype=dtype)
    mixed = _mixed_rows(batch, gen)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    plain = (torch.ones(batch), torch.zeros(batch, dtype=torch.long), torch.ones(batch))
    greedy = (torch.zeros(batch), torch.zeros(batch, dtype=torch.long), torch.ones(batch))
    top_k_only = (mixed[0], mixed[1], torch.ones(batch))
    for temperature, top_k, top_p in (mixed, plain, greedy, top_k_only):
        for step in (0, 3, 2**40):
            rows = _rows(logits, temperature, top_k, top_p, seeds, step)
            ref = sampling.sample_torch(logits, rows)
            flags = sampling.batch_flags(rows, vocab)
            got = _chunked_sampling.sample(logits, rows, flags)
            for name, a, b in zip(("tokens", "logprobs", "thresholds"), got, ref, strict=True):
                assert torch.equal(a, b), f"{name} differ at step {step}"
            # The engine's call: no thresholds asked (with no greedy row and no cut, only 1/T and no order
            # keys), with the noise hashed per chunk or given for the whole row.
            noise = rng.gumbel_noise(*rng.row_keys(rows.seeds, rows.steps), vocab)
            for given in (None, noise):
                lean = _chunked_sampling.sample(logits, rows._replace(noise=given), flags, want_tau=False)
                assert torch.equal(lean[0], ref[0]) and torch.equal(lean[1], ref[1]), (
                    f"step {step}, noise {given is not None}"
                )
                assert (lean[2] is None) == (not flags.any_top_k and not flags.any_top_p)


@CHUNKED_ONLY
def test_chunked_sampler_ties_go_to_the_lowest_index_across_chunks():
    from alignflow.kernels import _chunked_sampling

    # Greedy over a row whose maximum appears in the first and the last chunk.
    logits = torch.zeros(2, 40_000)
    logits[:, [5, 39_999]] = 3.0
    rows = _rows(logits, 0.0, 0, 1.0, torch.arange(2), 0)
    tokens, _, _ = _chunked_sampling.sample(logits, rows, sampling.batch_flags(rows, 40_000))
    assert tokens.tolist() == [5, 5]


def test_batch_flags_from_values_match_uniform_flags_and_leave_results_unchanged(device):
    logits = _logits(4, 300, seed=3, device=device)
    seeds = torch.arange(4, device=device)
    for temperature, top_k, top_p in (
        (0.0, 5, 0.5),
        (1.0, 0, 1.0),
        (0.7, 20, 1.0),
        (1.3, 0, 0.9),
        (1.0, 300, 1.0),
    ):
        rows = _rows(logits, temperature, top_k, top_p, seeds, 2)
        flags = sampling.uniform_flags(temperature, top_k, top_p, 300)
        assert sampling.batch_flags(rows, 300) == flags
        with_flags = sample_tokens(logits, temperature, top_k, top_p, seeds, 2, impl="torch", flags=flags)
        without = sample_tokens(logits, temperature, top_k, top_p, seeds, 2, impl="torch")
        assert torch.equal(with_flags.tokens, without.tokens)


@pytest.mark.cpu_only(
    "auto's choice among the CPU samplers (it builds the C++ kernels to see whether they run)"
)
def test_auto_picks_the_cpp_or_chunked_sampler_on_cpu_and_rejects_them_where_they_do_not_apply(monkeypatch):
    from alignflow.kernels import _triton_dispatch
    from alignflow.kernels._triton_dispatch import resolve_impl

    want = "cpp" if cpp_available() else "chunked"
    assert resolve_impl("auto", torch.device("cpu"), "sample_tokens") == want
    monkeypatch.setattr(_triton_dispatch, "cpp_available", lambda op="sample_tokens": False)
    assert resolve_impl("auto", torch.device("cpu"), "sample_tokens") == "chunked"
    assert resolve_impl("auto", torch.device("cpu"), "selective_log_softmax") == "torch"
    with pytest.raises(RuntimeError, match="impl='cpp' is not available here .*use impl='chunked' or 'auto'"):
        resolve_impl("cpp", torch.device("cpu"), "sample_tokens")
    with pytest.raises(RuntimeError, match="impl='cpp' is not available here .*use impl='torch' or 'auto'"):
        resolve_impl("cpp", torch.device("cpu"), "logprobs_and_entropy")
    with pytest.raises(RuntimeError, match="impl='cpp' runs on CPU tensors only"):
        resolve_impl("cpp", torch.device("cuda"), "sample_tokens")
    with pytest.raises(ValueError, match=r"impl='cpp' is not one of \('auto', 'torch', 'triton'\)"):
        resolve_impl("cpp", torch.device("cpu"), "op")
    with pytest.raises(
        ValueError, match=r"impl='chunked' is not one of \('auto', 'torch', 'cpp', 'triton'\)"
    ):
        resolve_impl("chunked", torch.device("cpu"), "selective_log_softmax")


# ----------------------------------------------------------------------------------------------
# Triton kernel (interpreter) vs torch reference


def _mixed_rows(batch, gen):
    temperature = torch.rand(batch, generator=gen) * 1.5 + 0.3
    temperature[0] = 0.0  # a greedy row
    top_k = torch.randint(1, 50, (batch,), generator=gen)
    top_k[1::3] = 0
    top_p = torch.rand(batch, generator=gen) * 0.9 + 0.05
    top_p[2::3] = 1.0
    return temperature, top_k, top_p


@pytest.mark.parametrize(
    ("batch", "vocab", "dtype"),
    [
        (7, 1000, torch.float32),
        (7, 1000, torch.bfloat16),
        (3, 32_771, torch.float32),
        (2, 32_771, torch.bfloat16),
    ],
)
def test_triton_picks_exactly_the_torch_tokens_and_kept_sets(batch, vocab, dtype, tol, device):
    from alignflow.kernels import _triton_sampling

    gen = torch.Generator().manual_seed(vocab + batch)
    logits = _logits(batch, vocab, seed=vocab, scale=2.5, dtype=dtype, device=device)
    temperature, top_k, top_p = (t.to(device) for t in _mixed_rows(batch, gen))
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen).to(device)
    for step in (0, 1, 17):
        rows = _rows(logits, temperature, top_k, top_p, seeds, step)
        ref_tokens, ref_logprobs, ref_tau = sampling.sample_torch(logits, rows)
        tokens, logprobs, tau = _triton_sampling.sample(logits, rows)
        assert torch.equal(tau, ref_tau), f"kept-set thresholds differ at step {step}"
        assert torch.equal(tokens, ref_tokens), f"tokens differ at step {step}"
        torch.testing.assert_close(logprobs, ref_logprobs, **tol("sample_logprob"))


def test_triton_samples_stay_in_the_oracle_kept_set(device):
    batch, vocab = 16, 300
    logits = _logits(1, vocab, seed=10, device=device).expand(batch, vocab)
    out = sample_tokens(logits, 0.8, 15, 0.7, torch.arange(batch, device=device), 0, impl="triton")
    assert set(out.tokens.tolist()) <= _oracle_kept(logits[0], 0.8, 15, 0.7)


# ----------------------------------------------------------------------------------------------
# Argument checks


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"temperature": torch.tensor([1.0, -0.5, 1.0])},
            ValueError,
            r"temperature must be finite and >= 0.*row 1 has -0.5",
        ),
        ({"temperature": torch.tensor([1.0, float("nan"), 1.0])}, ValueError, r"temperature.*row 1 has nan"),
        ({"top_p": torch.tensor([1.0, 1.0, 0.0])}, ValueError, r"top_p must be in \(0, 1\].*row 2 has 0.0"),
        ({"top_p": 1.5}, ValueError, r"top_p must be in \(0, 1\].*row 0 has 1.5 \(3 bad row\(s\)\)"),
        ({"top_k": torch.tensor([0, -3, 0])}, ValueError, r"top_k must be >= 0.*row 1 has -3"),
        ({"top_k": torch.tensor([0.5, 0.0, 0.0])}, TypeError, r"top_k must be an integer tensor"),
        ({"step": -1}, ValueError, r"step must be >= 0"),
        ({"step": 1.5}, TypeError, r"step must be an integer, got 1.5"),
        ({"seeds": torch.zeros(2, dtype=torch.long)}, ValueError, r"seeds must have shape \[3\].*got \(2,\)"),
        ({"logits": torch.randn(2, 3, 5)}, ValueError, r"logits must be a floating-point \[B, V\] tensor"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, message):
    args = {
        "logits": torch.randn(3, 5),
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "seeds": torch.arange(3),
        "step": 0,
    }
    args.update(kwargs)
    with pytest.raises(error, match=message):
        sample_tokens(**args, impl="torch")


def test_validate_false_skips_only_the_value_checks():
    logits = torch.randn(3, 5)
    # no sync, no check
    out = sample_tokens(logits, -1.0, 0, 1.0, torch.arange(3), 0, impl="torch", validate=False)
    assert out.tokens.shape == (3,)
    with pytest.raises(ValueError, match=r"seeds must have shape \[3\]"):
        sample_tokens(logits, 1.0, 0, 1.0, torch.arange(2), 0, impl="torch", validate=False)


# ----------------------------------------------------------------------------------------------
# C++ CPU kernel vs torch reference: the same tokens, log-probs within a few ulps


@needs_cpp
def test_cpp_sampler_uses_the_hash_constants_of_rng():
    import re
    from pathlib import Path

    csrc = Path(sampling.__file__).parent / "csrc"
    for path in (csrc / "sampling.cpp", csrc / "avx2" / "sampling_avx2.cpp"):  # the AVX-512 and AVX2 builds
        source = path.read_text()
        for name, cpp_name in (
            ("FMIX_M1", "kFmixM1"),
            ("FMIX_M2", "kFmixM2"),
            ("GOLDEN", "kGolden"),
            ("SEED_SALT", "kSeedSalt"),
            ("STEP_SALT", "kStepSalt"),
        ):
            value = re.search(rf"constexpr uint32_t {cpp_name} = (0x[0-9A-F]+)u;", source).group(1)
            assert int(value, 16) == getattr(rng, name), (path.name, name)


@needs_cpp
def test_the_cpp_sampler_is_the_avx512_extension_or_else_the_avx2_build():
    """sampler(): where the AVX-512 kernels run it is their extension; on an AVX2 CPU (torch's kernels AVX2
    too, so the same SLEEF log), the AVX2 sampler's own extension, which the tests above then check."""
    from alignflow.kernels import _cpu_extension

    module = _cpu_extension.sampler()
    if _cpu_extension.extension() is not None:
        assert module is _cpu_extension.extension()
    else:
        assert torch.backends.cpu.get_cpu_capability() == "AVX2"
        assert module.__name__ == _cpu_extension.AVX2_NAME


@needs_cpp
@pytest.mark.parametrize(
    ("batch", "vocab", "dtype"),
    [
        (1, 1, torch.float32),
        (3, 17, torch.float32),
        (7, 1000, torch.bfloat16),
        (9, 32_001, torch.float32),
        (70, 5003, torch.float32),
    ],
)
def test_cpp_sampler_gives_the_reference_tokens_and_close_logprobs(batch, vocab, dtype, tol):
    gen = torch.Generator().manual_seed(batch + vocab)
    logits = _logits(batch, vocab, seed=vocab + 2, scale=2.5, dtype=dtype)
    mixed = _mixed_rows(batch, gen)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=gen)
    plain = (torch.full((batch,), 0.9), torch.zeros(batch, dtype=torch.long), torch.ones(batch))
    greedy = (torch.zeros(batch), torch.zeros(batch, dtype=torch.long), torch.ones(batch))
    top_p_only = (mixed[0], torch.zeros(batch, dtype=torch.long), mixed[2])
    for temperature, top_k, top_p in (mixed, plain, greedy, top_p_only):
        for step in (0, 3, 2**40):
            want = sample_tokens(logits, temperature, top_k, top_p, seeds, step, impl="torch")
            got = sample_tokens(logits, temperature, top_k, top_p, seeds, step, impl="cpp")
            assert torch.equal(got.tokens, want.tokens), f"step {step}"
            torch.testing.assert_close(got.logprobs, want.logprobs, **tol("sample_logprob"))


@needs_cpp
def test_cpp_sampler_draws_the_reference_tokens_over_many_seeds_at_a_real_vocabulary():
    """The noise is the reference's bit for bit (same hash, same SLEEF log), so not one draw differs."""
    logits = _logits(64, 32_000, seed=5, scale=1.0)
    for step in range(0, 40, 4):
        seeds = torch.randint(0, 2**40, (64,), generator=torch.Generator().manual_seed(step))
        want = sample_tokens(logits, 1.0, 0, 1.0, seeds, step, impl="torch").tokens
        assert torch.equal(sample_tokens(logits, 1.0, 0, 1.0, seeds, step, impl="cpp").tokens, want)


@needs_cpp
def test_cpp_sampler_handles_non_finite_logits_like_the_reference():
    logits = _logits(4, 300, seed=6)
    logits[0, 7] = logits[0, 250] = float("nan")  # argmax takes the first NaN
    logits[1] = float("-inf")  # nothing to pick: index 0, log-prob NaN
    logits[2, 123] = float("inf")
    logits[3, :299] = float("-inf")  # one finite token, last in the row (a ragged 16-lane tail)
    for temperature in (0.0, 1.0):
        want = sample_tokens(logits, temperature, 0, 1.0, torch.arange(4), 1, impl="torch")
        got = sample_tokens(logits, temperature, 0, 1.0, torch.arange(4), 1, impl="cpp")
        assert got.tokens.tolist() == want.tokens.tolist() == [7, 0, 123, 299]
        torch.testing.assert_close(got.logprobs, want.logprobs, equal_nan=True)


@needs_cpp
def test_cpp_sampler_rejects_malformed_arguments_by_name():
    from alignflow.kernels import _cpu_extension

    module = _cpu_extension.sampler()
    logits, rows = torch.randn(2, 8), (torch.ones(2), torch.arange(2), torch.zeros(2, dtype=torch.long))
    none = torch.empty(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"logits must be a contiguous float32 CPU \[B, V\]"):
        module.sample_tokens(logits.double(), *rows, none)
    with pytest.raises(
        RuntimeError, match=r"temperature must be a contiguous Float CPU tensor of shape \[2\]"
    ):
        module.sample_tokens(logits, torch.ones(3), *rows[1:], none)
    with pytest.raises(RuntimeError, match=r"seeds must be a contiguous Long CPU tensor"):
        module.sample_tokens(logits, rows[0], rows[1].int(), rows[2], none)
    with pytest.raises(RuntimeError, match=r"thresholds must be a contiguous Long CPU tensor of shape \[2\]"):
        module.sample_tokens(logits, *rows, torch.zeros(5, dtype=torch.long))


@CHUNKED_ONLY
def test_noise_windows_of_steps_equal_the_per_step_noise_and_samples():
    from alignflow.kernels import _chunked_sampling

    vocab, seeds = 3000, torch.arange(5) * 11 + 3
    k1, k2 = rng.row_keys_per_step(seeds, 8)
    window = _chunked_sampling.gumbel_noise_steps(k1, k2[:, 2:7], vocab)
    assert window.shape == (5, 5, vocab)
    logits = _logits(5, vocab, seed=4, scale=2.0)
    for offset, step in enumerate(range(2, 7)):
        assert torch.equal(window[:, offset], rng.gumbel_noise(k1, k2[:, step], vocab)), step
        for temperature, top_p in ((0.8, 1.0), (0.8, 0.8), (torch.tensor([0.8, 0.0, 1.3, 0.0, 0.5]), 1.0)):
            want = sample_tokens(logits, temperature, 0, top_p, seeds, step, impl="torch")
            got = sample_tokens(
                logits, temperature, 0, top_p, seeds, step, impl="chunked", noise=window[:, offset]
            )
            assert torch.equal(got.tokens, want.tokens) and torch.equal(got.logprobs, want.logprobs), (
                step,
                top_p,
            )
    # The noise decides the draw: another step's gives other tokens (the comparison above is not vacuous).
    other = sample_tokens(logits, 0.8, 0, 1.0, seeds, 2, impl="chunked", noise=window[:, 3])
    assert not torch.equal(other.tokens, sample_tokens(logits, 0.8, 0, 1.0, seeds, 2, impl="torch").tokens)
    with pytest.raises(ValueError, match="noise= is for the chunked impl; torch draws its own"):
        sample_tokens(logits, 0.8, 0, 1.0, seeds, 2, impl="torch", noise=window[:, 0])
    with pytest.raises(ValueError, match=r"noise must be float32 of the logits' shape \(5, 3000\)"):
        sample_tokens(logits, 0.8, 0, 1.0, seeds, 2, impl="chunked", noise=window[:, :, :10])
