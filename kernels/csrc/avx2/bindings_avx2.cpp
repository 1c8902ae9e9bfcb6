// The Python module of the AVX2 CPU kernels (kernels/_cpu_extension.py builds every .cpp of csrc/avx2/ into it).
#include "../kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_tokens", &sample_tokens_cpu, "one sampled token and its log-prob per row of float32 logits (AVX2)");
  m.def("skinny_linear", &skinny_linear, "x @ W^T in float32, W blocked as [ceil(N/16), K, 16] (AVX2)");
  // The two C++ autograd nodes run without the GIL, as torch's own operators do: the PPO critic's thread trains
  // beside the actor's.
  m.def("logprobs_entropy", &logprobs_entropy,
        "(log-prob at index or empty, entropy or empty) per row of float32 logits / T, differentiable, its backward "
        "in C++ (AVX2)", py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight over the last dim, differentiable, its backward in C++ (AVX2)",
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of float32 tensors, differentiable, its backward in C++ (AVX2)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope", &rope, "rotate-half RoPE of float32 [tokens, heads, D], differentiable, its backward in C++ (AVX2)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_loop", &decode_loop, "a Llama-family float32 model's whole decode loop (kernels/decode_loop.py; AVX2)");
  m.attr("isa") = "AVX2";
}
