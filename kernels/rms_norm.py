"""RMSNorm of float32 rows as one autograd node: a C++ kernel on CPU (csrc/avx2/), F.rms_norm elsewhere.

Why: torch 2.13 differentiates `F.rms_norm` on CPU through its decomposition: pow, mean, add, rsqrt and two
muls, six autograd nodes and ~35 operator calls for one norm, where one call does (timings:
docs/performance.md#cpu-kernels). On a small model that per-call cost is what a norm spends, and the demo's
PPO step runs 5 norms per forward, for the actor and the critic, 4 steps an iteration; the engine and the
no-grad passes take the same kernel without autograd.

The node is a C++ autograd Function (its backward never takes the GIL: a Python one's does, and with the PPO
critic training on a second Python thread beside the actor, waiting for it would make the train phase slower
than torch's six nodes), and each direction is one call without the GIL, with the sums of a row in a fixed
order and the weight's gradient summed over rows in row order, so its results do not depend on the thread
count.

Same formula and order as transformers' LlamaRMSNorm (x * rsqrt(mean(x^2) + eps), then * weight); the torch
path (`impl="torch"`) is the reference it is tested against, to float rounding (the mean's summation order
differs). "auto" takes the kernel for float32 CPU tensors where the AVX2 extension builds, outside
torch.compile (a pybind call would break its graph), and F.rms_norm everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from alignflow.kernels import _cpu_extension


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, impl: str = "auto") -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * weight over the last dim; x [..., H],
    weight [H]. impl: auto, cpp, torch."""
    kernels = _cpu_extension.node_kernels("rms_norm", impl, x, weight)
    if kernels is None:
        return F.rms_norm(x, weight.shape, weight, eps)
    return kernels.rms_norm(x, weight, float(eps))

