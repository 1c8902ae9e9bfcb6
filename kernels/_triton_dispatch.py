"""Picks the torch reference, the chunked CPU sampler or the Triton kernel for one call (the choice only).

``impl="auto"`` runs Triton when the tensor is on a CUDA (or ROCm) device and triton imports, else the
eager CPU fast path where one exists (``"chunked"``, sample_tokens only) and the torch reference
otherwise. ``impl="triton"`` on a CPU tensor only works in Triton's interpreter, which has to be
switched on (``TRITON_INTERPRET=1``) before the ``_triton_*`` kernel modules are first imported,
because ``@triton.jit`` reads that variable when it decorates a function.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

IMPLS = ("auto", "torch", "triton")
# Ops with an eager CPU fast path besides the reference.
CHUNKED_OPS = ("sample_tokens",)


@functools.cache
def triton_available() -> bool:
    """True when the ``triton`` package can be imported (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def interpreter_requested() -> bool:
    """True when TRITON_INTERPRET asks for Triton's CPU interpreter (same spellings Triton accepts)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_impl(impl: str, device: torch.device, op: str) -> str:
    """Returns "torch", "chunked" or "triton" for ``op`` on ``device``; raises with the fix when ``impl`` cannot run."""
    valid = ("auto", "torch", "chunked", "triton") if op in CHUNKED_OPS else IMPLS
    if impl not in valid:
        raise ValueError(f"{op}: impl={impl!r} is not one of {valid}")
    if impl == "torch":
        return "torch"
    on_gpu = device.type == "cuda"
    if impl == "chunked":
        return "chunked"
    if impl == "auto":
        if on_gpu and triton_available():
            return "triton"
        return "chunked" if op in CHUNKED_OPS else "torch"
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
