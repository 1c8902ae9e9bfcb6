"""Next-token sampling from [B, V] logits: temperature, top-k and top-p in one pass, seeded per request.

This is the engine's sampler (not a generation loop, not a logits processor chain). Per row:

1. greedy rows (temperature == 0) take the argmax and their log-prob at temperature 1;
2. other rows scale z = logits / T (as ``logits * (1/T)`` with 1/T rounded to fp32 once);
3. the *kept set* is {j : key(logits_j) >= tau}, one threshold per row, with ``key`` the
   order-preserving int32 image of the fp32 logit (so ties are decided bit-exactly):
   * top-k (0 = off, k >= V = off): tau_k = key of the k-th largest logit; ties with it are kept,
     so more than k tokens survive only on exact ties;
   * top-p (1.0 = off), applied to the renormalised top-k survivors with q_j proportional to
     exp(z_j - max z), in fixed point (see kept_thresholds): tau_p = key of the m-th largest
     surviving logit, m the smallest count whose mass reaches top_p * (total surviving mass); again
     all ties with it are kept;
4. the token is argmax over the kept set of z_j + G_j (Gumbel-max), the Gumbel noise G_j a pure
   function of (seed, step, j) from rng.py, ties going to the lowest index;
5. the returned log-prob is log softmax(z)[token] over the FULL vocabulary, not over the kept set:
   that is the behaviour policy's probability PPO's importance ratio needs.

The torch reference finds the thresholds with ``torch.topk`` on a prefix of each row where that
decides them exactly, and sorts otherwise. Two eager CPU paths: ``impl="cpp"`` (``csrc/sampling.cpp``,
what ``impl="auto"`` runs on AVX-512 CPUs) takes the thresholds from the reference's code and does
the rest in one AVX-512 pass per row: the same hash in uint32 lanes and the same SLEEF log torch's
kernels call, so the same noise bits and tokens; its log-sum-exp sums in another order (log-probs
within a few ulps). ``impl="chunked"`` (``_chunked_sampling.py``, "auto" where the C++ kernels do not
build) does the reference's arithmetic in 32-bit words over cache-sized vocabulary chunks and gives
the same tokens and log-probs bit for bit, several times faster than the eager reference (every path's
timings: ``python benchmarks/sampler_bench.py``, docs/performance.md#cpu-kernels). The Triton kernel
(``_triton_sampling.py``) finds the same thresholds by a 16-way search over the int32 keys (8-9 passes each).
Both use the same noise bits, the same thresholds-by-key and the same tie rule, so they pick the same token
unless two candidates' scores, or a top-p cumulative mass and its target, fall within a few fp32 ulps of each
other (fp32 sums differ in order; exp/log differ by an ulp between libm and the GPU): we estimate such a near
tie at about 1e-6 per draw.

A request's samples depend only on its own (seed, step) and logits: the same seed gives the same
tokens in any batch position and alongside any other requests. Callers must give each sequence its
own seed (e.g. GRPO's n samples per prompt) and advance ``step`` every token.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from alignflow.kernels import rng
from alignflow.kernels._triton_dispatch import resolve_impl

_NO_THRESHOLDS = torch.empty(0, dtype=torch.int64)  # the C++ sampler's "no kept-set mask"


class SampleOutput(NamedTuple):
    """One sampled token per row and its log-prob under the full-vocabulary softmax(logits / T)."""

    tokens: torch.Tensor  # [B] int64
    logprobs: torch.Tensor  # [B] fp32; greedy rows: log softmax(logits)[token] at T = 1


def sample_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int,
    top_p: torch.Tensor | float,
    seeds: torch.Tensor | int,
    step: int | torch.Tensor,
    impl: str = "auto",
    *,
    validate: bool = True,
    flags: BatchFlags | None = None,
    thresholds: torch.Tensor | None = None,
    row_keys: tuple[torch.Tensor, torch.Tensor] | None = None,
    noise: torch.Tensor | None = None,
) -> SampleOutput:
    """Samples one token per row of ``logits`` [B, V] (see the module docstring for the exact rule).

    temperature: [B] float, >= 0 (0 = greedy); top_k: [B] int, >= 0 (0 = off);
    top_p: [B] float in (0, 1] (1 = off); seeds: [B] int64; step: int or [B] int64, >= 0.
    Python scalars are broadcast to [B]. Returns SampleOutput(tokens [B] int64, logprobs [B] fp32).

    ``validate=False`` skips the value checks (shapes and dtypes are always checked): they cost one
    host-device sync per call, which a CUDA decode loop can avoid by checking its sampling
    parameters once per generate call.

    ``flags`` states what holds for the whole batch (see BatchFlags); a caller that knows it (the engine,
    with one SamplingParams per call) passes ``uniform_flags(...)`` so that the torch paths branch on
    Python bools: no host sync, and no graph break under torch.compile. Wrong flags give wrong samples.

    ``thresholds``: the kept-set threshold keys [B] int64 that ``kept_set_thresholds`` gives for these
    logits and values, computed beforehand; the torch paths then skip that step. The compiled engine
    passes them because eagerly they come from a short top-k prefix, while a compiled graph must sort.

    ``row_keys``: (k1, k2), [B] int64 each, what ``rng.row_keys(seeds, step)`` gives, computed beforehand (a
    decode loop takes every step's from ``rng.row_keys_per_step`` once); the torch paths then skip the hash of
    seeds and steps. Wrong keys give other samples. The C++ and Triton kernels hash in-kernel and refuse them.

    ``noise``: [B, V] fp32, the Gumbel noise ``rng.gumbel_noise(*rng.row_keys(seeds, step), V)`` of this step,
    computed beforehand (a decode loop takes a window of steps' at once from
    ``_chunked_sampling.gumbel_noise_steps``); the chunked impl then skips the hash, the logs and their ~25
    operator calls per step. Wrong noise gives other samples. Only the chunked impl takes it.

    impl: "auto" (Triton on CUDA; on CPU "cpp" where the C++ kernels build, else "chunked"), "torch"
    (the sort-based reference), "chunked" (eager CPU torch ops, bit-identical to "torch"), "cpp" (the
    AVX-512 C++ kernel: the reference's tokens, log-probs within a few ulps), "triton".
    """
    rows = sampling_rows("sample_tokens", logits, temperature, top_k, top_p, seeds, step, validate)
    chosen = resolve_impl(impl, logits.device, "sample_tokens")
    if row_keys is not None:
        if chosen in ("triton", "cpp"):
            raise ValueError(
                f"sample_tokens: row_keys= is for the torch and chunked impls; {chosen} hashes in-kernel"
            )
        if any(k.shape != rows.seeds.shape or k.dtype != torch.int64 for k in row_keys):
            raise ValueError(
                f"sample_tokens: row_keys must be two int64 [{rows.seeds.shape[0]}] tensors, got "
                f"{[(tuple(k.shape), k.dtype) for k in row_keys]}"
            )
        rows = rows._replace(keys=row_keys)
    if noise is not None:
        if chosen != "chunked":
            raise ValueError(f"sample_tokens: noise= is for the chunked impl; {chosen} draws its own")
        if noise.shape != logits.shape or noise.dtype != torch.float32:
            raise ValueError(
                f"sample_tokens: noise must be float32 of the logits' shape {tuple(logits.shape)}, got "
                f"{tuple(noise.shape)} {noise.dtype}"
            )
        rows = rows._replace(noise=noise)
    if chosen == "triton":
        from alignflow.kernels import _triton_sampling

        if thresholds is not None:
            raise ValueError(
                "sample_tokens: thresholds= is for the torch and chunked impls; Triton finds its own"
            )
        tokens, logprobs, _ = _triton_sampling.sample(logits, rows)
    elif chosen == "cpp":
        from alignflow.kernels import _cpu_extension

        flags = flags or batch_flags(rows, logits.shape[1])
        if thresholds is None and (flags.any_top_k or flags.any_top_p):
            thresholds = kept_set_thresholds(logits, rows.temperature, rows.top_k, rows.top_p, flags)
        tokens, logprobs = _cpu_extension.sampler().sample_tokens(
            logits.to(torch.float32).contiguous(),
            rows.temperature.contiguous(),
            rows.seeds.contiguous(),
            rows.steps.contiguous(),
            thresholds.to(torch.int64).contiguous() if thresholds is not None else _NO_THRESHOLDS,
        )
    elif chosen == "chunked":
        from alignflow.kernels import _chunked_sampling

        tokens, logprobs, _ = _chunked_sampling.sample(
            logits, rows, flags or batch_flags(rows, logits.shape[1]), thresholds, want_tau=False
        )
    else:
        tokens, logprobs, _ = sample_torch(logits, rows, flags, thresholds)
    return SampleOutput(tokens, logprobs)


def kept_set_thresholds(
    logits: torch.Tensor,
    temperature: torch.Tensor | float,
    top_k: torch.Tensor | int,
    top_p: torch.Tensor | float,
    flags: BatchFlags | None = None,
) -> torch.Tensor:
    """The kept-set threshold keys [B] int64 that sample_tokens applies to ``logits`` [B, V] (see
    kept_thresholds).

    Arguments as in sample_tokens (values are not checked). Call it eagerly: under torch.compile
    it takes the sort, which at a real vocabulary size costs many times a top-k prefix.
    """
    rows = sampling_rows("kept_set_thresholds", logits, temperature, top_k, top_p, 0, 0, validate=False)
    inv_t, _, k, p = normalised_rows(rows, logits.shape[1])
    x = logits.to(torch.float32)
    return kept_thresholds(ordered_keys32(x), x * inv_t[:, None], k, p, flags)


class BatchFlags(NamedTuple):
    """Facts about a whole batch that decide which work the torch paths do (per-row values still apply)."""

    all_greedy: bool  # every row has temperature 0: no noise at all
    any_top_k: bool  # some sampled row has 0 < top_k < V
    any_top_p: bool  # some sampled row has top_p < 1
    any_greedy: bool = True  # some row has temperature 0 (True when unknown: the paths then check per row)


def uniform_flags(temperature: float, top_k: int, top_p: float, vocab: int) -> BatchFlags:
    """BatchFlags of a batch whose rows all share these sampling values (no tensor, no sync)."""
    greedy = temperature == 0
    return BatchFlags(
        all_greedy=greedy,
        any_top_k=not greedy and 0 < top_k < vocab,
        any_top_p=not greedy and top_p < 1,
        any_greedy=greedy,
    )


def batch_flags(rows: SamplingRows, vocab: int) -> BatchFlags:
    """BatchFlags read from the per-row values (one host sync)."""
    greedy = rows.temperature == 0
    use_k = ~greedy & (rows.top_k > 0) & (rows.top_k < vocab)
    use_p = ~greedy & (rows.top_p < 1)
    all_greedy, any_k, any_p, any_greedy = torch.stack(
        [greedy.all(), use_k.any(), use_p.any(), greedy.any()]
    ).tolist()
    return BatchFlags(all_greedy, any_k, any_p, any_greedy)


# --------------------------------------------------------------------------------------------------
# Argument checks


class SamplingRows(NamedTuple):
    """Checked per-row sampling parameters, all [B] on the logits' device (what both impls take)."""

    temperature: torch.Tensor  # fp32, >= 0
    top_k: torch.Tensor  # int64, >= 0
    top_p: torch.Tensor  # fp32, (0, 1]
    seeds: torch.Tensor  # int64
    steps: torch.Tensor  # int64, >= 0
    # rng.row_keys(seeds, steps) when the caller computed them beforehand (sample_tokens' row_keys=), else
    # None
    keys: tuple[torch.Tensor, torch.Tensor] | None = None
    # [B, V] fp32 rng.gumbel_noise for these keys, computed beforehand (sample_tokens' noise=), else None
    noise: torch.Tensor | None = None


def _as_rows(op: str, name: str, value, batch: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.ndim != 1 or value.shape[0] != batch:
            raise ValueError(
                f"{op}: {name} must have shape [{batch}] (one per row of logits), got {tuple(value.shape)}"
            )
        if not dtype.is_floating_point and value.is_floating_point():
            raise TypeError(f"{op}: {name} must be an integer tensor, got {value.dtype}")
        return value.to(device=device, dtype=dtype)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{op}: {name} must be a [{batch}] tensor or a Python number, got {type(value).__name__}"
        )
    if not dtype.is_floating_point and not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an integer, got {value!r}")
    return torch.full((batch,), value, dtype=dtype, device=device)


def _first_bad(values: torch.Tensor, bad: torch.Tensor) -> str:
    row = int(bad.nonzero()[0, 0])
    return f"row {row} has {values[row].item()!r} ({int(bad.sum())} bad row(s))"


def sampling_rows(
    op: str, logits: torch.Tensor, temperature, top_k, top_p, seeds, step, validate: bool = True
) -> SamplingRows:
    """Checks shapes and dtypes (always) and values (when ``validate``; one host sync);
    raises naming the bad row."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.ndim != 2:
        got = (
            f"shape {tuple(logits.shape)} {logits.dtype}"
            if isinstance(logits, torch.Tensor)
            else type(logits).__name__
        )
        raise ValueError(f"{op}: logits must be a floating-point [B, V] tensor, got {got}")
    batch, vocab = logits.shape
    if vocab == 0:
        raise ValueError(f"{op}: logits have an empty vocabulary dim, shape {tuple(logits.shape)}")
    dev = logits.device
    rows = SamplingRows(
        temperature=_as_rows(op, "temperature", temperature, batch, torch.float32, dev),
        top_k=_as_rows(op, "top_k", top_k, batch, torch.int64, dev),
        top_p=_as_rows(op, "top_p", top_p, batch, torch.float32, dev),
        seeds=_as_rows(op, "seeds", seeds, batch, torch.int64, dev),
        steps=_as_rows(op, "step", step, batch, torch.int64, dev),
    )
    if not validate or batch == 0:
        return rows
    temp, k, p, steps = rows.temperature, rows.top_k, rows.top_p, rows.steps
    bad_t = ~(temp >= 0) | ~torch.isfinite(temp)
    bad_k = k < 0
    bad_p = ~((p > 0) & (p <= 1))
    bad_s = steps < 0
    # One host sync for all checks; the messages below are only built on failure.
    if bool((bad_t | bad_k | bad_p | bad_s).any()):
        problems = []
        if bad_t.any():
            problems.append(f"temperature must be finite and >= 0 (0 = greedy): {_first_bad(temp, bad_t)}")
        if bad_k.any():
            problems.append(f"top_k must be >= 0 (0 = off): {_first_bad(k, bad_k)}")
        if bad_p.any():
            problems.append(f"top_p must be in (0, 1] (1 = off): {_first_bad(p, bad_p)}")
        if bad_s.any():
            problems.append(f"step must be >= 0: {_first_bad(steps, bad_s)}")
        raise ValueError(f"{op}: " + "; ".join(problems))
    return rows


# --------------------------------------------------------------------------------------------------
# Torch reference


def ordered_keys(x: torch.Tensor) -> torch.Tensor:
    """int32 keys with the order of fp32 ``x`` (-0.0 just below +0.0, -inf lowest):
    int64 tensor, same shape."""
    return ordered_keys32(x).to(torch.int64)


def ordered_keys32(x: torch.Tensor) -> torch.Tensor:
    """ordered_keys' values as an int32 tensor (half the memory traffic; topk, min and compares take it)."""
    bits = x.to(torch.float32).contiguous().view(torch.int32)
    # Negative floats (sign bit set) keep the sign and flip the other 31 bits: bits ^ 0x7FFFFFFF.
    # The arithmetic shift gives that mask without a where; in place it is 3 passes over int32, where an
    # int64 where() would allocate and stream several tensors twice the size.
    flip = torch.bitwise_right_shift(bits, 31)
    flip &= 0x7FFFFFFF
    flip ^= bits
    return flip


# Widest top-k threshold taken with torch.topk rather than a sort (topk slows down as k grows; up to this
# width it stays well below the cost of the sort).
_TOPK_INSTEAD_OF_SORT = 1024
# Prefix widths tried, in order, for the top-p cut of the rows still undecided; then a sort. A
# trained LM's nucleus is usually within the first 256 tokens.
_TOP_P_PREFIXES = (256, 2048)


def mass_bits(vocab: int) -> int:
    """Fractional bits of the fixed-point top-p masses: a row's total stays below 2**52, so every sum
    and its conversion to float64 is exact in any order (V = 32000: 37 bits, a resolution of 7e-12)."""
    return 52 - max(vocab - 1, 1).bit_length()


def kept_thresholds(
    keys: torch.Tensor,
    z: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    flags: BatchFlags | None = None,
    method: str = "auto",
) -> torch.Tensor:
    """Per-row kept-set threshold key tau (int64 [B]): the kept set is keys >= tau.

    keys: [B, V] from ordered_keys(logits), int64 or the same values in int32 (thresholds are on raw
    logits so ties are bit-exact); z: [B, V] fp32 scaled logits (masses); top_k int32 [B] (0 = off);
    top_p fp32 [B] (1 = off).

    Top-p masses are fixed point: q_j = floor(exp(z_j - max z) * 2**mass_bits(V)) as int64, so the
    total and every running sum are exact integers whatever the order of summation. That makes the
    cut computable from a short prefix of the sorted row, bit for bit equal to the full sort, with
    the total taken by a plain sum: eagerly, the rows whose cut lies in the first 256 (then 2048)
    keys never sort. Under torch.compile, where choosing would be a host sync, every row is sorted
    (the engine computes the thresholds eagerly and passes them in: ``sample_tokens(thresholds=...)``).
    ``method="sort"`` sorts every row eagerly too: the same thresholds, for tests and benchmarks.
    """
    if method not in ("auto", "sort"):
        raise ValueError(f"kept_thresholds: method must be 'auto' or 'sort', got {method!r}")
    tau = keys.min(dim=1).values.to(torch.int64)
    use_k, use_p = top_k > 0, top_p < 1
    any_k, any_p = (flags.any_top_k, flags.any_top_p) if flags else (bool(use_k.any()), bool(use_p.any()))
    if not (any_k or any_p):
        return tau
    eager = method == "auto" and not torch.compiler.is_compiling()
    prefix = None  # (largest keys, their order): a sorted prefix of every row, when one was taken
    if any_k:
        k_max = int(top_k.max()) if eager else None
        if k_max is not None and k_max <= _TOPK_INSTEAD_OF_SORT:
            # Only the k-th largest key matters: topk instead of a sort, which costs far more at a small k.
            # With top-p, twice as wide plus 64, to hold ties with the k-th.
            width = min(keys.shape[1], 2 * k_max + 64 if any_p else max(k_max, 1))
            prefix = keys.topk(width, dim=1)
        else:
            prefix = keys.sort(dim=1, descending=True)
        tau_k = prefix[0].gather(1, (top_k.to(torch.int64) - 1).clamp(min=0)[:, None]).squeeze(1)
        tau = torch.where(use_k, tau_k.to(torch.int64), tau)
    if not any_p:
        return tau
    scale = 2.0 ** mass_bits(keys.shape[1])
    if eager and prefix is not None and _nucleus_inside(prefix[0], tau, use_k, use_p, keys.shape[1]):
        # Every top-p row's survivors lie in the prefix: its masses alone give the exact total.
        largest, order = prefix
        z_sorted = z.gather(1, order)
        mass = _fixed_point(z_sorted, z_sorted[:, :1], scale).masked_fill_(
            largest < tau[:, None].to(largest.dtype), 0
        )
        target = top_p.to(torch.float64) * mass.sum(dim=1).to(torch.float64)
        tau_p = _top_p_cut(largest, mass, target)[0]
        return torch.where(use_p, torch.maximum(tau_p, tau), tau)
    # Fixed-point masses of the top-k survivors (keys >= tau) over whole rows, their exact total, the target.
    mass = _fixed_point(z, z.max(dim=1, keepdim=True).values, scale).masked_fill_(
        keys < tau[:, None].to(keys.dtype), 0
    )
    target = top_p.to(torch.float64) * mass.sum(dim=1).to(torch.float64)
    if eager:
        tau_p = _top_p_cut_by_prefixes(keys, mass, target, use_p)
    else:
        tau_p = _top_p_cut(*_sorted_prefix(keys, mass, keys.shape[1]), target)[0]
    return torch.where(use_p, torch.maximum(tau_p, tau), tau)


def _fixed_point(z: torch.Tensor, z_max: torch.Tensor, scale: float) -> torch.Tensor:
    """int64 floor(exp(z - z_max) * scale): an fp32 in [0, 1] times a power of two, truncated exactly."""
    mass = z - z_max
    return mass.exp_().mul_(scale).to(torch.int64)


def _nucleus_inside(
    largest: torch.Tensor, tau: torch.Tensor, use_k: torch.Tensor, use_p: torch.Tensor, vocab: int
) -> bool:
    """Whether every top-p row has top-k and its survivors (keys >= tau) all lie in this sorted prefix."""
    if largest.shape[1] == vocab:
        return True
    return not bool((use_p & (~use_k | (largest[:, -1].to(torch.int64) >= tau))).any())


def _sorted_prefix(keys: torch.Tensor, mass: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``width`` largest keys of each row, largest first, and their masses in that order."""
    if width >= keys.shape[1]:
        largest, order = keys.sort(dim=1, descending=True)
    else:
        largest, order = keys.topk(width, dim=1)
    return largest, mass.gather(1, order)


def _top_p_cut(
    largest: torch.Tensor, mass_sorted: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(tau_p int64 [R], decided bool [R], prefix mass fp64 [R]) from a sorted prefix.

    tau_p = the key at the first index whose running mass reaches the target; decided = that index
    lies in the prefix (always, if the prefix is the whole row). Ties reorder freely: tied keys
    carry equal masses, so the running sums agree.
    """
    cumulative = mass_sorted.cumsum(dim=1)  # int64, exact
    # The running sums are integers, so "cum < target" is "cum < ceil(target)"; they never decrease,
    # so the first index reaching it is a binary search (no float64 copy of [R, W], no counting pass).
    first = torch.searchsorted(cumulative, torch.ceil(target).to(torch.int64)[:, None]).squeeze(1)
    decided = first < largest.shape[1]
    first = first.clamp(max=largest.shape[1] - 1)
    return (
        largest.gather(1, first[:, None]).squeeze(1).to(torch.int64),
        decided,
        cumulative[:, -1].to(torch.float64),
    )


def _top_p_cut_by_prefixes(
    keys: torch.Tensor, mass: torch.Tensor, target: torch.Tensor, use_p: torch.Tensor
) -> torch.Tensor:
    """Eager top-p cut: prefixes of _TOP_P_PREFIXES widths, each for the rows still undecided, then a sort.

    A row goes straight to the sort when even the next prefix cannot reach its target (the masses
    are sorted, so it adds at most its extra width times the last mass seen): a flat row then costs
    at most one short topk more than the sort alone, and none when its target exceeds 2048 top masses.
    """
    vocab = keys.shape[1]
    widths = [w for w in _TOP_P_PREFIXES if w < vocab] + [vocab]
    tau_p = torch.zeros(keys.shape[0], dtype=torch.int64, device=keys.device)
    pending = use_p.nonzero().squeeze(1)
    # No mass exceeds the top token's (2**mass_bits), so a prefix of w keys holds at most w times
    # that: rows whose target is beyond even the widest prefix's reach are sorted without trying.
    to_sort: list[torch.Tensor] = []
    if len(widths) > 1:
        beyond = target[pending] > widths[-2] * 2.0 ** mass_bits(vocab)
        to_sort.append(pending[beyond])
        pending = pending[~beyond]
    for stage, width in enumerate(widths):
        if width == vocab:
            pending = torch.cat([pending, *to_sort])
        if pending.numel() == 0:
            continue
        everyone = pending.numel() == keys.shape[0]
        largest, mass_sorted = _sorted_prefix(
            *((keys, mass) if everyone else (keys[pending], mass[pending])), width
        )
        cut, decided, reached = _top_p_cut(largest, mass_sorted, target[pending])
        tau_p[pending[decided]] = cut[decided]
        if width == vocab:
            break
        undecided = ~decided
        next_width = widths[stage + 1]
        if next_width < vocab:
            best_case = reached + (next_width - width) * mass_sorted[:, -1].to(torch.float64)
            hopeless = undecided & (best_case < target[pending])
            to_sort.append(pending[hopeless])
            undecided &= ~hopeless
        pending = pending[undecided]
    return tau_p


def normalised_rows(
    rows: SamplingRows, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inv_t fp32, greedy bool, top_k int32, top_p fp32), [B] each, with the off switches made explicit.

    inv_t = 1/T rounded to fp32 once (1 for greedy rows); top_k = 0 when off, >= V or greedy;
    top_p = 1 when off or greedy. The Triton kernel derives the same four values in-kernel.
    """
    temp = rows.temperature
    greedy = temp == 0
    ones = torch.ones_like(temp)
    inv_t = torch.where(greedy, ones, 1.0 / torch.where(greedy, ones, temp))
    top_k = torch.where(greedy | (rows.top_k >= vocab), torch.zeros_like(rows.top_k), rows.top_k).to(
        torch.int32
    )
    top_p = torch.where(greedy, ones, rows.top_p)
    return inv_t, greedy, top_k, top_p


def sample_torch(
    logits: torch.Tensor,
    rows: SamplingRows,
    flags: BatchFlags | None = None,
    thresholds: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Torch reference: (tokens int64 [B], logprobs fp32 [B], kept-set threshold keys int64 [B]).

    ``thresholds``: kept_thresholds' result for these logits and rows, when already known.
    """
    vocab = logits.shape[1]
    inv_t, greedy, top_k, top_p = normalised_rows(rows, vocab)
    x = logits.to(torch.float32)
    z = x * inv_t[:, None]
    keys = ordered_keys(x)
    tau = kept_thresholds(keys, z, top_k, top_p, flags) if thresholds is None else thresholds
    score = z
    all_greedy = flags.all_greedy if flags else bool(greedy.all())
    if not all_greedy:  # the hash costs ~20 int64 ops per logit; all-greedy batches skip it
        k1, k2 = rows.keys if rows.keys is not None else rng.row_keys(rows.seeds, rows.steps)
        score = z + rng.gumbel_noise(k1, k2, vocab) * (~greedy).to(torch.float32)[:, None]
    # Without top-k or top-p, tau is the row minimum and the mask keeps everything: skipping it
    # saves a pass over [B, V], a noticeable share of the compiled sampler.
    truncated = (
        (flags.any_top_k or flags.any_top_p)
        if flags
        else thresholds is not None or bool(((top_k > 0) | (top_p < 1)).any())
    )
    if truncated:
        score = torch.where(keys >= tau[:, None], score, torch.full_like(z, float("-inf")))
    tokens = score.argmax(dim=1)  # first maximal index on ties, like the kernel
    logprobs = z.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(z, dim=1)
    return tokens, logprobs, tau
