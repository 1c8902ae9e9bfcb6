// A Llama-family float32 model's whole decode loop in one call: sample, stop check, forward, repeat.
//
// The engine's eager loop (stages/common/generation/native/engine.py) pays Python and the dispatcher for each of
// a decode step's ~280 operator calls; on the demo model (hidden 64, 2 layers, 32 rows) that is nearly all
// of its ~0.7 ms per step. Here the step is the same arithmetic through the same kernels, called by
// pointer: skinny_linear's tiles on the blocked weights (kernels/skinny_linear.py), decode_attention's
// (row, KV head) body, the sampler's row function (so the tokens are a function of the logits exactly as
// in sample_tokens), plus RMSNorm, RoPE and SiLU written out here. Why and how fast:
// kernels/decode_loop.py. Compiled into both extensions: the AVX-512 one (its pieces in csrc/) and the AVX2
// one (csrc/avx2/: the AVX2 skinny_linear, sampler and attention body; RMSNorm and SiLU in 8 lanes below).
//
// Threads: one OpenMP team for the whole call. Row-wise work (sampling, norms, RoPE, the cache write,
// attention, SiLU) is shared by rows, each linear by (column tile, tile rows) pieces; every `omp for` ends in
// a barrier, ~15 per step. The stop decision is taken by one thread (`omp single`) and read by all after
// its barrier, so every thread leaves the loop at the same step.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

#ifdef __AVX512F__
extern "C" {
__m512 Sleef_expf16_u10(__m512);
}
#else
#include "avx2/rows_avx2.h"
#endif

namespace {

constexpr int64_t kLanes = 16;  // of the blocked weight layout (both builds)
// Per layer, in `layers`: ln_attn [H], qkv (blocked), qkv bias [Q + 2 KV] or empty, o (blocked), ln_mlp [H],
// gate_up (blocked), down (blocked). kernels/decode_loop.py builds the list.
constexpr int64_t kPerLayer = 7;

// A blocked linear weight: float32 (w), or bfloat16 (h, engine.cpu_linear_weights: half the bytes a step reads).
struct Blocked {
  const float* w;
  const uint16_t* h;
  int64_t blocks, K, N;
};

// "qkv of layer 3", or the name alone for a tensor of the whole model (layer -1).
std::string named(const char* what, int64_t layer) {
  return layer >= 0 ? std::string(what) + " of layer " + std::to_string(layer) : std::string(what);
}

void check_float(const torch::Tensor& t, const char* what, int64_t layer) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.device().is_cpu(), "decode_loop: ",
              named(what, layer), " must be a contiguous float32 CPU tensor, got dtype ", t.scalar_type(), " sizes ",
              t.sizes());
}

Blocked blocked(const torch::Tensor& t, int64_t K, int64_t N, const char* what, int64_t layer) {
  const bool bf16 = t.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || t.scalar_type() == torch::kFloat32) && t.is_contiguous() && t.device().is_cpu(),
              "decode_loop: ", named(what, layer), " must be a contiguous float32 or bfloat16 CPU tensor, got dtype ",
              t.scalar_type(), " sizes ", t.sizes());
  TORCH_CHECK(t.dim() == 3 && t.size(0) == (N + kLanes - 1) / kLanes && t.size(1) == K && t.size(2) == kLanes,
              "decode_loop: ", named(what, layer), " must be blocked as [", (N + kLanes - 1) / kLanes, ", ", K,
              ", 16] (kernels.skinny_linear.block_weight of a [", N, ", ", K, "] weight), got ", t.sizes());
  if (bf16) return {nullptr, reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()), t.size(0), K, N};
  return {t.data_ptr<float>(), nullptr, t.size(0), K, N};
}

const float* vector_of(const torch::Tensor& t, int64_t n, const char* what, int64_t layer) {
  check_float(t, what, layer);
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, "decode_loop: ", named(what, layer), " must be [", n, "], got ",
              t.sizes());
  return t.data_ptr<float>();
}

// y [M, N] = x [M, K] @ W^T, shared by the team in (tile, tile rows) pieces; ends in the omp for's barrier.
void linear(const float* x, int64_t M, const Blocked& l, float* y) {
  const int64_t tiles = skinny_linear_tile_count(l.blocks), rows = skinny_linear_tile_rows();
  const int64_t row_pieces = (M + rows - 1) / rows;
#pragma omp for schedule(static)
  for (int64_t piece = 0; piece < tiles * row_pieces; ++piece) {
    const int64_t tile = piece / row_pieces, row = piece % row_pieces * rows;
    if (l.h != nullptr) {
      skinny_linear_tiles(x + row * l.K, std::min(rows, M - row), l.K, l.h, l.blocks, y + row * l.N, l.N, tile,
                          tile + 1);
    } else {
      skinny_linear_tiles(x + row * l.K, std::min(rows, M - row), l.K, l.w, l.blocks, y + row * l.N, l.N, tile,
                          tile + 1);
    }
  }
}

#ifdef __AVX512F__
// transformers' LlamaRMSNorm in float32: (x * (1 / sqrt(mean(x^2) + eps))) * w.
void rms_norm_row(const float* x, const float* w, int64_t H, float eps, float* out) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  float sum = _mm512_reduce_add_ps(acc);
  for (; i < H; ++i) sum += x[i] * x[i];
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  for (i = 0; i < H; ++i) out[i] = (x[i] * rstd) * w[i];
}

// act = silu(gate) * up = gate / (1 + exp(-gate)) * up, as F.silu computes it.
void silu_mul_row(const float* gate, const float* up, int64_t n, float* act) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), g));
    const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, e));
    _mm512_mask_storeu_ps(act + i, m, _mm512_mul_ps(s, _mm512_maskz_loadu_ps(m, up + i)));
  }
}
#else
// The same two in 8 lanes (AVX2): the sum of squares in rows_avx2.h's lane order, the tails one by one.
void rms_norm_row(const float* x, const float* w, int64_t H, float eps, float* out) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float sum = avx2_rows::lane_sum(acc);
  for (; i < H; ++i) sum += x[i] * x[i];
  const float rstd = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  for (i = 0; i < H; ++i) out[i] = (x[i] * rstd) * w[i];
}

void silu_mul_row(const float* gate, const float* up, int64_t n, float* act) {
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(act + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) act[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}
#endif

// Rotate-half RoPE of `heads` heads of D in place: x * cos + roll(x, D / 2) * sin_signed (model.apply_rope).
void rope_row(float* x, int64_t heads, int64_t D, const float* cos, const float* sin_signed, float* scratch) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* head = x + h * D;
    std::copy(head, head + D, scratch);
    for (int64_t i = 0; i < D; ++i) head[i] = scratch[i] * cos[i] + scratch[(i + half) % D] * sin_signed[i];
  }
}

}  // namespace

// first_logits [B, V]: the prefill's last-position logits (decode step 0 samples from them).
// layers: kPerLayer tensors per layer (above). embed [V, H]; norm [H]; lm_head blocked [ceil(V / 16), H, 16]. The
// blocked weights are float32 or bfloat16 (each its own); everything else is float32.
// k_cache, v_cache: per layer [B_max, KV, S_max, D], rows 0..B-1 holding the prefill. cos, sin_signed [S_max', D]
// (model.signed_sin). mask [B, S_max] additive: 0 where a slot holds a real token of the row, -inf in its left
// padding (DecodeMasks.bias). positions [B]: the position of each row's first new token (its prompt length);
// first_slot: its cache slot (the padded prompt width). temperature [B] float32 (0: greedy), seeds [B] int64,
// ends [V] bool: tokens that finish a row. kept_logits: [B, max_new_tokens, V] to receive each step's logits,
// or empty. Returns (tokens [B, max_new_tokens] int64, log-probs [B, max_new_tokens], lengths [B], steps run):
// the engine's loop exactly, zeros past the last step.
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, int64_t> decode_loop(
    torch::Tensor first_logits, std::vector<torch::Tensor> layers, torch::Tensor embed, torch::Tensor norm,
    torch::Tensor lm_head, std::vector<torch::Tensor> k_cache, std::vector<torch::Tensor> v_cache, torch::Tensor cos,
    torch::Tensor sin_signed, torch::Tensor mask, torch::Tensor positions, int64_t first_slot,
    torch::Tensor temperature, torch::Tensor seeds, torch::Tensor ends, int64_t max_new_tokens, int64_t num_heads,
    int64_t num_kv_heads, double eps, torch::Tensor kept_logits) {
  check_float(first_logits, "first_logits", -1);
  TORCH_CHECK(first_logits.dim() == 2, "decode_loop: first_logits must be [B, V], got ", first_logits.sizes());
  const int64_t B = first_logits.size(0), V = first_logits.size(1);
  TORCH_CHECK(layers.size() % kPerLayer == 0 && !layers.empty(), "decode_loop: layers must hold ", kPerLayer,
              " tensors per layer, got ", layers.size());
  const int64_t L = static_cast<int64_t>(layers.size()) / kPerLayer;
  TORCH_CHECK(static_cast<int64_t>(k_cache.size()) == L && static_cast<int64_t>(v_cache.size()) == L,
              "decode_loop: one key and one value cache per layer (", L, "), got ", k_cache.size(), " and ",
              v_cache.size());
  check_float(embed, "embed", -1);
  TORCH_CHECK(embed.dim() == 2 && embed.size(0) == V, "decode_loop: embed must be [V = ", V, ", H], got ",
              embed.sizes());
  const int64_t H = embed.size(1);
  check_float(cos, "cos", -1);
  check_float(sin_signed, "sin_signed", -1);
  TORCH_CHECK(cos.dim() == 2 && sin_signed.sizes() == cos.sizes(), "decode_loop: cos and sin_signed must be the same [S, D]");
  const int64_t D = cos.size(1);
  TORCH_CHECK(D % kLanes == 0 && D <= 256, "decode_loop: head_dim ", D, " must be a multiple of 16, at most 256");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "decode_loop: ", num_heads,
              " heads do not group over ", num_kv_heads, " KV heads");
  const int64_t G = num_heads / num_kv_heads, q_size = num_heads * D, kv_size = num_kv_heads * D;
  const int64_t qkv_size = q_size + 2 * kv_size;
  const int64_t I = layers[6].dim() == 3 ? layers[6].size(1) : 0;  // down's K
  const float* final_norm = vector_of(norm, H, "norm", -1);
  const Blocked head = blocked(lm_head, H, V, "lm_head", -1);

  struct Layer {
    const float *ln_attn, *qkv_bias, *ln_mlp;
    Blocked qkv, o, gate_up, down;
    float *k, *v;
  };
  std::vector<Layer> model;
  int64_t S_max = 0;
  for (int64_t l = 0; l < L; ++l) {
    const auto* t = layers.data() + l * kPerLayer;
    for (auto* cache : {&k_cache[l], &v_cache[l]}) {
      check_float(*cache, "the KV cache", l);
      TORCH_CHECK(cache->dim() == 4 && cache->size(0) >= B && cache->size(1) == num_kv_heads && cache->size(3) == D,
                  "decode_loop: the KV cache of layer ", l, " must be [>= ", B, ", ", num_kv_heads, ", S, ", D,
                  "], got ", cache->sizes());
    }
    S_max = k_cache[l].size(2);
    TORCH_CHECK(v_cache[l].sizes() == k_cache[l].sizes() && S_max == k_cache[0].size(2),
                "decode_loop: key and value caches differ in shape");
    model.push_back({vector_of(t[0], H, "ln_attn", l), t[2].numel() ? vector_of(t[2], qkv_size, "qkv bias", l) : nullptr,
                     vector_of(t[4], H, "ln_mlp", l), blocked(t[1], H, qkv_size, "qkv", l),
                     blocked(t[3], q_size, H, "o", l), blocked(t[5], H, 2 * I, "gate_up", l),
                     blocked(t[6], I, H, "down", l), k_cache[l].data_ptr<float>(), v_cache[l].data_ptr<float>()});
  }
  const int64_t cache_row = num_kv_heads * S_max * D;  // floats per batch row of one layer's cache
  check_float(mask, "mask", -1);
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == B && mask.size(1) >= first_slot + max_new_tokens - 1,
              "decode_loop: mask must be [", B, ", >= ", first_slot + max_new_tokens - 1, "], got ", mask.sizes());
  auto check_rows = [&](const torch::Tensor& t, torch::ScalarType type, int64_t n, const char* what) {
    TORCH_CHECK(t.dim() == 1 && t.size(0) == n && t.scalar_type() == type && t.is_contiguous() && t.device().is_cpu(),
                "decode_loop: ", what, " must be a contiguous ", type, " CPU tensor [", n, "], got ", t.sizes(), " ",
                t.scalar_type());
  };
  check_rows(positions, torch::kInt64, B, "positions");
  check_rows(temperature, torch::kFloat32, B, "temperature");
  check_rows(seeds, torch::kInt64, B, "seeds");
  check_rows(ends, torch::kBool, V, "ends");
  TORCH_CHECK(max_new_tokens >= 1, "decode_loop: max_new_tokens must be >= 1, got ", max_new_tokens);
  TORCH_CHECK(first_slot >= 0 && first_slot + max_new_tokens - 1 <= S_max, "decode_loop: slots ", first_slot, "..",
              first_slot + max_new_tokens - 2, " do not fit the cache's ", S_max);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(pos[b] >= 0 && pos[b] + max_new_tokens - 1 <= cos.size(0), "decode_loop: position ", pos[b],
                " of row ", b, " runs past the RoPE table's ", cos.size(0), " positions");
  }
  const bool keep = kept_logits.numel() > 0;
  if (keep) {
    check_float(kept_logits, "kept_logits", -1);
    TORCH_CHECK(kept_logits.dim() == 3 && kept_logits.size(0) == B && kept_logits.size(1) == max_new_tokens &&
                    kept_logits.size(2) == V,
                "decode_loop: kept_logits must be [", B, ", ", max_new_tokens, ", ", V, "], got ", kept_logits.sizes());
  }

  auto tokens = torch::zeros({B, max_new_tokens}, positions.options());
  auto logprobs = torch::zeros({B, max_new_tokens}, first_logits.options());
  auto lengths = torch::full({B}, max_new_tokens, positions.options());
  int64_t* out_tokens = tokens.data_ptr<int64_t>();
  float* out_logprobs = logprobs.data_ptr<float>();
  int64_t* out_lengths = lengths.data_ptr<int64_t>();
  const float* temp = temperature.data_ptr<float>();
  const int64_t* seed = seeds.data_ptr<int64_t>();
  const bool* finishing = ends.data_ptr<bool>();
  const float* bias = mask.data_ptr<float>();
  const int64_t mask_row = mask.size(1);
  const float* embed_rows = embed.data_ptr<float>();
  const float* cos_rows = cos.data_ptr<float>();
  const float* sin_rows = sin_signed.data_ptr<float>();
  float* kept = keep ? kept_logits.data_ptr<float>() : nullptr;
  const float feps = static_cast<float>(eps), scale = 1.0f / std::sqrt(static_cast<float>(D));

  std::vector<float> logits(first_logits.data_ptr<float>(), first_logits.data_ptr<float>() + B * V);
  std::vector<float> x(B * H), h(B * H), out(B * H), qkv(B * qkv_size), attn(B * q_size), gate_up(B * 2 * I),
      act(B * I);
  std::vector<int64_t> step_tokens(B);
  std::vector<char> finished(B, 0);
  bool stop = false;
  int64_t steps = 0;
  const int64_t padded_slots = (S_max + kLanes - 1) / kLanes * kLanes;

#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> scores(G * padded_slots), rope_scratch(D);
    for (int64_t t = 0; t < max_new_tokens; ++t) {
#pragma omp for schedule(static)
      for (int64_t b = 0; b < B; ++b) {
        const float* row = logits.data() + b * V;
        if (keep) std::copy(row, row + V, kept + (b * max_new_tokens + t) * V);
        float logprob;
        sample_token_row(row, V, temp[b], seed[b], t, kKeepAll, &step_tokens[b], &logprob);
        out_tokens[b * max_new_tokens + t] = step_tokens[b];
        out_logprobs[b * max_new_tokens + t] = logprob;
      }
#pragma omp single
      {
        bool all = true;
        for (int64_t b = 0; b < B; ++b) {
          if (!finished[b] && finishing[step_tokens[b]]) {
            finished[b] = 1;
            out_lengths[b] = t + 1;
          }
          all = all && finished[b];
        }
        steps = t + 1;
        stop = all || t + 1 == max_new_tokens;
      }  // the single's barrier: every thread reads the same `stop`
      if (stop) break;

      const int64_t slot = first_slot + t;
#pragma omp for schedule(static)
      for (int64_t b = 0; b < B; ++b) {
        std::copy(embed_rows + step_tokens[b] * H, embed_rows + (step_tokens[b] + 1) * H, x.data() + b * H);
        rms_norm_row(x.data() + b * H, model[0].ln_attn, H, feps, h.data() + b * H);
      }
      for (int64_t l = 0; l < L; ++l) {
        const Layer& layer = model[l];
        linear(h.data(), B, layer.qkv, qkv.data());
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
          float* row = qkv.data() + b * qkv_size;
          if (layer.qkv_bias != nullptr) {
            for (int64_t i = 0; i < qkv_size; ++i) row[i] += layer.qkv_bias[i];
          }
          const int64_t p = pos[b] + t;
          rope_row(row, num_heads + num_kv_heads, D, cos_rows + p * D, sin_rows + p * D, rope_scratch.data());
          for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
            const int64_t at = b * cache_row + (kv * S_max + slot) * D;
            std::copy(row + q_size + kv * D, row + q_size + (kv + 1) * D, layer.k + at);
            std::copy(row + q_size + kv_size + kv * D, row + q_size + kv_size + (kv + 1) * D, layer.v + at);
            attend_pair(row + kv * G * D, G, D, layer.k + b * cache_row + kv * S_max * D, D,
                        layer.v + b * cache_row + kv * S_max * D, D, bias + b * mask_row, slot + 1, scale,
                        scores.data(), attn.data() + b * q_size + kv * G * D);
          }
        }
        linear(attn.data(), B, layer.o, out.data());
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t i = 0; i < H; ++i) x[b * H + i] += out[b * H + i];
          rms_norm_row(x.data() + b * H, layer.ln_mlp, H, feps, h.data() + b * H);
        }
        linear(h.data(), B, layer.gate_up, gate_up.data());
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
          silu_mul_row(gate_up.data() + b * 2 * I, gate_up.data() + b * 2 * I + I, I, act.data() + b * I);
        }
        linear(act.data(), B, layer.down, out.data());
        const float* next_norm = l + 1 < L ? model[l + 1].ln_attn : final_norm;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t i = 0; i < H; ++i) x[b * H + i] += out[b * H + i];
          rms_norm_row(x.data() + b * H, next_norm, H, feps, h.data() + b * H);
        }
      }
      linear(h.data(), B, head, logits.data());
    }
  }
  return {tokens, logprobs, lengths, steps};
}
