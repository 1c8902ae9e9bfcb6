"""Prepacked copies of the native engine's linear weights on CPU, and the linear op that uses them.

Why: a decode step is a chain of skinny GEMMs (M = batch) that stream every weight once, and the
plain [out, in] layout F.linear reads streams slowly at small M. Two packed layouts:

- "blocked" (float32 on AVX-512 and AVX2 CPUs): [ceil(N/16), K, 16] copies for
  alignflow.kernels.skinny_linear, used up to skinny_linear.max_rows() rows (decode, small prefills); above
  that F.linear on the plain weight.
- "onednn" (bfloat16, or float32 where the kernel cannot be built): oneDNN's blocked copies.

The blocked copies of a float32 engine may be kept in bfloat16 (engine.cpu_linear_weights): the kernel widens
them as it reads, at half the bytes, and above its row limit F.linear runs on the weight rounded the same
way, so that prefill and decode read the same rounded weights (the engine is then exactly the float32
engine of the bf16-rounded model, up to summation order).

Both are faster than F.linear on the plain weight in a decode step (docs/performance.md#cpu-kernels;
`python benchmarks/cpu_kernels_bench.py`).

How: the plain fused buffers of InferenceWeights stay the source of truth (refit, save, GPU). A
`Prepacked` object keeps one packed copy per linear weight (each layer's view of qkv_w, o_w,
gate_up_w, down_w, and lm_head) in a process-wide table keyed by the view's address, shape and
dtype, with a weak reference to the buffer the view belongs to and that buffer's version counter
when it was packed. `alignflow::linear` (a custom op, so torch.compile traces it as one opaque call
instead of failing on oneDNN's opaque tensors) uses the packed copy only while the buffer is alive
and its version still matches: any in-place write to a buffer (refit, load) bumps the counter, so a
stale copy is never used; the op then falls back to F.linear, which is correct, and the engine
repacks after its writes. (The buffer's counter, not the view's: inside a compiled graph the views
reach the op as fresh tensors whose own counters start at 0.) Costs: a second copy of the linear weights in
memory (`engine.cpu_prepack: false` turns it off) and the repack time inside refit.

Numerics: oneDNN bf16 results equal F.linear's bit for bit (test_engine_prepack.py); fp32 results of
both packed layouts differ from F.linear by ~1e-6 relative (another accumulation order), inside the
engine's 1e-4 parity tolerance.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from alignflow.kernels import skinny_linear as skinny
from alignflow.stages.common.generation.native.weights import InferenceWeights

LINEAR_BUFFERS = ("qkv_w", "o_w", "gate_up_w", "down_w")
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)

LAYOUTS = ("blocked", "onednn")

# Smallest weight oneDNN packs. Packing pays for weights streamed from L3 or memory; one that stays in L2
# is read as fast in the plain layout, and the packed op's fixed per-call cost wins. In a decode step the
# weights do not stay in cache, so the floor is low enough that every weight of the 4.7M RL-benchmark
# model packs (its smallest is 256 KiB), while the demo model (every weight < 0.2 MiB, the whole model in
# L2) generates faster plain (docs/performance.md#cpu-kernels;
# `benchmarks/cpu_kernels_bench.py --model rl-4.7m --engine-floor-kib 1024` times two floors). The AVX-512
# blocked kernel has no floor: its layout is what makes it fast. The AVX2 build ("blocked-avx2") has oneDNN's,
# for the same reason: the demo model's blocked weights generate slower than plain ones
# (benchmarks/ppo_iteration.py).
MIN_PACKED_BYTES = {"onednn": 256 << 10, "blocked": 0, "blocked-avx2": 256 << 10}


def min_packed_bytes(layout: str, blocked_dtype: torch.dtype = torch.float32) -> int:
    """The smallest weight this layout packs here (MIN_PACKED_BYTES;
    the blocked layout's floor is its build's; none for bfloat16 blocks: every weight is rounded)."""
    if layout == "blocked" and blocked_dtype == torch.bfloat16:
        return 0
    if layout == "blocked" and skinny.isa() == "AVX2":
        return MIN_PACKED_BYTES["blocked-avx2"]
    return MIN_PACKED_BYTES[layout]


_MAX_ROWS = functools.cache(skinny.max_rows)  # fixed for the process; read by every linear of a decode step

_Key = tuple[int, tuple[int, ...], torch.dtype]
# (address, shape, dtype) of a weight view -> (packed copy, or None for a weight left plain because it is
# under MIN_PACKED_BYTES; its buffer, the buffer's version when packed, the weight's out_features for a
# "blocked" copy or None for a oneDNN one)
_TABLE: dict[_Key, tuple[torch.Tensor | None, weakref.ref[torch.Tensor], int, int | None]] = {}
# Calls of alignflow::linear that used a packed copy / fell back to F.linear because the copy was stale /
# used F.linear by design because a blocked copy's kernel does not pay at that many rows (tests read these).
calls = {"packed": 0, "fallback": 0, "plain": 0}


def _key(weight: torch.Tensor) -> _Key:
    return weight.data_ptr(), tuple(weight.shape), weight.dtype


def layout_for(device: torch.device, dtype: torch.dtype, kernels: bool = True) -> str | None:
    """The packed layout for weights of `dtype` on `device`, or None where prepacking does not apply.

    "blocked" for float32 where the skinny_linear kernel may and can run (`kernels`, AVX-512 or AVX2,
    extension built; building it the first time takes ~1 min), "onednn" for float32 elsewhere and bfloat16
    with oneDNN on a CPU with AVX-512, else None.
    """
    if device.type != "cpu" or dtype not in PACKABLE_DTYPES:
        return None
    if dtype == torch.float32 and kernels and skinny.available():
        return "blocked"
    if not torch.backends.mkldnn.is_available():
        return None
    # oneDNN reorders bf16 weights only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT; on an AVX2-only CPU
    # (some AMD EPYC CPUs) it raises, so bf16 weights stay plain there and F.linear runs them.
    if dtype == torch.bfloat16 and not torch.cpu._is_avx512_supported():
        return None
    return "onednn"


def _linear_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (no bias) from the packed copy of `weight` when one is current, else F.linear."""
    entry = _TABLE.get(_key(weight))
    if entry is not None and entry[0] is None:
        calls["plain"] += 1  # too small to pack (MIN_PACKED_BYTES): F.linear by design
        return F.linear(x, weight)
    buffer = entry[1]() if entry is not None else None
    if buffer is None or buffer._version != entry[2]:
        calls["fallback"] += 1
        return F.linear(x, weight)
    packed, out_features = entry[0], entry[3]
    if out_features is not None:  # blocked
        if x.numel() > _MAX_ROWS() * x.shape[-1]:
            calls["plain"] += 1
            if packed.dtype == torch.bfloat16:
                # A large prefill: F.linear's GEMM on the rounded weight, the same model as the decode steps'
                # (rounding costs a pass over the weight, small beside a GEMM of this many rows)
                return F.linear(x, weight.to(torch.bfloat16).to(weight.dtype))
            return F.linear(x, weight)
        calls["packed"] += 1
        return skinny.skinny_linear(x, packed, out_features)
    calls["packed"] += 1
    # The decode step's [B, H] goes in as it is: a reshape in and a view out would each add a sizeable share
    # of a small packed call, in every linear of every step.
    if x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, None, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


def current_blocked(weight: torch.Tensor) -> torch.Tensor | None:
    """The current "blocked" copy of `weight` (a view a Prepacked object packed), or None: not packed, stale,
    or oneDNN's layout. The C++ decode loop reads these rather than keeping copies of its own."""
    entry = _TABLE.get(_key(weight))
    if entry is None or entry[0] is None or entry[3] is None:
        return None
    buffer = entry[1]()
    return entry[0] if buffer is not None and buffer._version == entry[2] else None


# Registered through torch.library.Library rather than the @custom_op decorator: the decorator's
# Python wrapper costs several times more per call, paid by each of a decode step's 49 linear calls
# (a sizeable share of a small model's step). The op is inference-only (no
# autograd formula) and CPU-only, like the packed weights it reads.
_LIBRARY = torch.library.Library("alignflow", "DEF")
_LIBRARY.define("linear(Tensor x, Tensor weight) -> Tensor")
_LIBRARY.impl("linear", _linear_cpu, "CPU")


@torch.library.register_fake("alignflow::linear")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


linear = torch.ops.alignflow.linear


class Prepacked:
    """The packed copies of one engine's linear weights; entries leave the table with this object."""

    def __init__(
        self,
        weights: InferenceWeights,
        batch_hint: int,
        layout: str,
        blocked_dtype: torch.dtype = torch.float32,
    ):
        if layout not in LAYOUTS:
            raise ValueError(f"prepack layout {layout!r}: valid are {', '.join(LAYOUTS)}")
        if blocked_dtype not in skinny.BLOCKED_DTYPES:
            raise ValueError(f"blocked copies are float32 or bfloat16, not {blocked_dtype}")
        self.weights = weights
        self.layout = layout
        self.blocked_dtype = blocked_dtype  # of "blocked" copies (engine.cpu_linear_weights)
        self.batch_hint = batch_hint  # oneDNN picks its blocking for this M (the engine's max batch)
        self.keys: list[_Key] = []
        # Drop the table entries when the engine goes away, even without an explicit clear().
        self._finalizer = weakref.finalize(self, _drop, self.keys)

    def _views(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(weight as the model passes it to linear, the buffer it lives in)."""
        for name in LINEAR_BUFFERS:
            buffer = self.weights.buffers[name]
            for layer in range(buffer.shape[0]):
                yield buffer[layer], buffer
        head = self.weights["lm_head"]
        yield head, head

    def packs_any(self) -> bool:
        """Whether any weight is large enough for this layout (min_packed_bytes);
        else the engine keeps F.linear."""
        floor = min_packed_bytes(self.layout, self.blocked_dtype)
        return any(view.nbytes >= floor for view, _ in self._views())

    def refresh(self) -> None:
        """(Re)pack every linear weight from the plain buffers; call after any write to them.

        Blocked copies are rewritten in place where the weight's view is the one packed before (every refit
        after the first): skinny.block_weight(view, out)."""
        previous = {key: _TABLE[key][0] for key in self.keys if key in _TABLE}
        self.clear()
        floor = min_packed_bytes(self.layout, self.blocked_dtype)
        for view, buffer in self._views():
            if view.nbytes < floor:
                packed, out_features = None, None
            elif self.layout == "blocked":
                reuse = previous.get(_key(view))
                packed = skinny.block_weight(view, reuse, self.blocked_dtype)
                out_features = view.shape[0]
            else:
                packed, out_features = torch.ops.mkldnn._reorder_linear_weight(view, self.batch_hint), None
            key = _key(view)
            _TABLE[key] = (packed, weakref.ref(buffer), buffer._version, out_features)
            self.keys.append(key)

    def clear(self) -> None:
        """Forget the packed copies (the buffers are about to be freed or replaced)."""
        _drop(self.keys)


def _drop(keys: list[_Key]) -> None:
    for key in keys:
        _TABLE.pop(key, None)
    keys.clear()
