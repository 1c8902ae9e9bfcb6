// Per-token log-prob and entropy of float32 logits rows, forward and backward, one row in L1 at a time (AVX2).
//
// kernels/logprobs.py's torch reference runs log_softmax, gather, exp, mul and sum over [N, V] fp32 chunks in the
// forward and softmax, mul and scatter_add in the backward: ~6 passes over N * V floats, each a fresh tensor. Here
// a row (V = 2048: 8 KiB) is read from memory once per pass and revisited in L1:
//
//   forward: z = x * (1/T); m = max z; S = sum exp(z - m); W = sum exp(z - m) * (z - m)
//            lse = m + log S; logp = z[index] - lse; H = log S - W / S  (= -sum p log p; both terms >= 0)
//   backward: p = exp(z - lse); d/dx = -(p g_logp + p (log p + H) g_H) / T, plus g_logp / T at index
//
// The log-sum-exp is the AVX2 sampler's (sampling_avx2.cpp): the same lanes, shift and lane order, so at equal
// logits the training log-probs equal the engine's bit for bit. log p is clamped at the most negative float, as
// in the reference, so p log p = 0 where p = 0. Each row is one thread's, reduced in a fixed order: the results
// do not depend on the thread count. Why and how fast: kernels/logprobs.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>

#include "../kernels.h"
#include "rows_avx2.h"

namespace {

using avx2_rows::kLanes;
using avx2_rows::lanes_in_row;
using avx2_rows::load_row;

constexpr float kFloatMin = std::numeric_limits<float>::lowest();
// Rows per parallel task: a row is ~3 us of work at V = 2048 (1.7 ms forward for 496 rows, 1 thread), so smaller
// tasks would be mostly scheduling.
constexpr int64_t kGrainRows = 16;

struct RowStats {
  float lse;
  float entropy;
};

RowStats row_stats(const float* x, int64_t V, float inv_t, bool want_entropy) {
  const __m256 scale = _mm256_set1_ps(inv_t);
  __m256 z_max = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < V; j += kLanes) {
    z_max = _mm256_max_ps(z_max, _mm256_mul_ps(load_row(x, j, V, lanes_in_row(V - j)), scale));
  }
  float m = avx2_rows::lane_max(z_max);
  if (std::isinf(m)) m = 0.0f;  // as torch's logsumexp: shift by 0 where the max is infinite
  const __m256 shift = _mm256_set1_ps(m), lowest = _mm256_set1_ps(kFloatMin);
  __m256 total = _mm256_setzero_ps(), weighted = _mm256_setzero_ps();
  for (int64_t j = 0; j < V; j += kLanes) {
    const __m256 t = _mm256_sub_ps(_mm256_mul_ps(load_row(x, j, V, lanes_in_row(V - j)), scale), shift);
    const __m256 e = Sleef_expf8_u10(t);  // exp(-inf) = 0 past the row's end
    total = _mm256_add_ps(total, e);
    if (want_entropy) weighted = _mm256_add_ps(weighted, _mm256_mul_ps(e, _mm256_max_ps(t, lowest)));
  }
  const float sum = avx2_rows::lane_sum(total);
  const float log_sum = std::log(sum);
  return {log_sum + m, want_entropy ? log_sum - avx2_rows::lane_sum(weighted) / sum : 0.0f};
}

void grad_row(const float* x, float* g, int64_t V, float inv_t, float lse, float g_logp, float g_entropy,
              float entropy) {
  const __m256 scale = _mm256_set1_ps(inv_t), shift = _mm256_set1_ps(lse), lowest = _mm256_set1_ps(kFloatMin);
  const __m256 neg_a = _mm256_set1_ps(-g_logp), neg_b = _mm256_set1_ps(-g_entropy), h = _mm256_set1_ps(entropy);
  for (int64_t j = 0; j < V; j += kLanes) {
    const __m256i in_row = lanes_in_row(V - j);
    const __m256 log_p = _mm256_sub_ps(_mm256_mul_ps(load_row(x, j, V, in_row), scale), shift);
    const __m256 p = Sleef_expf8_u10(log_p);
    __m256 out = _mm256_mul_ps(p, neg_a);
    if (g_entropy != 0.0f) {
      // p (log p + H) first: where p = 0 it is 0, while g_H (log p + H) alone overflows to inf at log p = -FLT_MAX.
      const __m256 p_log_p = _mm256_mul_ps(p, _mm256_add_ps(_mm256_max_ps(log_p, lowest), h));
      out = _mm256_add_ps(out, _mm256_mul_ps(p_log_p, neg_b));
    }
    if (V - j >= kLanes) {
      _mm256_storeu_ps(g + j, out);
    } else {
      _mm256_maskstore_ps(g + j, in_row, out);
    }
  }
}

void check_logits(const torch::Tensor& logits, const char* op) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu() && logits.size(1) > 0 && logits.size(1) < (int64_t{1} << 31) - kLanes,
              op, " (C++): logits must be a contiguous float32 CPU [N, V] tensor with 0 < V < 2**31 - 8, got sizes ",
              logits.sizes(), " dtype ", logits.scalar_type());
}

// A [N] tensor of `type` on the CPU, or an empty one for "not given".
const void* optional_rows(const torch::Tensor& t, int64_t N, torch::ScalarType type, const char* op, const char* name) {
  if (t.numel() == 0) return nullptr;
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N && t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu(),
              op, " (C++): ", name, " must be empty or a contiguous ", type, " CPU tensor of shape [", N,
              "], got sizes ", t.sizes(), " dtype ", t.scalar_type());
  return t.data_ptr();
}

}  // namespace

static std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> logprobs_entropy_forward(torch::Tensor logits, torch::Tensor index,
                                                                                 double temperature, bool want_entropy) {
  constexpr const char* op = "logprobs_entropy_forward";
  check_logits(logits, op);
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto* idx = static_cast<const int64_t*>(optional_rows(index, N, torch::kInt64, op, "index"));
  auto rows = logits.options();
  auto lse = torch::empty({N}, rows);
  auto logp = idx ? torch::empty({N}, rows) : torch::empty({0}, rows);
  auto entropy = want_entropy ? torch::empty({N}, rows) : torch::empty({0}, rows);
  const float inv_t = 1.0f / static_cast<float>(temperature);  // as the sampler: float32 T, then its reciprocal
  const float* x = logits.data_ptr<float>();
  float *lse_out = lse.data_ptr<float>(), *logp_out = logp.data_ptr<float>(), *ent_out = entropy.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* row = x + r * V;
      const RowStats s = row_stats(row, V, inv_t, want_entropy);
      lse_out[r] = s.lse;
      if (idx) {
        TORCH_CHECK(idx[r] >= 0 && idx[r] < V, op, " (C++): index ", idx[r], " of row ", r, " is outside [0, ", V, ")");
        logp_out[r] = row[idx[r]] * inv_t - s.lse;
      }
      if (want_entropy) ent_out[r] = s.entropy;
    }
  });
  return {logp, entropy, lse};
}

static torch::Tensor logprobs_entropy_backward(torch::Tensor logits, torch::Tensor index, torch::Tensor lse,
                                        torch::Tensor entropy, torch::Tensor grad_logp, torch::Tensor grad_entropy,
                                        double temperature) {
  constexpr const char* op = "logprobs_entropy_backward";
  check_logits(logits, op);
  const int64_t N = logits.size(0), V = logits.size(1);
  const auto* lse_in = static_cast<const float*>(optional_rows(lse, N, torch::kFloat32, op, "lse"));
  TORCH_CHECK(lse_in != nullptr, op, " (C++): lse is required (the forward's third output)");
  const auto* g_logp = static_cast<const float*>(optional_rows(grad_logp, N, torch::kFloat32, op, "grad_logp"));
  const auto* idx = static_cast<const int64_t*>(optional_rows(index, N, torch::kInt64, op, "index"));
  TORCH_CHECK(g_logp == nullptr || idx != nullptr, op, " (C++): grad_logp needs the index it is the log-prob of");
  const auto* g_ent = static_cast<const float*>(optional_rows(grad_entropy, N, torch::kFloat32, op, "grad_entropy"));
  const auto* ent = static_cast<const float*>(optional_rows(entropy, N, torch::kFloat32, op, "entropy"));
  TORCH_CHECK(g_ent == nullptr || ent != nullptr, op, " (C++): grad_entropy needs the forward's entropy");
  auto grad = torch::empty({N, V}, logits.options());
  const float inv_t = 1.0f / static_cast<float>(temperature);  // as the sampler: float32 T, then its reciprocal
  const float* x = logits.data_ptr<float>();
  float* g = grad.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float a = g_logp ? g_logp[r] * inv_t : 0.0f;
      const float b = g_ent ? g_ent[r] * inv_t : 0.0f;
      grad_row(x + r * V, g + r * V, V, inv_t, lse_in[r], a, b, ent ? ent[r] : 0.0f);
      if (g_logp) g[r * V + idx[r]] += a;
    }
  });
  return grad;
}

namespace {

// The two kernels as one autograd node whose backward runs in C++ (kernels/logprobs.py's "cpp" path): a Python
// autograd.Function's backward takes the GIL, which the PPO critic's thread, training beside the actor's, holds
// much of the time (the same change to RMSNorm: kernels/rms_norm.py).
struct LogprobsEntropyFunction : public torch::autograd::Function<LogprobsEntropyFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, torch::Tensor logits,
                                                torch::Tensor index, double temperature, bool want_entropy) {
    ctx->set_materialize_grads(false);  // an unused output's gradient stays undefined: no pass for it
    auto [logp, entropy, lse] = logprobs_entropy_forward(logits, index, temperature, want_entropy);
    ctx->save_for_backward({logits, index, lse, entropy});
    ctx->saved_data["temperature"] = temperature;
    return {logp, entropy};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &logits = saved[0], &index = saved[1], &lse = saved[2], &entropy = saved[3];
    const torch::Tensor none;
    const bool with_logp = grads[0].defined() && index.numel() > 0;
    const bool with_entropy = grads[1].defined() && entropy.numel() > 0;
    if (!ctx->needs_input_grad(0) || (!with_logp && !with_entropy)) return {none, none, none, none};
    const auto no_rows = torch::empty({0}, lse.options());
    auto grad = logprobs_entropy_backward(
        logits, with_logp ? index : torch::empty({0}, index.options()), lse, with_entropy ? entropy : no_rows,
        with_logp ? grads[0].reshape({-1}).contiguous() : no_rows,
        with_entropy ? grads[1].reshape({-1}).contiguous() : no_rows, ctx->saved_data["temperature"].toDouble());
    return {grad, none, none, none};
  }
};

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> logprobs_entropy(torch::Tensor logits, torch::Tensor index, double temperature,
                                                          bool want_entropy) {
  auto outputs = LogprobsEntropyFunction::apply(logits, index, temperature, want_entropy);
  return {outputs[0], outputs[1]};
}
