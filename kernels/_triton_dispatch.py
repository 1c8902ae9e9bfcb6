"""Picks the torch reference, a CPU fast path or the Triton kernel for one call (the choice only).

``impl="auto"`` runs Triton when the tensor is on a CUDA (or ROCm) device and triton imports, else the
eager CPU fast path where one exists (sample_tokens only: ``"cpp"`` where the C++ kernels build,
otherwise ``"chunked"``) and the torch reference otherwise. ``impl="triton"`` on a CPU tensor only works in Triton's interpreter, which has to be
switched on (``TRITON_INTERPRET=1``) before the ``_triton_*`` kernel modules are first imported,
because ``@triton.jit`` reads that variable when it decorates a function.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

IMPLS = ("auto", "torch", "triton")
# Ops with eager CPU fast paths besides the reference: "chunked" (torch ops) and "cpp" (the AVX-512
# C++ extension, kernels/csrc; "auto" takes it where it builds, else "chunked").
CHUNKED_OPS = ("sample_tokens",)


def cpp_available() -> bool:
    """True when the C++ CPU sampler runs here (AVX-512 or AVX2 CPU, extension built; the first call builds it)."""
    from alignflow.kernels import _cpu_extension

    return _cpu_extension.sampler() is not None


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (same spellings Triton accepts)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_impl(impl: str, device: torch.device, op: str) -> str:
    """Returns "torch", "chunked", "cpp" or "triton" for ``op`` on ``device``; raises with the fix when ``impl`` cannot run."""
    valid = ("auto", "torch", "chunked", "cpp", "triton") if op in CHUNKED_OPS else IMPLS
    if impl not in valid:
        raise ValueError(f"{op}: impl={impl!r} is not one of {valid}")
    if impl == "torch":
        return "torch"
    on_gpu = device.type == "cuda"
    if impl == "chunked":
        return "chunked"
    if impl == "cpp":
        if on_gpu:
            raise RuntimeError(f"{op}: impl='cpp' runs on CPU tensors only; use impl='auto' or 'triton' on {device}")
        if not cpp_available():
            from alignflow.kernels import _cpu_extension

            raise RuntimeError(f"{op}: impl='cpp' is not available here ({_cpu_extension.sampler_unavailable_reason()}); "
                               "use impl='chunked' or 'auto'")
        return "cpp"
    if impl == "auto":
        if on_gpu and triton_available():
            return "triton"
        if op in CHUNKED_OPS:
            return "cpp" if device.type == "cpu" and cpp_available() else "chunked"
        return "torch"
    if not triton_available():
        raise RuntimeError(
            f"{op}: impl='triton' but triton is not installed; install triton or use impl='torch'"
        )
    if not on_gpu and not interpreter_requested():
        raise RuntimeError(
            f"{op}: impl='triton' on a {device.type} tensor needs Triton's interpreter: set TRITON_INTERPRET=1 "
            "in the environment before alignflow.kernels first runs a Triton kernel, move the tensor to CUDA, "
            "or use impl='torch'"
        )
    return "triton"


def check_kernel_mode(kernel: object, device: torch.device, op: str) -> None:
    """Raises if a CPU tensor meets a kernel that was compiled for the GPU (decorated before TRITON_INTERPRET=1)."""
    if device.type == "cuda":
        return
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"{op}: the Triton kernels were imported before TRITON_INTERPRET=1 was set, so they are compiled for a "
            "GPU and cannot run on CPU tensors; set TRITON_INTERPRET=1 before the first import of "
            "alignflow.kernels._triton_* (e.g. at the top of conftest.py), or use impl='torch'"
        )
