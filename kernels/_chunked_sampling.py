"""Eager CPU sampler: sampling.sample_torch's tokens and log-probs bit for bit, in cache-sized vocab chunks.

The reference builds ~40 full [B, V] int64 temporaries per call (the hash in 16-bit halves, two
logs, masks); at [64, 32000] each is 16 MB, so it streams ~650 MB through memory. Here the same
arithmetic runs

* in 32-bit words (int32 tensors holding the hash's uint32 bits): shifts made logical by masking
  the sign-extended bits, products and the one sum wrapping mod 2**32. torch's int32 kernels wrap
  (AVX-512 vpmulld/vpaddd; the scalar tail is an imul) although C++ leaves signed overflow
  undefined; torch's uint32 multiply would be defined but is not vectorised, and many times slower.
  The tests' bit-for-bit comparison with the overflow-free int64 reference is
  what guards this on every platform CI runs on;
* in place on [B, chunk] buffers sized to stay in L2 (~1 MB each), with one scratch buffer;
* with a running (max, first index) across chunks, later chunks winning only when strictly
  greater, which is argmax's first-index tie rule over the whole row.

Top-k/top-p thresholds come from the reference's ``kept_thresholds`` (sorted prefixes of each row,
a full sort only for rows no prefix decides) and are applied per chunk. Every value that decides the token is
computed by the same fp32 operations as the reference: tokens, log-probs and thresholds are equal, not close
(tests/kernels/test_sampling.py). Timings: ``python benchmarks/sampler_bench.py``.
"""

from __future__ import annotations

import functools

import torch

from alignflow.kernels import rng
from alignflow.kernels.sampling import (
    BatchFlags,
    SamplingRows,
    kept_thresholds,
    normalised_rows,
    ordered_keys32,
)

# int32 elements per chunk buffer: 256 Ki x 4 B = 1 MB, a quarter of a 4 MB L2 (a chunk has about three
# such buffers live). Much smaller chunks pay their per-chunk overhead, a whole row does not stay in cache
# (python benchmarks/sampler_bench.py times it).
_CHUNK_ELEMENTS = 1 << 18
_MIN_CHUNK = 1024


def _signed(word: int) -> int:
    """The int32 value with the bits of a uint32 constant."""
    return word - (1 << 32) if word >= 1 << 31 else word


_M1, _M2 = _signed(rng.FMIX_M1), _signed(rng.FMIX_M2)


def _to_int32_bits(words: torch.Tensor) -> torch.Tensor:
    """int32 with the low 32 bits of int64 ``words`` (torch's int64 -> int32 conversion truncates)."""
    return words.to(torch.int32)


@functools.cache
def _golden_columns(vocab_size: int, device: torch.device) -> torch.Tensor:
    """(j * GOLDEN) mod 2**32 for j < vocab_size as int32 bits: the same every call, so computed once."""
    return _to_int32_bits(rng._mul32(torch.arange(vocab_size, device=device, dtype=torch.int64), rng.GOLDEN))


def _xorshift_(bits: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """bits ^= bits >>> shift (logical), in place on int32 bits."""
    torch.bitwise_right_shift(bits, shift, out=scratch)
    scratch &= (1 << (32 - shift)) - 1
    bits ^= scratch


def _fmix32_(bits: torch.Tensor, scratch: torch.Tensor) -> None:
    """rng.fmix32 in place on int32 bits."""
    _xorshift_(bits, 16, scratch)
    bits *= _M1
    _xorshift_(bits, 13, scratch)
    bits *= _M2
    _xorshift_(bits, 16, scratch)


def _gumbel_chunk(k1_bits: torch.Tensor, k2_bits: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """rng.gumbel_noise(k1, k2, V)[:, c0:c1] (fp32 [B, C]) for columns = _golden_columns(V)[c0:c1]."""
    bits = columns[None, :] ^ k2_bits[:, None]  # a new [B, C] int32 buffer, updated in place below
    scratch = torch.empty_like(bits)
    _fmix32_(bits, scratch)
    bits += k1_bits[:, None]  # (h + k1) mod 2**32
    _fmix32_(bits, scratch)
    # u = (2 * (h >> 9) + 1) * 2**-24 = (h >> 9) * 2**-23 + 2**-24, both steps exact in fp32.
    torch.bitwise_right_shift(bits, 9, out=scratch)
    scratch &= 0x7FFFFF
    uniform = scratch.to(torch.float32).mul_(2.0**-23).add_(rng.UNIFORM_SCALE)
    return uniform.log_().neg_().log_().neg_()


def gumbel_noise_steps(k1: torch.Tensor, k2: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """rng.gumbel_noise for several steps at once: fp32 [B, S, V], [:, s] = gumbel_noise(k1, k2[:, s], V).

    k1 [B] and k2 [B, S] int64 as rng.row_keys_per_step gives them. The same elementwise fp32 operations as
    the per-step hash, on a [B * S, V] buffer: equal bit for bit, in S times fewer operator calls (a decode
    loop on the demo model made ~25 of its ~280 calls per step here). Memory: three [B * S, V] 4-byte
    buffers while it runs; the caller picks S to bound that.
    """
    batch, steps = k2.shape
    k1_bits = _to_int32_bits(k1).repeat_interleave(steps)  # row-major (row, step), as k2.reshape(-1)
    noise = _gumbel_chunk(k1_bits, _to_int32_bits(k2.reshape(-1)), _golden_columns(vocab_size, k1.device))
    return noise.view(batch, steps, vocab_size)


def sample(
    logits: torch.Tensor, rows: SamplingRows, flags: BatchFlags, thresholds: torch.Tensor | None = None,
    want_tau: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Same contract and results as sampling.sample_torch: (tokens int64 [B], logprobs fp32 [B], tau int64
    [B]).

    want_tau=False: tau is None when nothing is cut, and the batch-wide facts in `flags` stand in for per-row
    work: with no greedy row and no truncation a step needs only 1/T of normalised_rows, and no order keys
    (the engine's sampling with noise windows: 24 fewer operator calls per decode step, same arithmetic).
    """
    batch, vocab = logits.shape
    truncated = thresholds is not None or flags.any_top_k or flags.any_top_p
    x = logits.to(torch.float32)
    if flags.any_greedy or truncated or want_tau:
        inv_t, greedy, top_k, top_p = normalised_rows(rows, vocab)
    else:
        # every row samples: normalised_rows' inv_t is where(greedy, 1, 1 / T) = 1 / T, the same fp32 division
        inv_t, greedy = 1.0 / rows.temperature, None
    z = x * inv_t[:, None]
    keys = tau = tau32 = None
    if truncated or want_tau:
        # sliced per chunk below: slicing x and keying each slice would copy it
        keys = ordered_keys32(x)
        if thresholds is not None:
            tau = thresholds
        elif truncated:
            # int32 keys: an int64 copy would be one more pass over [B, V]
            tau = kept_thresholds(keys, z, top_k, top_p, flags)
        else:
            tau = keys.amin(dim=1).to(torch.int64)  # what the reference returns when nothing is cut
        tau32 = tau.to(torch.int32)  # int32 keys against int64 tau would promote (copy) every key to int64
    logprobs_base = torch.logsumexp(z, dim=1)
    if flags.all_greedy:
        score = z
        if truncated:
            score = torch.where(keys >= tau32[:, None], z, torch.full_like(z, float("-inf")))
        tokens = score.argmax(dim=1)
        return tokens, z.gather(1, tokens[:, None]).squeeze(1) - logprobs_base, tau

    # greedy rows beside sampled ones: their noise is scaled by 0
    mixed = flags.any_greedy and bool(greedy.any())
    noise_scale = (~greedy).to(torch.float32)[:, None] if mixed else None
    if rows.noise is not None:  # the whole row's noise, computed beforehand: one chunk, no hash
        score = (rows.noise * noise_scale if mixed else rows.noise) + z  # greedy rows: z + 0 * G, as below
        if truncated:
            score.masked_fill_(keys < tau32[:, None], float("-inf"))
        tokens = score.argmax(dim=1)
        return tokens, z.gather(1, tokens[:, None]).squeeze(1) - logprobs_base, tau
    k1, k2 = rows.keys if rows.keys is not None else rng.row_keys(rows.seeds, rows.steps)
    k1_bits, k2_bits = _to_int32_bits(k1), _to_int32_bits(k2)
    columns = _golden_columns(vocab, logits.device)
    chunk = max(_MIN_CHUNK, _CHUNK_ELEMENTS // max(batch, 1))
    best_value = best_index = None
    for start in range(0, vocab, chunk):
        stop = min(vocab, start + chunk)
        score = _gumbel_chunk(k1_bits, k2_bits, columns[start:stop])
        if mixed:
            score.mul_(noise_scale)  # greedy rows: z + 0 * G, exactly as the reference
        score.add_(z[:, start:stop])
        if truncated:
            score.masked_fill_(keys[:, start:stop] < tau32[:, None], float("-inf"))
        value, index = score.max(dim=1)
        if best_value is None:
            best_value, best_index = value, index
            continue
        better = value > best_value  # strictly: an equal value in a later chunk has a higher index
        best_value = torch.where(better, value, best_value)
        best_index = torch.where(better, index + start, best_index)
    return best_index, z.gather(1, best_index[:, None]).squeeze(1) - logprobs_base, tau
