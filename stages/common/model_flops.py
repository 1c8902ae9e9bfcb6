"""Model FLOPs of Llama-family forwards and training steps, and the peak a GPU could run them at (for MFU).

"Model FLOPs" count the arithmetic the model itself needs, whatever an implementation adds or saves: 2 per
weight per token for every linear layer, 4 * q_size per layer for each key a query attends to (q.k and
p.v), 2 * vocab * hidden for each row the LM head must produce. A training step is 3 forwards (the backward
computes the input's and the weight's gradient of every matmul, each as costly as the forward). Norms, RoPE,
softmax and the value/score heads (2 * hidden a row) are left out: a fraction of a percent at any size here.

Dividing by the time a phase took gives the rate it reached (perf/tflops/*), and by the device's peak in the
dtype it computed in, the model FLOPs utilisation (perf/mfu/*, docs/rl.md#metrics).
"""

from __future__ import annotations

from collections.abc import Iterable

from alignflow.stages.common.generation.native.spec import LlamaFamilySpec

# (start, end): the positions a forward computes of one sequence, end exclusive; every position attends to the
# keys before it and itself (within the layer's sliding window).
Span = tuple[int, int]

# Dense peak TFLOP/s by (device name fragment, compute dtype), from the vendors' data sheets (no sparsity).
# The first fragment found in torch.cuda.get_device_name() wins, so the more specific come first.
GPU_PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("H800", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
)


def linear_weights(spec: LlamaFamilySpec) -> int:
    """The weights of every layer's linear maps (q, k, v, o, gate, up, down), not the embedding or LM head."""
    hidden, q_size, kv_size = spec.hidden_size, spec.q_size, spec.kv_size
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * spec.intermediate_size
    return spec.num_layers * per_layer


def attended_keys(spec: LlamaFamilySpec, spans: Iterable[Span]) -> int:
    """The keys the spans' queries attend to, summed over positions and layers: position p attends to p + 1
    keys, or to the window where the layer has one."""
    spans = list(spans)
    total = 0
    for window in spec.sliding_windows:
        for start, end in spans:
            total += _keys_in(start, end, window)
    return total


def _keys_in(start: int, end: int, window: int | None) -> int:
    """sum(min(p + 1, window) for p in range(start, end)), in closed form."""
    if end <= start:
        return 0
    if window is None or end <= window:
        return (end * (end + 1) - start * (start + 1)) // 2
    below = _keys_in(start, window, None) if start < window else 0  # positions before the window fills
    return below + (end - max(start, window)) * window


def forward_flops(spec: LlamaFamilySpec, tokens: int, keys: int, head_rows: int) -> float:
    """One forward over `tokens` positions whose queries attend to `keys` keys in all (attended_keys, or any
    count: a dense T x T attention is T * T a sequence and layer), with the LM head on `head_rows` rows."""
    return float(2 * linear_weights(spec) * tokens + 4 * spec.q_size * keys
                 + 2 * spec.vocab_size * spec.hidden_size * head_rows)


def spans_flops(spec: LlamaFamilySpec, spans: Iterable[Span], head_rows: int) -> float:
    """One causal forward over the positions of `spans`, the LM head on `head_rows` rows."""
    spans = list(spans)
    tokens = sum(end - start for start, end in spans)
    return forward_flops(spec, tokens, attended_keys(spec, spans), head_rows)


def training_flops(forward: float) -> float:
    """A forward and its backward: the backward of each matmul computes two products as large as the forward's
    (the input's and the weight's gradients)."""
    return 3.0 * forward


def gpu_peak_tflops(device_name: str, compute_dtype: str) -> float | None:
    """The dense peak of a GPU named `device_name` (torch.cuda.get_device_name) in `compute_dtype` ('bf16',
    'fp16', 'tf32' or 'fp32'); None for a GPU or dtype not in GPU_PEAK_TFLOPS."""
    dtype = "bf16" if compute_dtype == "fp16" else compute_dtype  # the same tensor-core rate on these GPUs
    for fragment, peaks in GPU_PEAK_TFLOPS:
        if fragment in device_name:
            return peaks.get(dtype)
    return None
