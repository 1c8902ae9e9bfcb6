// One sampled token per row of [B, V] float32 logits and its log-prob, in one AVX-512 pass per row.
//
// The rule is kernels/sampling.py's (its module docstring): z = logits * (1/T); score = z + Gumbel
// noise (none for greedy rows, T == 0); optional kept set {j : key(logits_j) >= tau}; the token is
// the first index of the maximal score; its log-prob is z[token] - logsumexp(z) over the whole row.
// The noise is rng.py's counter hash, in uint32 vector arithmetic, and -log(-log(u)) through the same
// SLEEF log that torch's AVX-512 kernels call (exported by libtorch_cpu), so the noise and hence the
// tokens equal the torch reference's bit for bit; the log-sum-exp sums in another order, so log-probs
// agree to within a few fp32 ulps. Why and how fast: kernels/sampling.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "kernels.h"

extern "C" {
__m512 Sleef_logf16_u10(__m512);
__m512 Sleef_expf16_u10(__m512);
}

namespace {

// rng.py's constants (a test checks they agree).
constexpr uint32_t kFmixM1 = 0x85EBCA6Bu;
constexpr uint32_t kFmixM2 = 0xC2B2AE35u;
constexpr uint32_t kGolden = 0x9E3779B1u;
constexpr uint32_t kSeedSalt = 0x243F6A88u;
constexpr uint32_t kStepSalt = 0x85A308D3u;
constexpr float kUniformScale = 1.0f / 16777216.0f;  // 2**-24
constexpr int64_t kLanes = 16;

uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= kFmixM1;
  h ^= h >> 13;
  h *= kFmixM2;
  return h ^ (h >> 16);
}

__m512i fmix32(__m512i h) {
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kFmixM1)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kFmixM2)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

// rng.row_keys: every bit of the 64-bit seed and step enters (k1, k2).
std::pair<uint32_t, uint32_t> row_keys(int64_t seed, int64_t step) {
  const auto s = static_cast<uint64_t>(seed), t = static_cast<uint64_t>(step);
  const uint32_t k1 = fmix32(static_cast<uint32_t>(s) ^ fmix32(static_cast<uint32_t>(s >> 32) ^ kSeedSalt));
  const uint32_t step_word = fmix32(static_cast<uint32_t>(t) ^ fmix32(static_cast<uint32_t>(t >> 32) ^ kStepSalt));
  return {k1, fmix32(k1 + step_word)};
}

// rng.gumbel_noise for vocabulary indices j .. j + 15.
__m512 gumbel(__m512i j, __m512i k1, __m512i k2) {
  __m512i h = _mm512_mullo_epi32(j, _mm512_set1_epi32(static_cast<int>(kGolden)));
  h = fmix32(_mm512_xor_si512(h, k2));
  h = fmix32(_mm512_add_epi32(h, k1));
  // u = (2 * (h >> 9) + 1) * 2**-24: below 2**24, so the int -> float conversion is exact.
  const __m512i odd = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(h, 9), 1), _mm512_set1_epi32(1));
  const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(odd), _mm512_set1_ps(kUniformScale));
  const __m512 neg_log_u = _mm512_sub_ps(_mm512_setzero_ps(), Sleef_logf16_u10(u));
  return _mm512_sub_ps(_mm512_setzero_ps(), Sleef_logf16_u10(neg_log_u));
}

// sampling.ordered_keys32: int32 keys with the order of the float32 values.
__m512i ordered_keys(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i flip = _mm512_and_si512(_mm512_srai_epi32(bits, 31), _mm512_set1_epi32(0x7FFFFFFF));
  return _mm512_xor_si512(bits, flip);
}

struct RowResult {
  int64_t token;
  float logprob;
};

RowResult sample_row(const float* x, int64_t V, float inv_t, bool noisy, uint32_t k1, uint32_t k2,
                     bool truncated, int32_t tau) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const __m512 scale = _mm512_set1_ps(inv_t);
  const __m512i key1 = _mm512_set1_epi32(static_cast<int>(k1)), key2 = _mm512_set1_epi32(static_cast<int>(k2));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i threshold = _mm512_set1_epi32(tau);
  // Per lane: the best score so far and its index (strictly greater wins: the first index on ties;
  // a NaN beats any number, as in torch.argmax), and the running max of z. Lane l starts at index l
  // with -inf, so a row whose kept scores are all -inf gives index 0, as torch.argmax does; lanes at
  // or past V (a row shorter than 16) are skipped in the final reduction.
  __m512 best = _mm512_set1_ps(neg_inf);
  __m512i best_index = lane;
  __m512 z_max = _mm512_set1_ps(neg_inf);
  for (int64_t j = 0; j < V; j += kLanes) {
    const int64_t left = V - j;
    const __mmask16 in_row = left >= kLanes ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 xs = _mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), in_row, x + j);
    const __m512 z = _mm512_mul_ps(xs, scale);
    z_max = _mm512_mask_max_ps(z_max, in_row, z_max, z);
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(j)), lane);
    __m512 score = noisy ? _mm512_add_ps(z, gumbel(index, key1, key2)) : z;
    __mmask16 candidates = in_row;
    if (truncated) candidates &= _mm512_cmp_epi32_mask(ordered_keys(xs), threshold, _MM_CMPINT_NLT);
    score = _mm512_mask_blend_ps(candidates, _mm512_set1_ps(neg_inf), score);
    const __mmask16 score_nan = _mm512_cmp_ps_mask(score, score, _CMP_UNORD_Q);
    const __mmask16 best_nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    // Lanes past the row's end never take over.
    const __mmask16 better =
        in_row & (_mm512_cmp_ps_mask(score, best, _CMP_GT_OQ) | (score_nan & static_cast<__mmask16>(~best_nan)));
    best = _mm512_mask_blend_ps(better, best, score);
    best_index = _mm512_mask_blend_epi32(better, best_index, index);
  }
  alignas(64) float best_values[kLanes];
  alignas(64) int32_t best_indices[kLanes];
  _mm512_store_ps(best_values, best);
  _mm512_store_epi32(best_indices, best_index);
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
  float m = _mm512_reduce_max_ps(z_max);
  if (std::isinf(m)) m = 0.0f;
  const __m512 shift = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < V; j += kLanes) {
    const int64_t left = V - j;
    const __mmask16 in_row = left >= kLanes ? static_cast<__mmask16>(0xFFFF)
                                            : static_cast<__mmask16>((1u << left) - 1u);
    const __m512 z = _mm512_mul_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(neg_inf), in_row, x + j), scale);
    total = _mm512_add_ps(total, Sleef_expf16_u10(_mm512_sub_ps(z, shift)));
  }
  const float lse = std::log(_mm512_reduce_add_ps(total)) + m;
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
              "sample_tokens (C++): logits must be a contiguous float32 CPU [B, V] tensor with 0 < V < 2**31 - 16, "
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
