// The Python module of the AVX2 CPU kernels (kernels/_cpu_extension.py builds every .cpp of csrc/avx2/ into it).
#include "../kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_tokens", &sample_tokens_cpu, "one sampled token and its log-prob per row of float32 logits (AVX2)");
  m.def("skinny_linear", &skinny_linear, "x @ W^T in float32, W blocked as [ceil(N/16), K, 16] (AVX2)");
  m.def("logprobs_entropy_forward", &logprobs_entropy_forward,
        "(log-prob at index or empty, entropy or empty, log-sum-exp) per row of float32 logits / T (AVX2)");
  m.def("logprobs_entropy_backward", &logprobs_entropy_backward,
        "d loss / d logits from the forward's log-sum-exp and the log-prob and entropy grads (AVX2)");
  m.attr("isa") = "AVX2";
}
