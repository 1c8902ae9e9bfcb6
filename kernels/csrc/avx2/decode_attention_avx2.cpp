// The AVX2 build of decode_attention's (row, KV head) body, for csrc/decode_loop.cpp on CPUs without AVX-512.
//
// out[g] = softmax_l(scale * q[g] . K[l] + mask[l]) @ V[l] over L cached keys, softmax in float32, as
// csrc/decode_attention.cpp computes it: each key row is read once and scored against all G queries of its KV
// group, then the values are streamed once for all of them, 2 queries' accumulators at a time (D <= 256 is
// 32 registers of 8 lanes per query, so more would only spill). exp through SLEEF (torch's AVX2 exp); the
// 8-lane sums are taken in lane order (rows_avx2.h). There is no torch op of this build: the engine's torch
// step keeps the torch attention on AVX2 CPUs.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "../kernels.h"
#include "rows_avx2.h"

namespace {

using avx2_rows::kLanes;
using avx2_rows::lane_sum;

constexpr int kMaxChunks = 32;  // D <= 256
constexpr int64_t kQueriesPerPass = 2;

}  // namespace

void attend_pair(const float* q, int64_t G, int64_t D, const float* keys, int64_t key_stride, const float* values,
                 int64_t value_stride, const float* mask, int64_t L, float scale, float* scores, float* out) {
  const int chunks = static_cast<int>(D / kLanes);
  const int64_t padded_l = (L + 15) / 16 * 16;  // the scratch's row length (kernels.h)
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t l = 0; l < L; ++l) {
    __m256 k[kMaxChunks];
    for (int c = 0; c < chunks; ++c) k[c] = _mm256_loadu_ps(keys + l * key_stride + c * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(q + g * D), k[0]);
      for (int c = 1; c < chunks; ++c) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + c * kLanes), k[c], acc);
      scores[g * padded_l + l] = lane_sum(acc) * scale + mask[l];
    }
  }
  // Softmax per query over whole 8-lane groups: the lanes past L hold -inf, whose exp is exactly 0.
  const int64_t whole = (L + kLanes - 1) / kLanes * kLanes;
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * padded_l;
    std::fill(s + L, s + whole, neg_inf);
    float top = neg_inf;
    for (int64_t l = 0; l < L; ++l) top = std::max(top, s[l]);
    const __m256 row_max = _mm256_set1_ps(top);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t l = 0; l < whole; l += kLanes) {
      const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_loadu_ps(s + l), row_max));
      _mm256_storeu_ps(s + l, e);
      sum = _mm256_add_ps(sum, e);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / lane_sum(sum));
    for (int64_t l = 0; l < whole; l += kLanes) _mm256_storeu_ps(s + l, _mm256_mul_ps(_mm256_loadu_ps(s + l), inv));
  }
  for (int64_t g0 = 0; g0 < G; g0 += kQueriesPerPass) {
    const int64_t gn = std::min<int64_t>(kQueriesPerPass, G - g0);
    __m256 acc[kQueriesPerPass][kMaxChunks];
    for (int64_t g = 0; g < gn; ++g) {
      for (int c = 0; c < chunks; ++c) acc[g][c] = _mm256_setzero_ps();
    }
    for (int64_t l = 0; l < L; ++l) {
      for (int c = 0; c < chunks; ++c) {
        const __m256 v = _mm256_loadu_ps(values + l * value_stride + c * kLanes);
        for (int64_t g = 0; g < gn; ++g) {
          acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(scores[(g0 + g) * padded_l + l]), v, acc[g][c]);
        }
      }
    }
    for (int64_t g = 0; g < gn; ++g) {
      for (int c = 0; c < chunks; ++c) _mm256_storeu_ps(out + (g0 + g) * D + c * kLanes, acc[g][c]);
    }
  }
}
