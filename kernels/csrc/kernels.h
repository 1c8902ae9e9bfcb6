// The CPU kernels' entry points and the argument checks their AVX-512 and AVX2 builds share.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <tuple>

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor blocked, int64_t out_features);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor mask,
                               double scale);
std::tuple<torch::Tensor, torch::Tensor> sample_tokens_cpu(torch::Tensor logits, torch::Tensor temperature,
                                                           torch::Tensor seeds, torch::Tensor steps,
                                                           torch::Tensor thresholds);
// AVX2 build only (csrc/avx2/logprobs_avx2.cpp): kernels/logprobs.py's "cpp" path, the forward and backward
// kernels as one C++ autograd node: (log-prob or empty, entropy or empty).
std::tuple<torch::Tensor, torch::Tensor> logprobs_entropy(torch::Tensor logits, torch::Tensor index, double temperature,
                                                          bool want_entropy);
// AVX2 build only (csrc/avx2/rms_norm_avx2.cpp): kernels/rms_norm.py's "cpp" path, one C++ autograd node.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);

// skinny_linear's inputs: x a contiguous float32 CPU [M, K]; the weight blocked as [ceil(N/16), K, 16] by
// kernels.skinny_linear.block_weight; out_features within its last block. Both builds read this layout.
inline void check_skinny_linear_args(const torch::Tensor& x, const torch::Tensor& blocked, int64_t out_features) {
  constexpr int64_t block = 16;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "skinny_linear: x must be a contiguous float32 CPU matrix [M, K], got sizes ", x.sizes(),
              " dtype ", x.scalar_type());
  TORCH_CHECK(blocked.dim() == 3 && blocked.size(2) == block && blocked.size(1) == x.size(1) &&
                  blocked.scalar_type() == torch::kFloat32 && blocked.is_contiguous() && blocked.device().is_cpu(),
              "skinny_linear: the weight must be blocked as [ceil(N/16), K, 16] float32 with K = ", x.size(1),
              " (kernels.skinny_linear.block_weight), got sizes ", blocked.sizes());
  TORCH_CHECK(out_features > (blocked.size(0) - 1) * block && out_features <= blocked.size(0) * block,
              "skinny_linear: out_features ", out_features, " does not fit ", blocked.size(0), " blocks of 16");
}
