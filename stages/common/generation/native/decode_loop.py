"""Where the native engine runs its whole decode loop in one C++ call (kernels/decode_loop.py); its weights.

The loop replaces the engine's per-step Python (sampling, stop check, ~280 operator calls of the forward)
on one CPU device in float32, for the plain Llama layout: full attention in every layer, no o_proj bias
(a qkv bias is fine), head_dim a multiple of 16, sampling without top-k or top-p. Elsewhere, and with
`engine.cpu_decode_loop: false`, the engine keeps its torch step; `unsupported_reason` says why, and
execution_paths reports it.

It reads the linear weights as skinny_linear's [ceil(N/16), K, 16] blocks (qkv, o, gate_up, down per layer,
and the LM head): prepack's blocked copies where the engine prepacks (engine.cpu_prepack, the default), else
copies of its own, rewritten in place after every write to the plain buffers (`refresh`, from the engine's
_weights_written, after prepack's). Sharing prepack's copies spares a second copy of every linear weight and
its rewrite in every refit (a refit of the 114.8M benchmark model blocked 460 MB twice). The copies are
float32, or bfloat16 with engine.cpu_linear_weights (the loop widens them as it reads, at half the bytes).
"""

from __future__ import annotations

import torch

from alignflow.config import EngineConfig
from alignflow.kernels import decode_loop as kernel
from alignflow.kernels.skinny_linear import block_weight
from alignflow.stages.common.generation.native.prepack import LINEAR_BUFFERS, current_blocked
from alignflow.stages.common.generation.native.spec import LlamaFamilySpec
from alignflow.stages.common.generation.native.weights import InferenceWeights


def unsupported_reason(
    spec: LlamaFamilySpec,
    dtype: torch.dtype,
    device: torch.device,
    engine_config: EngineConfig,
    tensor_parallel: bool,
) -> str | None:
    """Why the engine cannot run the C++ loop for this model here, or None when it can
    (builds the extension)."""
    if not engine_config.cpu_decode_loop:
        return "off (engine.cpu_decode_loop: false)"
    if not engine_config.cpu_kernels:
        return "off (engine.cpu_kernels: false)"
    if device.type != "cpu" or dtype != torch.float32:
        return f"float32 on CPU only, not {str(dtype).removeprefix('torch.')} on {device.type}"
    if tensor_parallel:
        return "one device only, not tensor parallel"
    if any(window is not None for window in spec.sliding_windows):
        return "no sliding-window attention"
    if spec.o_bias:
        return "no o_proj bias"
    if spec.head_dim % 16 or spec.head_dim > 256:
        return f"head_dim a multiple of 16 up to 256, not {spec.head_dim}"
    if not kernel.available():
        return f"no C++ kernel: {kernel.unavailable_reason()}"
    return None


class CppDecodeLoop:
    """Blocked copies of one engine's linear weights and the call of the C++ loop over them."""

    def __init__(
        self, spec: LlamaFamilySpec, weights: InferenceWeights, blocked_dtype: torch.dtype = torch.float32
    ):
        self.spec = spec
        self.weights = weights
        self.blocked_dtype = blocked_dtype  # of its own copies, as prepack's (engine.cpu_linear_weights)
        self._blocked: dict[tuple[str, int], torch.Tensor] = {}
        self._layers: list[torch.Tensor] = []
        self._lm_head: torch.Tensor | None = None

    def refresh(self) -> None:
        """Take prepack's current blocked copy of every linear weight, or block it from the plain buffers (in
        place after the first time); call after any write, after prepack's refresh."""
        w = self.weights

        def blocked(view: torch.Tensor, previous: torch.Tensor | None) -> torch.Tensor:
            shared = current_blocked(view)
            return shared if shared is not None else block_weight(view, previous, self.blocked_dtype)

        for name in LINEAR_BUFFERS:
            for layer in range(self.spec.num_layers):
                self._blocked[name, layer] = blocked(w[name][layer], self._blocked.get((name, layer)))
        self._lm_head = blocked(w["lm_head"], self._lm_head)
        qkv_b = w.get("qkv_b")
        empty = w["norm"].new_empty(0)
        self._layers = [
            tensor
            for layer in range(self.spec.num_layers)
            for tensor in (
                w["ln_attn"][layer],
                self._blocked["qkv_w", layer],
                empty if qkv_b is None else qkv_b[layer],
                self._blocked["o_w", layer],
                w["ln_mlp"][layer],
                self._blocked["gate_up_w", layer],
                self._blocked["down_w", layer],
            )
        ]

    def clear(self) -> None:
        """Drop the blocked copies (the plain buffers were discarded); refresh() makes them again."""
        self._blocked.clear()
        self._layers = []
        self._lm_head = None

    def run(
        self,
        first_logits: torch.Tensor,
        k_cache: list[torch.Tensor],
        v_cache: list[torch.Tensor],
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        mask: torch.Tensor,
        positions: torch.Tensor,
        first_slot: int,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        ends: torch.Tensor,
        max_new_tokens: int,
        kept_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(tokens [B, new], log-probs [B, new], lengths [B], steps):
        the engine loop's outputs; see the kernel."""
        if self._lm_head is None:
            raise RuntimeError("CppDecodeLoop.run before refresh(): the blocked weights were never written")
        spec = self.spec
        return kernel.decode_loop(
            first_logits.contiguous(),
            self._layers,
            self.weights["embed"],
            self.weights["norm"],
            self._lm_head,
            k_cache,
            v_cache,
            cos,
            sin_signed,
            mask,
            positions,
            first_slot,
            temperature,
            seeds,
            ends,
            max_new_tokens,
            spec.num_heads,
            spec.num_kv_heads,
            spec.rms_norm_eps,
            kept_logits,
        )
