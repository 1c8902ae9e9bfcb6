// AVX2 helpers the kernels share: a float32 row read 8 lanes at a time (no mask registers), an operand check.
#pragma once

#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

// SLEEF's vector functions that torch's AVX2 kernels call, exported by libtorch_cpu.
extern "C" {
__m256 Sleef_logf8_u10(__m256);
__m256 Sleef_expf8_u10(__m256);
}

namespace avx2_rows {

constexpr int64_t kLanes = 8;

// A kernel's [N, D] operand: contiguous float32 on the CPU, or an error naming the op, the operand and its shape.
inline void check_matrix(const torch::Tensor& t, int64_t N, int64_t D, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == D && t.scalar_type() == torch::kFloat32 &&
                  t.is_contiguous() && t.device().is_cpu(),
              op, " (C++): ", name, " must be a contiguous float32 CPU [", N, ", ", D, "], got sizes ", t.sizes(),
              " dtype ", t.scalar_type());
}

// All-ones lanes for the row's columns j .. j + 7 that exist (left = V - j of them, at most 8 counted).
inline __m256i lanes_in_row(int64_t left) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(left, kLanes))), lane);
}

// x[j .. j + 7], -inf in the lanes past the row's end (those are never read).
inline __m256 load_row(const float* x, int64_t j, int64_t V, __m256i in_row) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  if (V - j >= kLanes) return _mm256_loadu_ps(x + j);
  return _mm256_blendv_ps(neg_inf, _mm256_maskload_ps(x + j, in_row), _mm256_castsi256_ps(in_row));
}

// The 8 lanes' sum, lane 0 first (the sampler's order, so its log-sum-exp and logprobs_avx2.cpp's agree).
inline float lane_sum(__m256 v) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += lanes[l];
  return sum;
}

// The 8 lanes' max (NaN lanes skipped: a NaN z makes the sum NaN whatever the max is).
inline float lane_max(__m256 v) {
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  float m = lanes[0];
  for (int l = 1; l < kLanes; ++l) {
    if (lanes[l] > m) m = lanes[l];
  }
  return m;
}

}  // namespace avx2_rows
