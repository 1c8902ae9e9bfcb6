"""Counter-based random numbers for sampling, in torch integer ops (not a general RNG; no Generator state).

Every random number is a pure function of (seed, step, vocab index), so a sequence's samples do not
depend on which other requests share its batch, and the Triton kernel in ``_triton_sampling.py``
(which repeats the per-token hash below in ``uint32`` arithmetic) draws exactly the same numbers.

The hash is the murmur3 32-bit finaliser (``fmix32``), applied twice per vocabulary entry:

    k1, k2   = row_keys(seed, step)                      # once per row, here in torch for both impls
    h        = fmix32(fmix32((j * GOLDEN) ^ k2) + k1)    # j = vocab index, all mod 2**32
    u        = (2 * (h >> 9) + 1) * 2**-24               # in [2**-24, 1 - 2**-24], exact in fp32

``j * GOLDEN`` and ``fmix32`` are bijections of 32-bit words, so one row never repeats a value across
its vocabulary. torch has no ``uint32`` arithmetic, so values live in int64 holding [0, 2**32) and
every 32x32-bit product is split into 16-bit halves (``_mul32``): a plain int64 product of two
32-bit words reaches 2**64 and overflows int64 (wrap-around there is not something to rely on).
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# murmur3 fmix32 multipliers and the 32-bit golden ratio; _triton_sampling.py repeats them and a
# test checks the two files agree bit for bit.
FMIX_M1 = 0x85EBCA6B
FMIX_M2 = 0xC2B2AE35
GOLDEN = 0x9E3779B1
# Domain separators so that seed and step words never feed the hash the same way.
SEED_SALT = 0x243F6A88
STEP_SALT = 0x85A308D3
# 2**-24: u = (2 * (h >> 9) + 1) * 2**-24 uses the 23 top hash bits and is exactly representable in
# fp32 (2 * (h >> 9) + 1 < 2**24), so torch and Triton agree on u bit for bit.
UNIFORM_SCALE = 2.0**-24


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 ``x`` in [0, 2**32) and a 32-bit constant ``c``, never above 2**49."""
    lo = x * (c & 0xFFFF)  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # < 2**32
    return (lo + hi) & MASK32


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on int64 tensors holding 32-bit words; returns a new tensor, same shape."""
    h = h ^ (h >> 16)
    h = _mul32(h, FMIX_M1)
    h = h ^ (h >> 13)
    h = _mul32(h, FMIX_M2)
    return h ^ (h >> 16)


def row_keys(seeds: torch.Tensor, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row hash keys (k1, k2), each int64 [B] in [0, 2**32), from int64 ``seeds`` [B] and ``steps`` [B].

    All 64 bits of seed and step enter the keys (negative seeds too, as two's complement words).
    """
    seeds = seeds.to(torch.int64)
    steps = steps.to(torch.int64)
    seed_lo, seed_hi = seeds & MASK32, (seeds >> 32) & MASK32
    step_lo, step_hi = steps & MASK32, (steps >> 32) & MASK32
    k1 = fmix32(seed_lo ^ fmix32(seed_hi ^ SEED_SALT))
    step_word = fmix32(step_lo ^ fmix32(step_hi ^ STEP_SALT))
    k2 = fmix32((k1 + step_word) & MASK32)
    return k1, k2


def row_keys_per_step(seeds: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """row_keys for every step 0..steps-1 at once: (k1 [B], k2 [B, steps]), k2[:, t] = row_keys(seeds, t)'s
    k2.

    A decode loop's rows keep their seeds and share the step: computed once per generate call, the ~90
    small integer ops of row_keys leave the per-token sampler, where on small logits (the demo's [32, 512])
    they are a large share of the eager chunked sampler's time.
    """
    seeds = seeds.to(torch.int64)
    seed_lo, seed_hi = seeds & MASK32, (seeds >> 32) & MASK32
    k1 = fmix32(seed_lo ^ fmix32(seed_hi ^ SEED_SALT))
    step_lo = torch.arange(steps, dtype=torch.int64, device=seeds.device)  # steps < 2**32: the high word is 0
    step_word = fmix32(step_lo ^ fmix32(torch.full_like(step_lo, STEP_SALT)))
    k2 = fmix32((k1[:, None] + step_word[None, :]) & MASK32)
    return k1, k2


def token_hash(k1: torch.Tensor, k2: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """32-bit hash per (row, vocab index): int64 [B, V] in [0, 2**32) from keys ``k1``, ``k2`` [B]."""
    j = _mul32(torch.arange(vocab_size, device=k1.device, dtype=torch.int64), GOLDEN)
    h = fmix32(j[None, :] ^ k2[:, None])
    return fmix32((h + k1[:, None]) & MASK32)


def uniforms_from_hash(h: torch.Tensor) -> torch.Tensor:
    """fp32 uniforms in [2**-24, 1 - 2**-24] from 32-bit hashes (int64 holding [0, 2**32)), same shape."""
    return ((h >> 9) * 2 + 1).to(torch.float32) * UNIFORM_SCALE


def gumbel_noise(k1: torch.Tensor, k2: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise fp32 [B, V]: -log(-log(u)); finite because u stays 2**-24 away from 0 and 1."""
    u = uniforms_from_hash(token_hash(k1, k2, vocab_size))
    return -torch.log(-torch.log(u))
