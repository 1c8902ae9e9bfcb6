// y[M, N] = x[M, K] @ W[N, K]^T in float32 for a decode step's few rows, streaming W near memory bandwidth.
//
// W is float32, or bfloat16 (engine.cpu_linear_weights): then each 16-column load reads 32 bytes, widened to
// float32 exactly (a bf16 is a float32's upper half), and the same fused multiply-add chain follows, so the
// result equals the float32 kernel's on the bf16-rounded weight bit for bit, at half the bytes streamed.
//
// W is pre-blocked as [ceil(N / 16), K, 16] (column block, k, 16 output columns; the last block is
// zero-padded), so one 64-byte load at each k gives 16 output columns. A tile of 3 column blocks x
// up to 8 rows keeps 24 AVX-512 accumulators: per k, 3 weight loads and 8 broadcasts of x feed 24
// fused multiply-adds. More rows are done 8 at a time over the same 3 blocks, by then in L2. Each
// thread takes whole tiles of columns. Why and how fast: kernels/skinny_linear.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>

#include "kernels.h"

namespace {

constexpr int64_t kBlock = 16;      // output columns per AVX-512 register
constexpr int64_t kTileBlocks = 3;  // column blocks per tile: 3 x 8 beat 2 x 8, 4 x 6 and 4 x 4
constexpr int64_t kTileRows = 8;
constexpr int64_t kPrefetch = 64;   // k steps ahead (4 KB per block): 64 beat 16 by ~10%

inline void store_columns(float* y, __m512 value, int64_t columns_left) {
  if (columns_left >= kBlock) {
    _mm512_storeu_ps(y, value);
  } else if (columns_left > 0) {
    _mm512_mask_storeu_ps(y, static_cast<__mmask16>((1u << columns_left) - 1u), value);
  }
}

// 16 weights of one block row as float32: a plain load, or 16 bfloat16 widened (shifted into the upper half).
inline __m512 load_weights(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 load_weights(const uint16_t* w) {
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

template <int ROWS, int BLOCKS, typename W>
void tile(const float* x, int64_t K, const W* w, float* y, int64_t N, int64_t column) {
  __m512 acc[BLOCKS][ROWS];
  for (int b = 0; b < BLOCKS; ++b) {
    for (int r = 0; r < ROWS; ++r) acc[b][r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    __m512 v[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b) {
      const W* wk = w + b * K * kBlock + k * kBlock;
      _mm_prefetch(reinterpret_cast<const char*>(wk + kPrefetch * kBlock), _MM_HINT_T0);
      v[b] = load_weights(wk);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 xr = _mm512_set1_ps(x[r * K + k]);
      for (int b = 0; b < BLOCKS; ++b) acc[b][r] = _mm512_fmadd_ps(xr, v[b], acc[b][r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int b = 0; b < BLOCKS; ++b) {
      store_columns(y + r * N + column + b * kBlock, acc[b][r], N - column - b * kBlock);
    }
  }
}

template <int BLOCKS, typename W>
void rows_of_tile(int rows, const float* x, int64_t K, const W* w, float* y, int64_t N, int64_t column) {
  switch (rows) {
    case 1: return tile<1, BLOCKS>(x, K, w, y, N, column);
    case 2: return tile<2, BLOCKS>(x, K, w, y, N, column);
    case 3: return tile<3, BLOCKS>(x, K, w, y, N, column);
    case 4: return tile<4, BLOCKS>(x, K, w, y, N, column);
    case 5: return tile<5, BLOCKS>(x, K, w, y, N, column);
    case 6: return tile<6, BLOCKS>(x, K, w, y, N, column);
    case 7: return tile<7, BLOCKS>(x, K, w, y, N, column);
    default: return tile<8, BLOCKS>(x, K, w, y, N, column);
  }
}

template <typename W>
void tiles(const float* x, int64_t M, int64_t K, const W* blocked, int64_t blocks, float* y, int64_t N,
           int64_t first_tile, int64_t last_tile) {
  for (int64_t t = first_tile; t < last_tile; ++t) {
    const int64_t block = t * kTileBlocks;
    const int64_t width = std::min(kTileBlocks, blocks - block);
    const W* w = blocked + block * K * kBlock;
    for (int64_t row = 0; row < M; row += kTileRows) {
      const int rows = static_cast<int>(std::min(kTileRows, M - row));
      const float* xr = x + row * K;
      float* yr = y + row * N;
      if (width == 3) {
        rows_of_tile<3>(rows, xr, K, w, yr, N, block * kBlock);
      } else if (width == 2) {
        rows_of_tile<2>(rows, xr, K, w, yr, N, block * kBlock);
      } else {
        rows_of_tile<1>(rows, xr, K, w, yr, N, block * kBlock);
      }
    }
  }
}

}  // namespace

int64_t skinny_linear_tile_count(int64_t blocks) { return (blocks + kTileBlocks - 1) / kTileBlocks; }

int64_t skinny_linear_tile_rows() { return kTileRows; }

void skinny_linear_tiles(const float* x, int64_t M, int64_t K, const float* blocked, int64_t blocks, float* y,
                         int64_t N, int64_t first_tile, int64_t last_tile) {
  tiles(x, M, K, blocked, blocks, y, N, first_tile, last_tile);
}

void skinny_linear_tiles(const float* x, int64_t M, int64_t K, const uint16_t* blocked, int64_t blocks, float* y,
                         int64_t N, int64_t first_tile, int64_t last_tile) {
  tiles(x, M, K, blocked, blocks, y, N, first_tile, last_tile);
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
