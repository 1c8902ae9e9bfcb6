"""Per-token log-probabilities and entropy from logits without a full fp32 log-softmax (not sampling).

``log softmax(logits / T)[index]`` is what PPO/GRPO need for every generated token, but the plain
``log_softmax(logits.float(), -1).gather(...)`` materialises a [B, T, V] fp32 tensor: at B*T = 16k
tokens and V = 152k that is 9.3 GiB, twice the bf16 logits themselves. These ops instead work in
chunks of rows:

* forward keeps only per-row results (log-prob, entropy: [B, T] fp32 each);
* backward recomputes softmax chunk by chunk from the saved logits, so the only full-size tensor it
  creates is the gradient itself, in the logits' dtype (bf16 for bf16).

On CUDA a Triton kernel (``_triton_logprobs.py``) does the same one row per program with an online
logsumexp, which it saves ([B, T] fp32) so its backward needs one pass over the logits, not two.
The torch reference below runs on CPU and is what the kernels are tested against.

On CPU, for float32 logits laid out as contiguous rows, a C++ kernel (``csrc/avx2/logprobs_avx2.cpp``,
``impl="cpp"``, what ``"auto"`` takes where it builds) does the same per row with the row in L1: two passes in
the forward (max; exp-sum with the entropy's sum beside it), one in the backward from the saved log-sum-exp,
where the reference makes ~6 passes, each into a fresh [r, V] tensor. The two are one C++ autograd node, whose
backward does not take the GIL (a Python Function's does: see kernels/rms_norm.py). Its log-sum-exp is the
AVX2 sampler's (same lanes and order), so at equal logits the training log-probs equal the engine's bit for
bit. Why: the PPO training step computes log-probs and the entropy (a metric) for every minibatch, and
fewer passes over the logits make that cheaper (docs/performance.md#cpu-kernels;
``benchmarks/kernels_bench.py --rl --threads 1 --reps 20``). Other dtypes and strided logits (``logits[:,
:-1]``) keep the chunked reference, which never copies the logits.

Gradients (z = logits / T, p = softmax(z), H = -sum p log p; per row):
    d logp[i] / d z_j = 1[j == i] - p_j
    d H / d z_j       = -p_j (log p_j + H)
and d/d logits = d/d z / T. Double backward is not supported.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

from alignflow.kernels._triton_dispatch import resolve_impl

# Rows per chunk = _CHUNK_ELEMENTS // V. 2**22 fp32 elements = 16 MiB per temporary; the reference
# holds at most three of them (upcast logits, log-probs, probabilities), so < 50 MiB of scratch
# whatever B*T is: 131 rows at V = 32k, 27 rows at V = 152k. One chunk's log_softmax takes milliseconds
# against tens of us of per-chunk Python, so smaller chunks only add overhead
# and larger ones only add memory (2**24: 196 MiB peak forward vs 52 MiB; run
# `benchmarks/kernels_bench.py --chunk-sweep`).
_CHUNK_ELEMENTS = 1 << 22
# Clamping log p = -inf (logit -inf) to the most negative finite fp32 keeps p * log p = 0 * finite = 0
# instead of 0 * -inf = NaN, in forward and backward alike.
_FP32_MIN = torch.finfo(torch.float32).min


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, impl: str = "auto"
) -> torch.Tensor:
    """log softmax(logits / temperature)[index] over the last dim, without a full fp32 log-softmax.

    logits: [..., V] float (fp32, bf16, fp16), any strides; index: [...] integer in [0, V).
    Returns [...] fp32, differentiable with respect to ``logits``.
    """
    logp, _ = _run(
        "selective_log_softmax", logits, index, temperature, impl, want_logp=True, want_entropy=False
    )
    return logp


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0, impl: str = "auto") -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the last dim: [..., V] -> [...] fp32, differentiable."""
    _, entropy = _run(
        "entropy_from_logits", logits, None, temperature, impl, want_logp=False, want_entropy=True
    )
    return entropy


def logprobs_and_entropy(
    logits: torch.Tensor, index: torch.Tensor, temperature: float = 1.0, impl: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(selective_log_softmax, entropy_from_logits) in one pass over the logits;
    both [...] fp32, differentiable."""
    logp, entropy = _run(
        "logprobs_and_entropy", logits, index, temperature, impl, want_logp=True, want_entropy=True
    )
    return logp, entropy


# --------------------------------------------------------------------------------------------------
# Validation and dispatch


def _validate(op: str, logits: torch.Tensor, index: torch.Tensor | None, temperature: float) -> None:
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        got = logits.dtype if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise TypeError(f"{op}: logits must be a floating-point tensor [..., V], got {got}")
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(
            f"{op}: logits must have a non-empty last (vocabulary) dim, got shape {tuple(logits.shape)}"
        )
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{op}: temperature must be a Python float, got {type(temperature).__name__}")
    if not (temperature > 0 and temperature < float("inf")):
        raise ValueError(
            f"{op}: temperature={temperature} must be finite and > 0 (use 1.0 for the plain softmax; "
            "temperature 0 is greedy decoding, whose log-probs are taken at temperature 1)"
        )
    if index is None:
        return
    if (
        not isinstance(index, torch.Tensor)
        or index.is_floating_point()
        or index.is_complex()
        or index.dtype == torch.bool
    ):
        got = index.dtype if isinstance(index, torch.Tensor) else type(index).__name__
        raise TypeError(f"{op}: index must be an integer tensor (torch.long), got {got}")
    if tuple(index.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{op}: index shape {tuple(index.shape)} must equal logits.shape[:-1] = "
            f"{tuple(logits.shape[:-1])} (for next-token log-probs pass logits[:, :-1] with input_ids[:, 1:])"
        )
    if index.device != logits.device:
        raise ValueError(f"{op}: index is on {index.device} but logits are on {logits.device}")
    vocab = logits.shape[-1]
    # One host sync on CUDA; an out-of-range index would otherwise read past the row silently.
    if index.numel() and bool(((index < 0) | (index >= vocab)).any()):
        bad = index[(index < 0) | (index >= vocab)]
        raise ValueError(
            f"{op}: index holds {bad.numel()} value(s) outside [0, {vocab}) (e.g. {bad[0].item()}); "
            "mask padding positions to a valid token id (e.g. 0) and ignore their log-probs"
        )


def _run(
    op: str,
    logits: torch.Tensor,
    index: torch.Tensor | None,
    temperature: float,
    impl: str,
    want_logp: bool,
    want_entropy: bool,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    _validate(op, logits, index, temperature)
    chosen = resolve_impl(impl, logits.device, op)
    if chosen == "cpp" and logits.dtype != torch.float32:
        if impl == "cpp":
            raise ValueError(
                f"{op}: impl='cpp' takes float32 logits, got {logits.dtype}; use impl='auto' (the torch "
                "reference for other dtypes) or upcast the logits"
            )
        chosen = "torch"
    if chosen == "cpp" and impl == "auto" and not logits.is_contiguous():
        chosen = "torch"
    if chosen == "cpp":
        return _apply_cpp(logits, index, float(temperature), want_logp, want_entropy)
    return _LogprobsEntropy.apply(logits, index, float(temperature), chosen, want_logp, want_entropy)


class _LogprobsEntropy(torch.autograd.Function):
    """Log-prob at ``index`` and/or entropy per row; backward recomputes softmax from the saved logits."""

    @staticmethod
    def forward(ctx, logits, index, temperature, impl, want_logp, want_entropy):
        if impl == "triton":
            from alignflow.kernels import _triton_logprobs

            logp, entropy, lse = _triton_logprobs.forward(logits, index, temperature, want_logp, want_entropy)
        else:
            logp, entropy, lse = _forward_torch(logits, index, temperature, want_logp, want_entropy)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(logits, index if want_logp else None, lse, entropy)
        ctx.temperature, ctx.impl = temperature, impl
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy):
        logits, index, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logp is None and grad_entropy is None):
            return (None,) * 6
        if ctx.impl == "triton":
            from alignflow.kernels import _triton_logprobs

            grad = _triton_logprobs.backward(
                logits, index, lse, entropy, grad_logp, grad_entropy, ctx.temperature
            )
        else:
            grad = _backward_torch(logits, index, lse, entropy, grad_logp, grad_entropy, ctx.temperature)
        return grad, None, None, None, None, None


# --------------------------------------------------------------------------------------------------
# C++ CPU kernels (csrc/avx2/logprobs_avx2.cpp)


def _rows(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """A per-row tensor as the kernel takes it: flat and contiguous, or empty for "not given"."""
    if t is None:
        return torch.empty(0, dtype=dtype)
    return t.reshape(-1).to(dtype).contiguous()


def _apply_cpp(
    logits: torch.Tensor, index: torch.Tensor | None, temperature: float, want_logp: bool, want_entropy: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logp, entropy) through the C++ autograd node (forward and backward kernels, the backward without the
    GIL: a Python Function's backward takes it, and the PPO critic's thread trains beside the actor's)."""
    from alignflow.kernels import _cpu_extension

    lead = logits.shape[:-1]
    flat = logits.reshape(
        -1, logits.shape[-1]
    ).contiguous()  # a copy only where impl="cpp" was asked for by name
    logp, entropy = _cpu_extension.logprob_kernels().logprobs_entropy(
        flat, _rows(index if want_logp else None, torch.int64), temperature, want_entropy
    )
    return logp.view(lead) if want_logp else None, entropy.view(lead) if want_entropy else None


# --------------------------------------------------------------------------------------------------
# Torch reference


def _row_chunks(x: torch.Tensor, rows_per_chunk: int) -> Iterator[torch.Tensor]:
    """Consecutive [r, V] views covering x's rows in row-major order of its leading dims, copying nothing.

    Non-viewable layouts (e.g. ``logits[:, :-1]``) are walked one leading index at a time.
    """
    try:
        flat = x.view(-1, x.shape[-1])
    except RuntimeError:
        for sub in x.unbind(0):
            yield from _row_chunks(sub, rows_per_chunk)
        return
    for start in range(0, flat.shape[0], rows_per_chunk):
        yield flat[start : start + rows_per_chunk]


def _rows_per_chunk(vocab: int) -> int:
    return max(1, _CHUNK_ELEMENTS // vocab)


def _scaled(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T for one [r, V] chunk: the chunk itself at T = 1 (read-only!), else a fresh fp32 copy.

    Dividing a bf16 chunk by T in bf16 would round z to 8 bits, hence the upcast first.
    """
    if temperature == 1.0:
        return chunk
    return chunk.to(torch.float32, copy=True).div_(temperature)


def _forward_torch(
    logits: torch.Tensor, index: torch.Tensor | None, temperature: float, want_logp: bool, want_entropy: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
    """Returns (logp, entropy, None), fp32 shaped like logits.shape[:-1] (None when unwanted).

    Uses torch's fused log_softmax per chunk: faster than logsumexp, which runs amax, sub, exp, sum, log
    as separate passes. No logsumexp is kept for the backward, which
    recomputes softmax with the fused kernel too.
    """
    lead = logits.shape[:-1]
    n_rows = lead.numel()
    logp = torch.empty(n_rows, dtype=torch.float32, device=logits.device) if want_logp else None
    entropy = torch.empty(n_rows, dtype=torch.float32, device=logits.device) if want_entropy else None
    flat_index = index.reshape(-1).to(torch.int64) if want_logp else None
    start = 0
    for chunk in _row_chunks(logits, _rows_per_chunk(logits.shape[-1])):
        stop = start + chunk.shape[0]
        log_p = torch.log_softmax(_scaled(chunk, temperature), dim=-1, dtype=torch.float32)
        if want_logp:
            logp[start:stop] = log_p.gather(1, flat_index[start:stop, None]).squeeze(1)
        if want_entropy:
            log_p.clamp_(min=_FP32_MIN)
            entropy[start:stop] = -(torch.exp(log_p).mul_(log_p)).sum(-1)
        start = stop
    shape = lambda t: None if t is None else t.view(lead)  # noqa: E731
    return shape(logp), shape(entropy), None


def _backward_torch(
    logits: torch.Tensor,
    index: torch.Tensor | None,
    lse: torch.Tensor | None,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """d loss / d logits in logits' dtype and shape (contiguous); fp32 scratch is two [r, V] chunks.

    ``lse`` is unused here (softmax is recomputed by torch's fused kernel); the Triton path uses it.
    """
    vocab = logits.shape[-1]
    grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    grad_rows = grad.view(-1, vocab)
    # 1/T folded into the per-row scales: one pass fewer over each chunk.
    g_logp = grad_logp.reshape(-1).float() / temperature if grad_logp is not None else None
    g_ent = grad_entropy.reshape(-1).float() / temperature if grad_entropy is not None else None
    ent = entropy.reshape(-1) if g_ent is not None else None
    flat_index = index.reshape(-1).to(torch.int64) if g_logp is not None else None
    start = 0
    for chunk in _row_chunks(logits, _rows_per_chunk(vocab)):
        stop = start + chunk.shape[0]
        z = _scaled(chunk, temperature)
        if g_ent is None and grad.dtype == torch.float32:
            # fp32 logits: softmax straight into the gradient's rows, no scratch and no final copy.
            gz = torch.ops.aten._softmax.out(z.float(), -1, False, out=grad_rows[start:stop])
            gz.mul_(-g_logp[start:stop, None])
        elif g_ent is None:
            gz = torch.softmax(z, dim=-1, dtype=torch.float32).mul_(-g_logp[start:stop, None])
        else:
            log_p = torch.log_softmax(z, dim=-1, dtype=torch.float32)
            p = torch.exp(log_p)
            # dH/dz = -p (log p + H), times the incoming entropy grad, built in log_p's storage.
            gz = (
                log_p.clamp_(min=_FP32_MIN).add_(ent[start:stop, None]).mul_(p).mul_(-g_ent[start:stop, None])
            )
            if g_logp is not None:
                gz.sub_(p.mul_(g_logp[start:stop, None]))
        if g_logp is not None:
            gz.scatter_add_(1, flat_index[start:stop, None], g_logp[start:stop, None])
        if gz.data_ptr() != grad_rows[start:stop].data_ptr():
            grad_rows[start:stop].copy_(gz)
        start = stop
    return grad
