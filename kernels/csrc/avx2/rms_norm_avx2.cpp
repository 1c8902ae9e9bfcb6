// RMSNorm of float32 rows, forward and backward, one row in L1 at a time (AVX2): kernels/rms_norm.py's "cpp" path.
//
//   forward:  rstd = 1 / sqrt(mean(x^2) + eps);  y = (x * rstd) * w            (transformers' LlamaRMSNorm order)
//   backward: dot = sum(g * w * x);  dx = rstd * (g * w - x * rstd^2 * dot / H);  dw = sum over rows of g * (x * rstd)
//
// torch 2.13 differentiates F.rms_norm on CPU through its decomposition (pow, mean, add, rsqrt, two muls): six
// autograd nodes and ~35 operator calls per norm, 212 us forward+backward on a [640, 64] block (1 thread,
// Intel Xeon with AMX), against one call each way here. Every row is one thread's, its sums taken in a fixed lane
// order, and dw is summed over the rows in row order (threads split the columns, never the rows), so the
// results do not depend on the thread count: PPO's critic trains on its own thread with half the threads and
// must train bit for bit as it does in line.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "../kernels.h"
#include "rows_avx2.h"

namespace {

using avx2_rows::check_matrix;
using avx2_rows::kLanes;
using avx2_rows::lane_sum;

// Rows per parallel task: a 64-wide row is ~20 ns of work, so small tasks would be mostly scheduling.
constexpr int64_t kGrainRows = 64;
// Columns per task of dw's sum over rows (whole 8-lane groups).
constexpr int64_t kGrainColumns = 64;

void check_weight(const torch::Tensor& w, int64_t H, const char* op) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == H && w.scalar_type() == torch::kFloat32 && w.is_contiguous() &&
                  w.device().is_cpu(),
              op, " (C++): the weight must be a contiguous float32 CPU [", H, "], got sizes ", w.sizes());
}

// sum(a[i] * b[i]) over one row: 8 lanes, lane_sum's order, then the tail in order.
inline float row_dot(const float* a, const float* b, int64_t H) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= H; i += kLanes) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float sum = lane_sum(acc);
  for (; i < H; ++i) sum += a[i] * b[i];
  return sum;
}

// sum(g[i] * w[i] * x[i]) over one row, g * w rounded first as in dx.
inline float row_dot3(const float* g, const float* w, const float* x, int64_t H) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kLanes <= H; i += kLanes) {
    const __m256 gw = _mm256_mul_ps(_mm256_loadu_ps(g + i), _mm256_loadu_ps(w + i));
    acc = _mm256_fmadd_ps(gw, _mm256_loadu_ps(x + i), acc);
  }
  float sum = lane_sum(acc);
  for (; i < H; ++i) sum += (g[i] * w[i]) * x[i];
  return sum;
}

}  // namespace

static std::tuple<torch::Tensor, torch::Tensor> rms_norm_forward(torch::Tensor x, torch::Tensor weight, double eps) {
  constexpr const char* op = "rms_norm_forward";
  TORCH_CHECK(x.dim() == 2, op, " (C++): x must be [N, H], got sizes ", x.sizes());
  const int64_t N = x.size(0), H = x.size(1);
  check_matrix(x, N, H, op, "x");
  check_weight(weight, H, op);
  auto y = torch::empty({N, H}, x.options());
  auto rstd = torch::empty({N}, x.options());
  const float *xs = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float *ys = y.data_ptr<float>(), *rs = rstd.data_ptr<float>();
  const float inv_h = 1.0f / static_cast<float>(H), epsf = static_cast<float>(eps);
  at::parallel_for(0, N, kGrainRows, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = xs + r * H;
      float* out = ys + r * H;
      const float s = 1.0f / std::sqrt(row_dot(row, row, H) * inv_h + epsf);
      rs[r] = s;
      const __m256 sv = _mm256_set1_ps(s);
      int64_t i = 0;
      for (; i + kLanes <= H; i += kLanes) {
        const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(row + i), sv);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(normed, _mm256_loadu_ps(w + i)));
      }
      for (; i < H; ++i) out[i] = (row[i] * s) * w[i];
    }
  });
  return {y, rstd};
}

static std::tuple<torch::Tensor, torch::Tensor> rms_norm_backward(torch::Tensor grad, torch::Tensor x, torch::Tensor weight,
                                                           torch::Tensor rstd, bool want_weight_grad) {
  constexpr const char* op = "rms_norm_backward";
  TORCH_CHECK(x.dim() == 2, op, " (C++): x must be [N, H], got sizes ", x.sizes());
  const int64_t N = x.size(0), H = x.size(1);
  check_matrix(x, N, H, op, "x");
  check_matrix(grad, N, H, op, "grad");
  check_weight(weight, H, op);
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == N && rstd.scalar_type() == torch::kFloat32 && rstd.is_contiguous(),
              op, " (C++): rstd must be the forward's float32 [", N, "], got sizes ", rstd.sizes());
  auto dx = torch::empty({N, H}, x.options());
  auto dw = want_weight_grad ? torch::empty({H}, x.options()) : torch::empty({0}, x.options());
  const float *gs = grad.data_ptr<float>(), *xs = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  const float* rs = rstd.data_ptr<float>();
  float* dxs = dx.data_ptr<float>();
  const float inv_h = 1.0f / static_cast<float>(H);
  at::parallel_for(0, N, kGrainRows, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float *g = gs + r * H, *row = xs + r * H;
      float* out = dxs + r * H;
      const float s = rs[r];
      const float c = s * s * row_dot3(g, w, row, H) * inv_h;  // rstd^2 * dot / H
      const __m256 sv = _mm256_set1_ps(s), cv = _mm256_set1_ps(c);
      int64_t i = 0;
      for (; i + kLanes <= H; i += kLanes) {
        const __m256 gw = _mm256_mul_ps(_mm256_loadu_ps(g + i), _mm256_loadu_ps(w + i));
        const __m256 inner = _mm256_sub_ps(gw, _mm256_mul_ps(_mm256_loadu_ps(row + i), cv));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(sv, inner));
      }
      for (; i < H; ++i) out[i] = s * ((g[i] * w[i]) - row[i] * c);
    }
  });
  if (want_weight_grad) {
    float* dws = dw.data_ptr<float>();
    at::parallel_for(0, H, kGrainColumns, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) dws[i] = 0.0f;
      for (int64_t r = 0; r < N; ++r) {  // rows in order, whatever the split of the columns
        const float *g = gs + r * H, *row = xs + r * H;
        const float s = rs[r];
        for (int64_t i = first; i < last; ++i) dws[i] += g[i] * (row[i] * s);  // autograd's: g * (x * rstd)
      }
    });
  }
  return {dx, dw};
}

namespace {

// The kernels above as one autograd node whose backward runs in C++: a Python autograd.Function's backward takes
// the GIL, and on the demo's PPO step (actor and critic on two Python threads) waiting for it there made the
// train phase slower (52-54 against 48-50 ms) than torch's six-node graph, which never needs the GIL.
struct RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               double eps) {
    auto flat = x.reshape({-1, x.size(-1)}).contiguous();
    auto [out, rstd] = rms_norm_forward(flat, weight.contiguous(), eps);
    ctx->save_for_backward({flat, weight, rstd});
    return out.view(x.sizes());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& flat = saved[0];
    const bool want_weight = ctx->needs_input_grad(1);
    auto [grad_x, grad_weight] = rms_norm_backward(grads[0].reshape({-1, flat.size(1)}).contiguous(), flat,
                                                   saved[1].contiguous(), saved[2], want_weight);
    return {ctx->needs_input_grad(0) ? grad_x.view(grads[0].sizes()) : torch::Tensor(),
            want_weight ? grad_weight : torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(0), "rms_norm (C++): x [..., ", weight.size(0),
              "] for a weight of ", weight.size(0), ", got sizes ", x.sizes());
  return RmsNormFunction::apply(x, weight, eps);
}
