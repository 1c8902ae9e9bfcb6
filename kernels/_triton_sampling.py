"""Triton kernel behind sampling.py: one program per row, thresholds found by search instead of a sort.

Per row the kernel streams the vocabulary several times:

* prologue: 1/T, the off switches and the two hash keys from the raw per-row parameters;
* pass A: logsumexp of z = logits * (1/T) (for the returned log-prob), max/min order key;
* top-k (if on): the k-th largest key, by a 16-way search over the int32 key range: each pass
  counts, for 16 candidate keys at once, how many logits are >= each; 8-9 passes pin a 32-bit key;
* top-p (if on): one pass for the surviving mass, then the same search on mass instead of count;
* final pass: Gumbel-max over the kept set (noise from rng.py's hash, recomputed here in uint32),
  first index on ties.

So a row costs 2 passes with both filters off and up to ~21 with both on. The searches produce the
same thresholds as sampling.kept_thresholds: exactly for top-k, and for top-p unless a cumulative
mass lies within fp32 rounding of its target (the reference sums fixed-point masses exactly, the
kernel sums fp32). Import only after deciding whether
TRITON_INTERPRET=1 applies (see _triton_dispatch.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from alignflow.kernels._triton_dispatch import check_kernel_mode
from alignflow.kernels.sampling import SamplingRows

# Same constants as rng.py (a test compares them and the hashes they produce).
_FMIX_M1 = tl.constexpr(0x85EBCA6B)
_FMIX_M2 = tl.constexpr(0xC2B2AE35)
_GOLDEN = tl.constexpr(0x9E3779B1)
_SEED_SALT = tl.constexpr(0x243F6A88)
_STEP_SALT = tl.constexpr(0x85A308D3)
_UNIFORM_SCALE = tl.constexpr(2.0**-24)

# 16 candidates x 1024 logits per search step = 64 fp32 values per thread at 8 warps. On CPU (the
# interpreter, one Python step per block) 4096 cuts the Python overhead 4x.
_NUM_CANDIDATES = 16
_BLOCK_V_GPU = 1024
_BLOCK_V_INTERPRETER = 4096
_NUM_WARPS = 8


@triton.jit
def _ordered_key(x):
    """int32 key with the order of fp32 x: sign-magnitude bits turned two's-complement-ordered."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _fmix32(h):
    h = h ^ (h >> 16)
    h = h * _FMIX_M1
    h = h ^ (h >> 13)
    h = h * _FMIX_M2
    return h ^ (h >> 16)


@triton.jit
def _row_keys(seed, step):
    """rng.row_keys for one row: int64 seed and step -> uint32 keys (k1, k2)."""
    seed_lo = seed.to(tl.uint32)  # truncation keeps the low word, as `& MASK32` in torch
    seed_hi = (seed >> 32).to(tl.uint32)  # arithmetic shift, as torch's >> on int64
    step_lo = step.to(tl.uint32)
    step_hi = (step >> 32).to(tl.uint32)
    k1 = _fmix32(seed_lo ^ _fmix32(seed_hi ^ _SEED_SALT))
    step_word = _fmix32(step_lo ^ _fmix32(step_hi ^ _STEP_SALT))
    k2 = _fmix32(k1 + step_word)
    return k1, k2


@triton.jit
def _token_uniform(cols, k1, k2):
    """Uniforms in [2**-24, 1 - 2**-24] for vocab indices ``cols`` under row keys k1, k2 (uint32)."""
    h = cols.to(tl.uint32) * _GOLDEN
    h = _fmix32(h ^ k2)
    h = _fmix32(h + k1)
    return ((h >> 9) * 2 + 1).to(tl.float32) * _UNIFORM_SCALE


@triton.jit
def _weight_at_least(
    base, V, cand, floor_key, z_max, inv_t, MASS: tl.constexpr, BLOCK_V: tl.constexpr, NC: tl.constexpr
):
    """acc[i] = sum of w_j over j with key_j >= cand[i] and key_j >= floor_key; w = 1 or exp(z_j - z_max)."""
    acc = tl.zeros([NC], dtype=tl.float32)
    offs = tl.arange(0, BLOCK_V)
    for start in range(0, V, BLOCK_V):
        mask = start + offs < V
        x = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
        key = _ordered_key(x).to(tl.int64)
        ok = mask & (key >= floor_key)
        if MASS:
            w = tl.where(ok, tl.exp(x * inv_t - z_max), 0.0)
        else:
            w = tl.where(ok, 1.0, 0.0)
        hit = key[None, :] >= cand[:, None]
        acc += tl.sum(tl.where(hit, w[None, :], 0.0), axis=1)
    return acc


@triton.jit
def _search_threshold(
    base,
    V,
    lo,
    hi,
    target,
    floor_key,
    z_max,
    inv_t,
    MASS: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NC: tl.constexpr,
):
    """Largest key t in [lo, hi) with weight_at_least(t) >= target, given it holds at lo and fails at hi."""
    lane = tl.arange(0, NC).to(tl.int64)
    while hi - lo > 1:
        step = (hi - lo + NC - 1) // NC
        cand = lo + lane * step
        f = _weight_at_least(base, V, cand, floor_key, z_max, inv_t, MASS, BLOCK_V, NC)
        # f never increases with the candidate (sums of fewer non-negative terms, rounding is monotone),
        # so the candidates that pass form a prefix; lane 0 (= lo) always passes.
        ok = (f >= target) & (cand < hi)
        best = tl.max(tl.where(ok, lane, 0), 0)
        new_lo = lo + best * step
        hi = tl.minimum(new_lo + step, hi)
        lo = new_lo
    return lo


@triton.jit
def _sample_kernel(
    logits_ptr,
    stride_row,
    temperature_ptr,
    top_k_ptr,
    top_p_ptr,
    seeds_ptr,
    steps_ptr,
    tokens_ptr,
    logprobs_ptr,
    tau_ptr,
    V,
    BLOCK_V: tl.constexpr,
    NC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    # Per-row parameters, derived exactly as sampling.normalised_rows and rng.row_keys do in torch
    # (in-kernel so that a decode step is one launch, not ~70 tiny torch ops).
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    # IEEE 1/T, as torch
    inv_t = tl.where(greedy, 1.0, tl.math.div_rn(1.0, tl.where(greedy, 1.0, temperature)))
    noise_scale = tl.where(greedy, 0.0, 1.0)
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    top_k = tl.where(greedy | (top_k >= V), 0, top_k)
    top_p = tl.where(greedy, 1.0, tl.load(top_p_ptr + row))
    k1, k2 = _row_keys(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    offs = tl.arange(0, BLOCK_V)

    # Pass A: logsumexp of z over the full vocabulary, and the key range.
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    key_min = tl.full([], 2147483647, tl.int32)
    key_max = tl.full([], -2147483648, tl.int32)
    for start in range(0, V, BLOCK_V):
        mask = start + offs < V
        x = tl.load(base + start + offs, mask=mask, other=float("-inf")).to(tl.float32)
        z = x * inv_t
        key = _ordered_key(x)
        key_min = tl.minimum(key_min, tl.min(tl.where(mask, key, 2147483647), 0))
        key_max = tl.maximum(key_max, tl.max(tl.where(mask, key, -2147483648), 0))
        m_new = tl.maximum(m, tl.max(z, 0))
        alpha = tl.where(m == float("-inf"), 0.0, tl.exp(m - m_new))
        s = s * alpha + tl.sum(tl.where(z > float("-inf"), tl.exp(z - m_new), 0.0), 0)
        m = m_new
    lse = m + tl.log(s)

    # Kept-set threshold: all keys >= tau survive.
    tau = key_min.to(tl.int64)
    hi = key_max.to(tl.int64) + 1
    if top_k > 0:
        tau = _search_threshold(base, V, tau, hi, top_k.to(tl.float32), tau, m, inv_t, False, BLOCK_V, NC)
    if top_p < 1.0:
        lane = tl.arange(0, NC)
        surviving = _weight_at_least(
            base, V, tl.zeros([NC], dtype=tl.int64) + tau, tau, m, inv_t, True, BLOCK_V, NC
        )
        total = tl.sum(tl.where(lane == 0, surviving, 0.0), 0)
        tau = _search_threshold(base, V, tau, hi, top_p * total, tau, m, inv_t, True, BLOCK_V, NC)
    tl.store(tau_ptr + row, tau)

    # Final pass: Gumbel-max over the kept set (greedy rows: noise_scale = 0, plain argmax).
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        cols = start + offs
        mask = cols < V
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        kept = mask & (_ordered_key(x).to(tl.int64) >= tau)
        u = _token_uniform(cols, k1, k2)
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(kept, x * inv_t + gumbel * noise_scale, float("-inf"))
        block_best = tl.max(score, 0)
        block_arg = tl.argmax(score, 0, tie_break_left=True)
        better = block_best > best  # strict: earlier blocks win ties, as torch.argmax's first index
        best_idx = tl.where(better, start + block_arg.to(tl.int64), best_idx)
        best = tl.where(better, block_best, best)
    z_tok = tl.load(base + best_idx).to(tl.float32) * inv_t
    tl.store(tokens_ptr + row, best_idx)
    tl.store(logprobs_ptr + row, z_tok - lse)


@triton.jit
def _uniform_kernel(seeds_ptr, steps_ptr, out_ptr, V, BLOCK_V: tl.constexpr):
    """Test hook: the uniforms the sampler draws for row program_id(0), to compare with rng.py bit for bit."""
    row = tl.program_id(0).to(tl.int64)
    k1, k2 = _row_keys(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        tl.store(out_ptr + row * V + cols, _token_uniform(cols, k1, k2), mask=cols < V)


def _block_v(device: torch.device, vocab: int) -> int:
    block = _BLOCK_V_GPU if device.type == "cuda" else _BLOCK_V_INTERPRETER
    return min(block, triton.next_power_of_2(vocab))


def sample(logits: torch.Tensor, rows: SamplingRows) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as sampling.sample_torch: (tokens int64 [B], logprobs fp32 [B],
    threshold keys int64 [B])."""
    check_kernel_mode(_sample_kernel, logits.device, "sample_tokens")
    batch, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    tokens = torch.empty(batch, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(batch, dtype=torch.float32, device=logits.device)
    tau = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        _sample_kernel[(batch,)](
            logits,
            logits.stride(0),
            rows.temperature.contiguous(),
            rows.top_k.contiguous(),
            rows.top_p.contiguous(),
            rows.seeds.contiguous(),
            rows.steps.contiguous(),
            tokens,
            logprobs,
            tau,
            vocab,
            BLOCK_V=_block_v(logits.device, vocab),
            NC=_NUM_CANDIDATES,
            num_warps=_NUM_WARPS,
        )
    return tokens, logprobs, tau


def uniforms(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 [B, V] uniforms from the kernel's hash, keys derived in-kernel (tests compare with rng.py)."""
    check_kernel_mode(_uniform_kernel, seeds.device, "uniforms")
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32, device=seeds.device)
    if seeds.shape[0]:
        _uniform_kernel[(seeds.shape[0],)](
            seeds.to(torch.int64).contiguous(),
            steps.to(torch.int64).contiguous(),
            out,
            vocab,
            BLOCK_V=_block_v(seeds.device, vocab),
        )
    return out
