// The AVX2 build of csrc/skinny_linear.cpp: y[M, N] = x[M, K] @ W[N, K]^T in float32 for a decode step's few rows.
//
// The same blocked weight, [ceil(N / 16), K, 16] (kernels.skinny_linear.block_weight), so one layout serves
// both builds: a 16-column block is two 8-float AVX2 registers. AVX2 has 16 of them, so a tile is one block x
// up to 6 rows: 12 accumulators, 2 weight loads and 1 broadcast of x per k feed 12 fused multiply-adds (the
// 6 x 16 shape of AVX2 GEMM micro-kernels). More rows run 6 at a time over the same block, by then in L1
// (K = 256 gives 16 KiB). Each thread takes whole blocks. Each output is one fused multiply-add chain over k
// in order, as in the AVX-512 build, so the two builds give the same bits. A bfloat16 weight is widened to
// float32 as it is read (8 bf16 per register, shifted into the upper half: exact), as there. Why and how fast:
// kernels/skinny_linear.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "../kernels.h"

namespace {

constexpr int64_t kBlock = 16;     // output columns per block: two AVX2 registers
constexpr int64_t kTileRows = 6;   // 6 rows x 2 registers = 12 accumulators of the 16 registers
constexpr int64_t kPrefetch = 32;  // k steps ahead (2 KB of the block)

inline void store_columns(float* y, __m256 low, __m256 high, int64_t columns_left) {
  if (columns_left >= kBlock) {
    _mm256_storeu_ps(y, low);
    _mm256_storeu_ps(y + 8, high);
    return;
  }
  alignas(32) float lanes[kBlock];
  _mm256_store_ps(lanes, low);
  _mm256_store_ps(lanes + 8, high);
  for (int64_t c = 0; c < columns_left; ++c) y[c] = lanes[c];
}

// 8 weights as float32: a plain load, or 8 bfloat16 widened.
inline __m256 load_weights(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load_weights(const uint16_t* w) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// One block x `rows` (1-6) rows. Always 6 accumulator pairs in named registers (GCC kept an array of them on
// the stack, storing all 12 every k, at half the speed); rows past `rows` repeat the last row's x and are not
// stored.
template <typename W>
void tile(int rows, const float* x, int64_t K, const W* w, float* y, int64_t N, int64_t column) {
  const float* x0 = x;
  const float* x1 = x + std::min(1, rows - 1) * K;
  const float* x2 = x + std::min(2, rows - 1) * K;
  const float* x3 = x + std::min(3, rows - 1) * K;
  const float* x4 = x + std::min(4, rows - 1) * K;
  const float* x5 = x + std::min(5, rows - 1) * K;
  __m256 l0 = _mm256_setzero_ps(), h0 = l0, l1 = l0, h1 = l0, l2 = l0, h2 = l0;
  __m256 l3 = l0, h3 = l0, l4 = l0, h4 = l0, l5 = l0, h5 = l0;
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * kBlock), _MM_HINT_T0);
    const __m256 wl = load_weights(wk);
    const __m256 wh = load_weights(wk + 8);
    // One row: broadcast x[r, k], one fused multiply-add into each of its two accumulators.
#define ALIGNFLOW_ROW(r)                                   \
  {                                                        \
    const __m256 xr = _mm256_broadcast_ss(x##r + k);       \
    l##r = _mm256_fmadd_ps(xr, wl, l##r);                  \
    h##r = _mm256_fmadd_ps(xr, wh, h##r);                  \
  }
    ALIGNFLOW_ROW(0) ALIGNFLOW_ROW(1) ALIGNFLOW_ROW(2) ALIGNFLOW_ROW(3) ALIGNFLOW_ROW(4) ALIGNFLOW_ROW(5)
#undef ALIGNFLOW_ROW
  }
  const int64_t columns_left = N - column;
  const __m256 lows[kTileRows] = {l0, l1, l2, l3, l4, l5}, highs[kTileRows] = {h0, h1, h2, h3, h4, h5};
  for (int r = 0; r < rows; ++r) store_columns(y + r * N + column, lows[r], highs[r], columns_left);
}

template <typename W>
void tiles(const float* x, int64_t M, int64_t K, const W* blocked, float* y, int64_t N, int64_t first_tile,
           int64_t last_tile) {
  for (int64_t block = first_tile; block < last_tile; ++block) {
    const W* w = blocked + block * K * kBlock;
    for (int64_t row = 0; row < M; row += kTileRows) {
      const int rows = static_cast<int>(std::min(kTileRows, M - row));
      tile(rows, x + row * K, K, w, y + row * N, N, block * kBlock);
    }
  }
}

}  // namespace

int64_t skinny_linear_tile_count(int64_t blocks) { return blocks; }  // a tile is one block here

int64_t skinny_linear_tile_rows() { return kTileRows; }

void skinny_linear_tiles(const float* x, int64_t M, int64_t K, const float* blocked, int64_t, float* y,
                         int64_t N, int64_t first_tile, int64_t last_tile) {
  tiles(x, M, K, blocked, y, N, first_tile, last_tile);
}

void skinny_linear_tiles(const float* x, int64_t M, int64_t K, const uint16_t* blocked, int64_t, float* y,
                         int64_t N, int64_t first_tile, int64_t last_tile) {
  tiles(x, M, K, blocked, y, N, first_tile, last_tile);
}

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor blocked, int64_t out_features) {
  check_skinny_linear_args(x, blocked, out_features);
  const int64_t M = x.size(0), K = x.size(1), N = out_features, blocks = blocked.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool bf16 = blocked.scalar_type() == torch::kBFloat16;
  const float* wp = bf16 ? nullptr : blocked.data_ptr<float>();
  const uint16_t* hp = bf16 ? reinterpret_cast<const uint16_t*>(blocked.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, skinny_linear_tile_count(blocks), 1, [&](int64_t first, int64_t last) {
    if (bf16) {
      skinny_linear_tiles(xp, M, K, hp, blocks, yp, N, first, last);
    } else {
      skinny_linear_tiles(xp, M, K, wp, blocks, yp, N, first, last);
    }
  });
  return y;
}
