// The CPU kernels' entry points and the argument checks their AVX-512 and AVX2 builds share.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor blocked, int64_t out_features);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor mask,
                               double scale);
std::tuple<torch::Tensor, torch::Tensor> sample_tokens_cpu(torch::Tensor logits, torch::Tensor temperature,
                                                           torch::Tensor seeds, torch::Tensor steps,
                                                           torch::Tensor thresholds);
// Both builds (csrc/decode_loop.cpp is compiled into each): the fused decode loop; its arguments are there.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t> decode_loop(
    torch::Tensor first_logits, std::vector<torch::Tensor> layers, torch::Tensor embed, torch::Tensor norm,
    torch::Tensor lm_head, std::vector<torch::Tensor> k_cache, std::vector<torch::Tensor> v_cache, torch::Tensor cos,
    torch::Tensor sin_signed, torch::Tensor mask, torch::Tensor positions, int64_t first_slot,
    torch::Tensor temperature, torch::Tensor seeds, torch::Tensor ends, int64_t max_new_tokens, int64_t num_heads,
    int64_t num_kv_heads, double eps, torch::Tensor kept_logits);
// AVX2 build only (csrc/avx2/logprobs_avx2.cpp): kernels/logprobs.py's "cpp" path, the forward and backward
// kernels as one C++ autograd node: (log-prob or empty, entropy or empty).
std::tuple<torch::Tensor, torch::Tensor> logprobs_entropy(torch::Tensor logits, torch::Tensor index, double temperature,
                                                          bool want_entropy);
// AVX2 build only (csrc/avx2/rms_norm_avx2.cpp): kernels/rms_norm.py's "cpp" path, one C++ autograd node.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
// AVX2 build only (csrc/avx2/swiglu_avx2.cpp): kernels/swiglu.py's "cpp" path, silu(gate) * up as one C++
// autograd node.
torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up);
// AVX2 build only (csrc/avx2/rope_avx2.cpp): kernels/rope.py's "cpp" path, rotate-half RoPE of x [tokens, heads, D]
// with tables [tokens, D] as one C++ autograd node.
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin_signed);

// The raw-pointer pieces decode_loop chains without a tensor or a dispatch in between (each build has its own).
// skinny_linear over tiles [first_tile, last_tile) of column blocks (3 per tile in the AVX-512 build, 1 in the
// AVX2 one): y [M, N] (row stride N) = x [M, K] @ W^T; tile_rows is the rows a tile takes at a time. The
// weight blocked in float32, or in bfloat16 (its raw 16-bit images), widened to float32 as it is read.
int64_t skinny_linear_tile_count(int64_t blocks);
int64_t skinny_linear_tile_rows();
void skinny_linear_tiles(const float* x, int64_t M, int64_t K, const float* blocked, int64_t blocks, float* y,
                         int64_t N, int64_t first_tile, int64_t last_tile);
void skinny_linear_tiles(const float* x, int64_t M, int64_t K, const uint16_t* blocked, int64_t blocks, float* y,
                         int64_t N, int64_t first_tile, int64_t last_tile);
// decode_attention for one (row, KV head): q [G, D], keys/values rows `stride` apart, mask [L] additive,
// scores a scratch of G * round_up(L, 16) floats, out [G, D]. D a multiple of 16, at most 256. The AVX2 build's
// (csrc/avx2/decode_attention_avx2.cpp) serves decode_loop only.
void attend_pair(const float* q, int64_t G, int64_t D, const float* keys, int64_t key_stride, const float* values,
                 int64_t value_stride, const float* mask, int64_t L, float scale, float* scores, float* out);
// sample_tokens for one row of V logits (threshold kKeepAll: no kept set); writes the token and its log-prob.
constexpr int64_t kKeepAll = INT64_MIN;
// A row's temperature and kept-set threshold as both builds' row samplers take them.
struct RowSampling {
  float inv_t;     // 1 / T, or 1 for a greedy row (sampling.normalised_rows)
  bool noisy;      // Gumbel noise: not for greedy rows (T == 0)
  bool truncated;  // a kept set applies
  int32_t tau;     // its threshold key
};
inline RowSampling row_sampling(float temperature, int64_t threshold) {
  const bool greedy = temperature == 0.0f;
  // Keys are int32 images of floats: a threshold below int32 keeps every token.
  const bool truncated = threshold > std::numeric_limits<int32_t>::min();
  const auto tau = static_cast<int32_t>(truncated ? std::min<int64_t>(threshold, std::numeric_limits<int32_t>::max())
                                                  : 0);
  return {greedy ? 1.0f : 1.0f / temperature, !greedy, truncated, tau};
}
void sample_token_row(const float* logits, int64_t V, float temperature, int64_t seed, int64_t step, int64_t threshold,
                      int64_t* token, float* logprob);

// skinny_linear's inputs: x a contiguous float32 CPU [M, K]; the weight blocked as [ceil(N/16), K, 16] (float32
// or bfloat16) by kernels.skinny_linear.block_weight; out_features within its last block. Both builds read
// this layout.
inline void check_skinny_linear_args(const torch::Tensor& x, const torch::Tensor& blocked, int64_t out_features) {
  constexpr int64_t block = 16;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "skinny_linear: x must be a contiguous float32 CPU matrix [M, K], got sizes ", x.sizes(),
              " dtype ", x.scalar_type());
  TORCH_CHECK(blocked.dim() == 3 && blocked.size(2) == block && blocked.size(1) == x.size(1) &&
                  (blocked.scalar_type() == torch::kFloat32 || blocked.scalar_type() == torch::kBFloat16) &&
                  blocked.is_contiguous() && blocked.device().is_cpu(),
              "skinny_linear: the weight must be blocked as [ceil(N/16), K, 16] float32 or bfloat16 with K = ",
              x.size(1), " (kernels.skinny_linear.block_weight), got sizes ", blocked.sizes(), " dtype ",
              blocked.scalar_type());
  TORCH_CHECK(out_features > (blocked.size(0) - 1) * block && out_features <= blocked.size(0) * block,
              "skinny_linear: out_features ", out_features, " does not fit ", blocked.size(0), " blocks of 16");
}
