// The Python module of the AVX2 CPU kernels (kernels/_cpu_extension.py builds every .cpp of csrc/avx2/ into it).
#include "../kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("sample_tokens", &sample_tokens_cpu, "one sampled token and its log-prob per row of float32 logits (AVX2)");
  m.def("skinny_linear", &skinny_linear, "x @ W^T in float32, W blocked as [ceil(N/16), K, 16] (AVX2)");
  m.def("logprobs_entropy_forward", &logprobs_entropy_forward,
        "(log-prob at index or empty, entropy or empty, log-sum-exp) per row of float32 logits / T (AVX2)");
  m.def("logprobs_entropy_backward", &logprobs_entropy_backward,
        "d loss / d logits from the forward's log-sum-exp and the log-prob and entropy grads (AVX2)");
  m.def("logprobs_entropy", &logprobs_entropy,
        "(log-prob at index or empty, entropy or empty) per row of float32 logits / T, differentiable, its backward "
        "in C++ (AVX2)", py::call_guard<py::gil_scoped_release>());
  // Without the GIL, as torch's own operators run: the PPO critic's thread trains beside the actor's.
  m.def("rms_norm_forward", &rms_norm_forward, "(RMSNorm(x) * weight, 1 / rms per row) of float32 rows [N, H] (AVX2)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm_backward", &rms_norm_backward,
        "(d loss / d x, d loss / d weight or empty) from the forward's 1 / rms per row (AVX2)",
        py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm(x) * weight over the last dim, differentiable, its backward in C++ (AVX2)",
        py::call_guard<py::gil_scoped_release>());
  m.attr("isa") = "AVX2";
}
