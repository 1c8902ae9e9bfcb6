// SwiGLU's product silu(gate) * up of float32 tensors, forward and backward in one pass each (AVX2): kernels/swiglu.py.
//
//   forward:   s = gate / (1 + exp(-gate));  out = s * up                          (F.silu's formula, then the product)
//   backward:  sig = 1 / (1 + exp(-gate));  d_up = grad * s;
//              d_gate = ((grad * up) * sig) * (1 + gate * (1 - sig))              (torch's silu_backward on grad * up)
//
// torch runs the pair as three operators forward (silu, mul; the product's result) and three backward (two muls and
// silu_backward), each a pass over [rows, intermediate] float32 blocks that no cache holds on a training step: at the
// RL benchmark's [640, 1024] each pass is ~0.5 ms on a 2-core AVX2 EPYC, memory-bound, and the node keeps silu(gate)
// alive for the backward as well. Here each direction reads its inputs once, and only gate and up are saved.
// Elements are independent, so the split over threads changes no result.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <tuple>

#include "../kernels.h"
#include "rows_avx2.h"

namespace {

using avx2_rows::kLanes;

// Elements per parallel task (whole 8-lane groups): ~10 us of work, well above a task's scheduling cost.
constexpr int64_t kGrainElements = 8192;

void check_block(const torch::Tensor& t, int64_t n, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu() && t.numel() == n, op,
              " (C++): ", name, " must be a contiguous float32 CPU tensor of ", n, " elements, got sizes ", t.sizes(),
              " dtype ", t.scalar_type());
}

// f(offset, count) over [0, n) in 8-lane groups split across threads; the last partial group (n % 8) in one call.
template <typename Body>
void for_lanes(int64_t n, Body body) {
  const int64_t groups = n / kLanes;
  at::parallel_for(0, groups, kGrainElements / kLanes, [&](int64_t first, int64_t last) {
    for (int64_t v = first; v < last; ++v) body(v * kLanes, kLanes);
  });
  if (n % kLanes) body(groups * kLanes, n % kLanes);
}

// Up to 8 floats as one vector (zeros past `count`) and back, so the tail goes through the same vector arithmetic.
inline __m256 load_lanes(const float* p, int64_t count) {
  if (count == kLanes) return _mm256_loadu_ps(p);
  alignas(32) float lanes[kLanes] = {};
  for (int64_t l = 0; l < count; ++l) lanes[l] = p[l];
  return _mm256_load_ps(lanes);
}

inline void store_lanes(float* p, __m256 v, int64_t count) {
  if (count == kLanes) return _mm256_storeu_ps(p, v);
  alignas(32) float lanes[kLanes];
  _mm256_store_ps(lanes, v);
  for (int64_t l = 0; l < count; ++l) p[l] = lanes[l];
}

}  // namespace

static torch::Tensor swiglu_forward(const torch::Tensor& gate, const torch::Tensor& up) {
  constexpr const char* op = "silu_mul_forward";
  const int64_t n = gate.numel();
  check_block(gate, n, op, "gate");
  check_block(up, n, op, "up");
  auto out = torch::empty_like(gate);
  const float *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for_lanes(n, [&](int64_t i, int64_t count) {
    const __m256 gv = load_lanes(g + i, count);
    const __m256 silu = _mm256_div_ps(gv, _mm256_add_ps(one, Sleef_expf8_u10(_mm256_sub_ps(zero, gv))));
    store_lanes(o + i, _mm256_mul_ps(silu, load_lanes(u + i, count)), count);
  });
  return out;
}

static std::tuple<torch::Tensor, torch::Tensor> swiglu_backward(const torch::Tensor& grad, const torch::Tensor& gate,
                                                                const torch::Tensor& up, bool want_gate, bool want_up) {
  constexpr const char* op = "silu_mul_backward";
  const int64_t n = gate.numel();
  check_block(grad, n, op, "grad");
  check_block(gate, n, op, "gate");
  check_block(up, n, op, "up");
  auto d_gate = want_gate ? torch::empty_like(gate) : torch::Tensor();
  auto d_up = want_up ? torch::empty_like(up) : torch::Tensor();
  const float *dy = grad.data_ptr<float>(), *g = gate.data_ptr<float>(), *u = up.data_ptr<float>();
  float* dg = want_gate ? d_gate.data_ptr<float>() : nullptr;
  float* du = want_up ? d_up.data_ptr<float>() : nullptr;
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  for_lanes(n, [&](int64_t i, int64_t count) {
    const __m256 gv = load_lanes(g + i, count), dyv = load_lanes(dy + i, count);
    const __m256 denom = _mm256_add_ps(one, Sleef_expf8_u10(_mm256_sub_ps(zero, gv)));
    if (du) store_lanes(du + i, _mm256_mul_ps(dyv, _mm256_div_ps(gv, denom)), count);
    if (dg) {
      const __m256 sig = _mm256_div_ps(one, denom);
      const __m256 d_silu = _mm256_mul_ps(dyv, load_lanes(u + i, count));
      const __m256 slope = _mm256_add_ps(one, _mm256_mul_ps(gv, _mm256_sub_ps(one, sig)));
      store_lanes(dg + i, _mm256_mul_ps(_mm256_mul_ps(d_silu, sig), slope), count);
    }
  });
  return {d_gate, d_up};
}

namespace {

// One autograd node whose backward runs in C++ without the GIL (the RMSNorm node's reason: PPO's critic trains on a
// second Python thread beside the actor).
struct SiluMulFunction : public torch::autograd::Function<SiluMulFunction> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up) {
    auto g = gate.contiguous(), u = up.contiguous();
    ctx->save_for_backward({g, u});
    return swiglu_forward(g, u);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const bool want_gate = ctx->needs_input_grad(0), want_up = ctx->needs_input_grad(1);
    if (!want_gate && !want_up) return {torch::Tensor(), torch::Tensor()};
    auto [d_gate, d_up] = swiglu_backward(grads[0].contiguous(), saved[0], saved[1], want_gate, want_up);
    return {d_gate, d_up};
  }
};

}  // namespace

torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(gate.sizes() == up.sizes(), "silu_mul (C++): gate and up must have one shape, got ", gate.sizes(),
              " and ", up.sizes());
  return SiluMulFunction::apply(gate, up);
}
