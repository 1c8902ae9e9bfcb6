// Rotate-half RoPE of float32 heads, forward and backward in one pass each (AVX2): kernels/rope.py's "cpp" path.
//
//   forward:   y = x * cos + roll(x, D/2) * sin_signed      (native/model.py's apply_rope: transformers' rotate_half)
//   backward:  dx = g * cos + roll(g * sin_signed, D/2)       (roll by half the head is its own inverse)
//
// torch runs apply_rope as roll (a cat of two slices), two broadcasting muls and an add, and its backward as a roll,
// two muls and an accumulation: ~10 operators per projection and layer, each a pass over [tokens, heads, D]. Here each
// direction is one pass, cos and sin read once per token for all its heads. Tokens are independent, so the split
// over threads changes no result.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>

#include "../kernels.h"
#include "rows_avx2.h"

// Each product rounded before the sum, as torch's separate mul and add round it: no fused multiply-add, so the
// node gives torch's bits.
#pragma GCC optimize("fp-contract=off")

namespace {

using avx2_rows::check_matrix;
using avx2_rows::kLanes;
// Tokens per parallel task: a token of 4 heads x 64 is ~50 ns of work.
constexpr int64_t kGrainTokens = 64;

void check_heads(const torch::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.dim() == 3 && t.size(2) % 2 == 0 && t.scalar_type() == torch::kFloat32 && t.is_contiguous() &&
                  t.device().is_cpu(),
              op, " (C++): ", name, " must be a contiguous float32 CPU [tokens, heads, D] with D even, got sizes ",
              t.sizes(), " dtype ", t.scalar_type());
}

// out = a * ca + b * sb over the first half and b * cb + a * sa over the second (a: x's first half, b: its second):
// the forward with (ca, cb, sa, sb) = (cos1, cos2, sin1, sin2) and the backward with (cos1, cos2, sin2, sin1) on the
// gradient, since dx1 = g1 * cos1 + g2 * sin2 and dx2 = g2 * cos2 + g1 * sin1.
void rotate_head(const float* in, const float* c, const float* s_first, const float* s_second, int64_t half,
                 float* out) {
  int64_t i = 0;
  for (; i + kLanes <= half; i += kLanes) {
    const __m256 a = _mm256_loadu_ps(in + i), b = _mm256_loadu_ps(in + half + i);
    const __m256 first = _mm256_add_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)),
                                       _mm256_mul_ps(b, _mm256_loadu_ps(s_first + i)));
    const __m256 second = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                        _mm256_mul_ps(a, _mm256_loadu_ps(s_second + i)));
    _mm256_storeu_ps(out + i, first);
    _mm256_storeu_ps(out + half + i, second);
  }
  for (; i < half; ++i) {
    const float a = in[i], b = in[half + i];
    out[i] = a * c[i] + b * s_first[i];
    out[half + i] = b * c[half + i] + a * s_second[i];
  }
}

torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed, bool backward) {
  const char* op = backward ? "rope_backward" : "rope_forward";
  check_heads(x, op, backward ? "grad" : "x");
  const int64_t N = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  check_matrix(cos, N, D, op, "cos");
  check_matrix(sin_signed, N, D, op, "sin_signed");
  auto out = torch::empty_like(x);
  const float *xs = x.data_ptr<float>(), *cs = cos.data_ptr<float>(), *ss = sin_signed.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, N, kGrainTokens, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n) {
      const float *c = cs + n * D, *s = ss + n * D;
      const float* s_first = backward ? s + half : s;
      const float* s_second = backward ? s : s + half;
      for (int64_t h = 0; h < H; ++h) {
        rotate_head(xs + (n * H + h) * D, c, s_first, s_second, half, os + (n * H + h) * D);
      }
    }
  });
  return out;
}

// One autograd node whose backward runs in C++ without the GIL (the RMSNorm node's reason: PPO's critic trains on a
// second Python thread beside the actor). cos and sin are tables: no gradient.
struct RopeFunction : public torch::autograd::Function<RopeFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin_signed) {
    auto c = cos.contiguous(), s = sin_signed.contiguous();
    ctx->save_for_backward({c, s});
    return rotate(x.contiguous(), c, s, false);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    if (!ctx->needs_input_grad(0)) return {torch::Tensor(), torch::Tensor(), torch::Tensor()};
    const auto saved = ctx->get_saved_variables();
    return {rotate(grads[0].contiguous(), saved[0], saved[1], true), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin_signed) {
  return RopeFunction::apply(x, cos, sin_signed);
}
