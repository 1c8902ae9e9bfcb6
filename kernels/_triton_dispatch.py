"""Picks the torch reference, a CPU fast path or the Triton kernel for one call (the choice only).

``impl="auto"`` runs Triton when the tensor is on a CUDA (or ROCm) device and triton imports, else the
C++ CPU kernel where the op has one and it builds (``"cpp"``: sample_tokens and the log-prob ops), else
sample_tokens' ``"chunked"`` torch path, else the torch reference. ``impl="triton"`` on a CPU tensor only
works in Triton's interpreter, which has to be switched on (``TRITON_INTERPRET=1``) before the ``_triton_*``
kernel modules are first imported, because ``@triton.jit`` reads that variable when it decorates a function.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

IMPLS = ("auto", "torch", "triton")
# Ops with an eager CPU fast path of torch ops besides the reference.
CHUNKED_OPS = ("sample_tokens",)
# Ops with a C++ CPU kernel (kernels/csrc): "auto" takes it on CPU tensors where it builds.
LOGPROB_OPS = ("selective_log_softmax", "entropy_from_logits", "logprobs_and_entropy")
CPP_OPS = ("sample_tokens", *LOGPROB_OPS)


def _cpp_module_and_reason(op: str) -> tuple[object | None, str | None]:
    from alignflow.kernels import _cpu_extension

    if op in LOGPROB_OPS:
        return _cpu_extension.logprob_kernels(), _cpu_extension.logprob_kernels_unavailable_reason()
    return _cpu_extension.sampler(), _cpu_extension.sampler_unavailable_reason()


def cpp_available(op: str = "sample_tokens") -> bool:
    """True when `op`'s C++ CPU kernel runs here (AVX-512 or AVX2 CPU, extension built;
    the first call builds it)."""
    return _cpp_module_and_reason(op)[0] is not None


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (same spellings Triton accepts)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_impl(impl: str, device: torch.device, op: str) -> str:
    """Returns "torch", "chunked", "cpp" or "triton" for ``op`` on ``device``;
    raises with the fix when ``impl`` cannot run."""
    valid = (
        "auto",
        "torch",
        *(("chunked",) if op in CHUNKED_OPS else ()),
        *(("cpp",) if op in CPP_OPS else ()),
        "triton",
    )
    if impl not in valid:
        raise ValueError(f"{op}: impl={impl!r} is not one of {valid}")
    if impl == "torch":
        return "torch"
    on_gpu = device.type == "cuda"
    if impl == "chunked":
        return "chunked"
    if impl == "cpp":
        if on_gpu:
            raise RuntimeError(
                f"{op}: impl='cpp' runs on CPU tensors only; use impl='auto' or 'triton' on {device}"
            )
        if not cpp_available(op):
            other = "'chunked' or 'auto'" if op in CHUNKED_OPS else "'torch' or 'auto'"
            raise RuntimeError(
                f"{op}: impl='cpp' is not available here ({_cpp_module_and_reason(op)[1]}); use impl={other}"
            )
        return "cpp"
    if impl == "auto":
        if on_gpu and triton_available():
            return "triton"
        if op in CPP_OPS and device.type == "cpu" and cpp_available(op):
            return "cpp"
        return "chunked" if op in CHUNKED_OPS else "torch"
    if not triton_available():
        raise RuntimeError(
            f"{op}: impl='triton' but triton is not installed; install triton or use impl='torch'"
        )
    if not on_gpu and not interpreter_requested():
        raise RuntimeError(
            f"{op}: impl='triton' on a {device.type} tensor needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 in the environment before alignflow.kernels first runs a Triton kernel, move "
            "the tensor to CUDA, or use impl='torch'"
        )
    return "triton"


def check_kernel_mode(kernel: object, device: torch.device, op: str) -> None:
    """Raises if a CPU tensor meets a kernel that was compiled for the GPU
    (decorated before TRITON_INTERPRET=1)."""
    if device.type == "cuda":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"{op}: the Triton kernels were imported before TRITON_INTERPRET=1 was set, so they are compiled "
            "for a GPU and cannot run on CPU tensors; set TRITON_INTERPRET=1 before the first import of "
            "alignflow.kernels._triton_* (e.g. at the top of conftest.py), or use impl='torch'"
        )
