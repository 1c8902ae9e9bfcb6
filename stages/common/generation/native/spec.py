"""What the native engine reads from a Hugging Face config: the Llama-family shape, and its RoPE tables.

Only Llama, Qwen2 (QKV bias, optional per-layer sliding window) and Mistral (sliding window) are
accepted; anything else raises UnsupportedArchitectureError pointing at `engine.backend: hf`.
This module does not hold weights or run anything.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from alignflow.stages.common.generation.interface import UnsupportedArchitectureError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
# RoPE variants whose frequencies do not depend on the batch (see `rope_tables`).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _unsupported(model_type: str, reason: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"native engine cannot run this checkpoint (model_type={model_type!r}): {reason}. "
        "Use `engine.backend: hf`, which runs any causal LM through transformers."
    )


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE dict {rope_type, rope_theta, ...} for transformers 5
    (rope_parameters) and 4 (rope_scaling)."""
    if hasattr(hf_config, "standardize_rope_params"):
        hf_config.standardize_rope_params()
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # transformers 4.x
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
        params = {
            "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
            "rope_theta": getattr(hf_config, "rope_theta", 10000.0),
            **scaling,
        }
    params = dict(params)
    if params.get("rope_type") is None:
        params["rope_type"] = params.get("type", "default")
    return params


@dataclass(frozen=True)
class LlamaFamilySpec:
    """The architecture numbers the native engine needs, all checked."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool  # Qwen2 always; Llama when attention_bias
    o_bias: bool  # Llama when attention_bias
    tie_word_embeddings: bool
    rope_type: str
    sliding_windows: tuple[int | None, ...]  # per layer; None = full causal attention

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def spec_from_hf_config(hf_config: Any, max_seq_len: int) -> LlamaFamilySpec:
    """Check an HF config is one the native engine runs exactly as transformers does, and describe it."""
    model_type = getattr(hf_config, "model_type", "?")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(
            model_type, f"only the Llama family ({', '.join(SUPPORTED_MODEL_TYPES)}) is supported"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise _unsupported(model_type, f"hidden_act={act!r} (only SwiGLU with silu)")
    if getattr(hf_config, "mlp_bias", False):
        raise _unsupported(model_type, "mlp_bias=True")
    if (getattr(hf_config, "pretraining_tp", 1) or 1) != 1:
        raise _unsupported(model_type, f"pretraining_tp={hf_config.pretraining_tp}")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    if heads % kv_heads:
        raise _unsupported(
            model_type, f"num_attention_heads={heads} not a multiple of num_key_value_heads={kv_heads}"
        )

    rope = rope_parameters(hf_config)
    rope_type = rope["rope_type"]
    if rope.get("partial_rotary_factor", 1.0) != 1.0:
        raise _unsupported(model_type, f"partial_rotary_factor={rope['partial_rotary_factor']}")
    if rope_type == "dynamic":
        # Dynamic NTK rescales frequencies from the longest sequence in the batch; below the trained
        # length it equals the default RoPE, so it is exact as long as the cache never goes beyond it.
        if max_seq_len > hf_config.max_position_embeddings:
            raise _unsupported(
                model_type,
                f"rope_type 'dynamic' with engine.max_seq_len={max_seq_len} > max_position_embeddings="
                f"{hf_config.max_position_embeddings} (frequencies would depend on the batch); lower "
                "max_seq_len",
            )
    elif rope_type not in STATIC_ROPE_TYPES:
        raise _unsupported(
            model_type, f"rope_type {rope_type!r} (supported: {', '.join(STATIC_ROPE_TYPES)}, dynamic)"
        )

    layers = hf_config.num_hidden_layers
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
        window = getattr(hf_config, "sliding_window", None)
        layer_types = getattr(hf_config, "layer_types", None)
        if layer_types is None:  # transformers 4.x: use_sliding_window + max_window_layers
            use = getattr(hf_config, "use_sliding_window", False)
            first = getattr(hf_config, "max_window_layers", layers)
            layer_types = [
                "sliding_attention" if use and i >= first else "full_attention" for i in range(layers)
            ]
        windows = tuple(window if t == "sliding_attention" else None for t in layer_types)
    else:
        bias = bool(getattr(hf_config, "attention_bias", False))
        qkv_bias, o_bias = bias, bias
        window = getattr(hf_config, "sliding_window", None) if model_type == "mistral" else None
        windows = (window,) * layers
    # A window at least as long as the cache never masks anything: drop it (cheaper masks).
    windows = tuple(w if w is not None and w < max_seq_len else None for w in windows)

    return LlamaFamilySpec(
        model_type=model_type,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        rope_type=rope_type,
        sliding_windows=windows,
    )


def rope_inverse_frequencies(hf_config: Any, spec: LlamaFamilySpec) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention scaling) exactly as transformers computes them."""
    rope = rope_parameters(hf_config)
    if spec.rope_type in ("default", "dynamic"):
        # transformers' default formula; 'dynamic' equals it within max_position_embeddings (checked above).
        dim = spec.head_dim
        inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[spec.rope_type](hf_config, None)
    return inv_freq.float(), float(scaling)


def rope_tables(hf_config: Any, spec: LlamaFamilySpec, max_seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, head_dim] float32 for positions 0..max_seq_len-1
    (transformers' layout: halves repeated)."""
    inv_freq, scaling = rope_inverse_frequencies(hf_config, spec)
    positions = torch.arange(max_seq_len, dtype=torch.float)
    # Same op order as transformers (position * inv_freq, then cos/sin, then scale) so tables match bit for
    # bit.
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling
