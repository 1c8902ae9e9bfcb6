// The AVX2 build of csrc/sampling.cpp's sampler, for CPUs without AVX-512, as its own torch extension.
//
// Same rule and the same results as the AVX-512 kernel (kernels/sampling.py's module docstring): z = logits * (1/T);
// score = z + Gumbel noise (none for greedy rows, T == 0); optional kept set {j : key(logits_j) >= tau}; the token
// is the first index of the maximal score; its log-prob is z[token] - logsumexp(z) over the whole row. The noise is
// rng.py's counter hash in uint32 arithmetic, 8 lanes at a time, and -log(-log(u)) through the SLEEF log that
// torch's AVX2 kernels call (Sleef_logf8_u10, exported by libtorch_cpu), so noise and tokens equal the torch
// reference's bit for bit on an AVX2 CPU; the log-sum-exp sums in another order (a few fp32 ulps). AVX2 has no
// mask registers: a row's tail is loaded under a lane mask and filled with -inf, and every mask is a vector.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "../kernels.h"
#include "rows_avx2.h"

namespace {

// rng.py's constants (a test checks they agree).
constexpr uint32_t kFmixM1 = 0x85EBCA6Bu;
constexpr uint32_t kFmixM2 = 0xC2B2AE35u;
constexpr uint32_t kGolden = 0x9E3779B1u;
constexpr uint32_t kSeedSalt = 0x243F6A88u;
constexpr uint32_t kStepSalt = 0x85A308D3u;
constexpr float kUniformScale = 1.0f / 16777216.0f;  // 2**-24
using avx2_rows::kLanes;
using avx2_rows::lanes_in_row;
using avx2_rows::load_row;

uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= kFmixM1;
  h ^= h >> 13;
  h *= kFmixM2;
  return h ^ (h >> 16);
}

__m256i fmix32(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kFmixM1)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kFmixM2)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// rng.row_keys: every bit of the 64-bit seed and step enters (k1, k2).
std::pair<uint32_t, uint32_t> row_keys(int64_t seed, int64_t step) {
  const auto s = static_cast<uint64_t>(seed), t = static_cast<uint64_t>(step);
  const uint32_t k1 = fmix32(static_cast<uint32_t>(s) ^ fmix32(static_cast<uint32_t>(s >> 32) ^ kSeedSalt));
  const uint32_t step_word = fmix32(static_cast<uint32_t>(t) ^ fmix32(static_cast<uint32_t>(t >> 32) ^ kStepSalt));
  return {k1, fmix32(k1 + step_word)};
}

// rng.gumbel_noise for vocabulary indices j .. j + 7.
__m256 gumbel(__m256i j, __m256i k1, __m256i k2) {
  __m256i h = _mm256_mullo_epi32(j, _mm256_set1_epi32(static_cast<int>(kGolden)));
  h = fmix32(_mm256_xor_si256(h, k2));
  h = fmix32(_mm256_add_epi32(h, k1));
  // u = (2 * (h >> 9) + 1) * 2**-24: below 2**24, so the int -> float conversion is exact.
  const __m256i odd = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(h, 9), 1), _mm256_set1_epi32(1));
  const __m256 u = _mm256_mul_ps(_mm256_cvtepi32_ps(odd), _mm256_set1_ps(kUniformScale));
  const __m256 neg_log_u = _mm256_sub_ps(_mm256_setzero_ps(), Sleef_logf8_u10(u));
  return _mm256_sub_ps(_mm256_setzero_ps(), Sleef_logf8_u10(neg_log_u));
}

// sampling.ordered_keys32: int32 keys with the order of the float32 values.
__m256i ordered_keys(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i flip = _mm256_and_si256(_mm256_srai_epi32(bits, 31), _mm256_set1_epi32(0x7FFFFFFF));
  return _mm256_xor_si256(bits, flip);
}

struct RowResult {
  int64_t token;
  float logprob;
};

RowResult sample_row(const float* x, int64_t V, float inv_t, bool noisy, uint32_t k1, uint32_t k2,
                     bool truncated, int32_t tau) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m256 scale = _mm256_set1_ps(inv_t);
  const __m256 neg_infs = _mm256_set1_ps(neg_inf);
  const __m256i key1 = _mm256_set1_epi32(static_cast<int>(k1)), key2 = _mm256_set1_epi32(static_cast<int>(k2));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i threshold = _mm256_set1_epi32(tau);
  // Per lane: the best score so far and its index (strictly greater wins: the first index on ties; a NaN beats
  // any number, as in torch.argmax), and the running max of z. Lane l starts at index l with -inf, so a row
  // whose kept scores are all -inf gives index 0, as torch.argmax does; lanes at or past V (a row shorter
  // than 8) are skipped in the final reduction.
  __m256 best = neg_infs;
  __m256i best_index = lane;
  __m256 z_max = neg_infs;
  for (int64_t j = 0; j < V; j += kLanes) {
    const __m256i in_row = lanes_in_row(V - j);
    const __m256 in_row_ps = _mm256_castsi256_ps(in_row);
    const __m256 xs = load_row(x, j, V, in_row);
    const __m256 z = _mm256_mul_ps(xs, scale);
    z_max = _mm256_blendv_ps(z_max, _mm256_max_ps(z_max, z), in_row_ps);
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(j)), lane);
    __m256 score = noisy ? _mm256_add_ps(z, gumbel(index, key1, key2)) : z;
    __m256 candidates = in_row_ps;
    if (truncated) {  // keys >= tau, i.e. not tau > keys
      const __m256i below = _mm256_cmpgt_epi32(threshold, ordered_keys(xs));
      candidates = _mm256_andnot_ps(_mm256_castsi256_ps(below), candidates);
    }
    score = _mm256_blendv_ps(neg_infs, score, candidates);
    const __m256 score_nan = _mm256_cmp_ps(score, score, _CMP_UNORD_Q);
    const __m256 best_nan = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
    // Lanes past the row's end never take over.
    const __m256 better = _mm256_and_ps(
        in_row_ps, _mm256_or_ps(_mm256_cmp_ps(score, best, _CMP_GT_OQ), _mm256_andnot_ps(best_nan, score_nan)));
    best = _mm256_blendv_ps(best, score, better);
    best_index = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(best_index), _mm256_castsi256_ps(index), better));
  }
  alignas(32) float best_values[kLanes];
  alignas(32) int32_t best_indices[kLanes];
  _mm256_store_ps(best_values, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(best_indices), best_index);
  int64_t token = std::numeric_limits<int32_t>::max();
  float top = neg_inf;
  bool top_nan = false;
  for (int l = 0; l < kLanes; ++l) {
    const float v = best_values[l];
    const int64_t i = best_indices[l];
    if (i >= V) continue;
    const bool v_nan = std::isnan(v);
    if (top_nan) {
      if (v_nan && i < token) token = i;
    } else if (v_nan || v > top || (v == top && i < token)) {
      token = i;
      top = v;
      top_nan = v_nan;
    }
  }
  // logsumexp(z) as torch computes it: shift by the max (by 0 where the max is infinite).
  float m = avx2_rows::lane_max(z_max);
  if (std::isinf(m)) m = 0.0f;
  const __m256 shift = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < V; j += kLanes) {
    const __m256 z = _mm256_mul_ps(load_row(x, j, V, lanes_in_row(V - j)), scale);
    total = _mm256_add_ps(total, Sleef_expf8_u10(_mm256_sub_ps(z, shift)));  // exp(-inf) = 0 past the row's end
  }
  const float lse = std::log(avx2_rows::lane_sum(total)) + m;
  return {token, x[token] * inv_t - lse};
}

}  // namespace

void sample_token_row(const float* x, int64_t V, float temperature, int64_t seed, int64_t step, int64_t threshold,
                      int64_t* token, float* logprob) {
  const RowSampling how = row_sampling(temperature, threshold);
  const auto [k1, k2] = row_keys(seed, step);
  const RowResult r = sample_row(x, V, how.inv_t, how.noisy, k1, k2, how.truncated, how.tau);
  *token = r.token;
  *logprob = r.logprob;
}

std::tuple<torch::Tensor, torch::Tensor> sample_tokens_cpu(torch::Tensor logits, torch::Tensor temperature,
                                                           torch::Tensor seeds, torch::Tensor steps,
                                                           torch::Tensor thresholds) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31) - kLanes,
              "sample_tokens (C++): logits must be a contiguous float32 CPU [B, V] tensor with 0 < V < 2**31 - 8, "
              "got sizes ", logits.sizes(), " dtype ", logits.scalar_type());
  const int64_t B = logits.size(0), V = logits.size(1);
  auto check_rows = [&](const torch::Tensor& t, torch::ScalarType type, const char* name) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == B && t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu(),
                "sample_tokens (C++): ", name, " must be a contiguous ", type, " CPU tensor of shape [", B,
                "], got sizes ", t.sizes(), " dtype ", t.scalar_type());
  };
  check_rows(temperature, torch::kFloat32, "temperature");
  check_rows(seeds, torch::kInt64, "seeds");
  check_rows(steps, torch::kInt64, "steps");
  const bool truncated = thresholds.numel() > 0;
  if (truncated) check_rows(thresholds, torch::kInt64, "thresholds");
  auto tokens = torch::empty({B}, logits.options().dtype(torch::kInt64));
  auto logprobs = torch::empty({B}, logits.options());
  const float* x = logits.data_ptr<float>();
  const float* temp = temperature.data_ptr<float>();
  const int64_t* seed = seeds.data_ptr<int64_t>();
  const int64_t* step = steps.data_ptr<int64_t>();
  const int64_t* tau = truncated ? thresholds.data_ptr<int64_t>() : nullptr;
  int64_t* token_out = tokens.data_ptr<int64_t>();
  float* logprob_out = logprobs.data_ptr<float>();
  at::parallel_for(0, B, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      sample_token_row(x + b * V, V, temp[b], seed[b], step[b], truncated ? tau[b] : kKeepAll, token_out + b,
                       logprob_out + b);
    }
  });
  return {tokens, logprobs};
}
