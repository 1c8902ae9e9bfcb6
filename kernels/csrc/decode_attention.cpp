// One decode step's attention in float32: each query attends to its row's cached keys and values.
//
// q [B, kv_heads, G, D] (G query heads share a KV head), keys/values [B, kv_heads, L, D] (views of the
// KV cache: any strides over B, kv_heads and L, contiguous over D), mask [B, L] additive (0 / -inf).
// out[b, h, g] = softmax_l(scale * q[b, h, g] . K[b, h, l] + mask[b, l]) @ V[b, h, l], softmax in float32
// as transformers does. The step is bound by reading K and V once; each (b, h) pair reads its keys row
// by row, scores all G queries against each, then streams the values once for all G. Why: see
// kernels/decode_attention.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int kMaxChunks = 16;  // D <= 256
constexpr int64_t kPrefetchRows = 16;

// exp(x) for a vector: 2^(x log2 e) = 2^n * 2^f, f in [-0.5, 0.5], 2^f by a degree-6 polynomial
// (truncation term ~1e-7 relative for |f| <= 0.5); x below -87.3 gives exactly 0, as exp(-inf).
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.3f), _CMP_LT_OQ);
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), log2e);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188319500e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440266574e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357674640e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471162809e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791363012e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028550421e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), _mm512_scalef_ps(p, n));
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

}  // namespace

void attend_pair(const float* qbh, int64_t G, int64_t D, const float* kbh, int64_t ksl, const float* vbh,
                 int64_t vsl, const float* mb, int64_t L, float fscale, float* scores, float* obh) {
  const int chunks = static_cast<int>(D / kLanes);
  const int64_t padded_l = (L + kLanes - 1) / kLanes * kLanes;
  // Scores: each key row is read once and scored against every query of the group.
  for (int64_t l = 0; l < L; ++l) {
    // Software prefetch: the next key rows, and this row's values for the output pass below (the
    // hardware prefetcher stops at 4 KB pages, and a (b, h) block is only a few pages long).
    for (int c = 0; c < chunks; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(kbh + (l + kPrefetchRows) * ksl + c * kLanes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vbh + l * vsl + c * kLanes), _MM_HINT_T0);
    }
    __m512 k[kMaxChunks];
    for (int c = 0; c < chunks; ++c) k[c] = _mm512_loadu_ps(kbh + l * ksl + c * kLanes);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qbh + g * D), k[0]);
      for (int c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qbh + g * D + c * kLanes), k[c], acc);
      scores[g * padded_l + l] = _mm512_reduce_add_ps(acc) * fscale + mb[l];
    }
  }
  // Softmax per query, vectorised over keys.
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * padded_l;
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t l = 0; l < L; l += kLanes) {
      vmax = _mm512_mask_max_ps(vmax, tail_mask(L - l), vmax, _mm512_maskz_loadu_ps(tail_mask(L - l), s + l));
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; l += kLanes) {
      const __mmask16 m = tail_mask(L - l);
      const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + l), row_max)));
      _mm512_mask_storeu_ps(s + l, m, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(vsum);
    for (int64_t l = 0; l < L; l += kLanes) {
      const __mmask16 m = tail_mask(L - l);
      _mm512_mask_storeu_ps(s + l, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + l), _mm512_set1_ps(inv)));
    }
  }
  // Output: the values are streamed once for all G queries, 4 queries' accumulators at a time.
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    const int64_t gn = std::min<int64_t>(4, G - g0);
    __m512 acc[4][kMaxChunks];
    for (int64_t g = 0; g < gn; ++g) {
      for (int c = 0; c < chunks; ++c) acc[g][c] = _mm512_setzero_ps();
    }
    for (int64_t l = 0; l < L; ++l) {
      for (int c = 0; c < chunks; ++c) {
        const __m512 v = _mm512_loadu_ps(vbh + l * vsl + c * kLanes);
        for (int64_t g = 0; g < gn; ++g) {
          acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(g0 + g) * padded_l + l]), v, acc[g][c]);
        }
      }
    }
    for (int64_t g = 0; g < gn; ++g) {
      for (int c = 0; c < chunks; ++c) _mm512_storeu_ps(obh + (g0 + g) * D + c * kLanes, acc[g][c]);
    }
  }
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values, torch::Tensor mask,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && keys.dim() == 4 && values.dim() == 4 && mask.dim() == 2,
              "decode_attention: expected q [B, H, G, D], keys/values [B, H, L, D], mask [B, L]");
  for (const auto& t : {q, keys, values, mask}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu(), "decode_attention: float32 CPU tensors only");
  }
  const int64_t B = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3), L = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == H && keys.size(3) == D && values.sizes() == keys.sizes(),
              "decode_attention: keys/values ", keys.sizes(), " / ", values.sizes(), " do not match q ", q.sizes());
  TORCH_CHECK(mask.size(0) == B && mask.size(1) == L, "decode_attention: mask ", mask.sizes(), " is not [B, L] = [",
              B, ", ", L, "]");
  TORCH_CHECK(D % kLanes == 0 && D / kLanes <= kMaxChunks, "decode_attention: head_dim ", D,
              " must be a multiple of 16, at most 256");
  TORCH_CHECK(keys.stride(3) == 1 && values.stride(3) == 1, "decode_attention: keys/values must be contiguous over D");
  auto qc = q.contiguous();
  auto maskc = mask.contiguous();
  auto out = torch::empty({B, H, G, D}, q.options());
  const float* qp = qc.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const float* vp = values.data_ptr<float>();
  const float* mp = maskc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ksb = keys.stride(0), ksh = keys.stride(1), ksl = keys.stride(2);
  const int64_t vsb = values.stride(0), vsh = values.stride(1), vsl = values.stride(2);
  const float fscale = static_cast<float>(scale);
  const int64_t padded_l = (L + kLanes - 1) / kLanes * kLanes;

  at::parallel_for(0, B * H, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(G * padded_l);
    for (int64_t pair = first; pair < last; ++pair) {
      const int64_t b = pair / H, h = pair % H;
      attend_pair(qp + (b * H + h) * G * D, G, D, kp + b * ksb + h * ksh, ksl, vp + b * vsb + h * vsh, vsl,
                  mp + b * L, L, fscale, scores.data(), op + (b * H + h) * G * D);
    }
  });
  return out;
}
