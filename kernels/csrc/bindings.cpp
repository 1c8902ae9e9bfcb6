// The Python module of the CPU kernels (kernels/_cpu_extension.py builds every .cpp here into it).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("skinny_linear", &skinny_linear, "x @ W^T in float32, W blocked as [ceil(N/16), K, 16]");
  m.def("decode_attention", &decode_attention, "one decode step's attention in float32 over the KV cache");
  m.def("sample_tokens", &sample_tokens_cpu, "one sampled token and its log-prob per row of float32 logits");
  m.def("decode_loop", &decode_loop, "a Llama-family float32 model's whole decode loop (kernels/decode_loop.py)");
  m.attr("isa") = "AVX-512";
}
