"""A Llama-family training forward with a fraction of transformers' operator calls, over the HF parameters.

Why: the demo's RL step trains a 64-wide, 2-layer model, where a forward and backward are a few
hundred tiny operator calls and Python, not arithmetic, sets the time. transformers' LlamaModel
spends much of them outside the math: the mask factory, the rotary module (cos/sin recomputed per
call), per-layer attention dispatch, repeat_kv copies for GQA, output records. This forward does the
same arithmetic in fewer calls: cos/sin gathered from a cached table, one additive mask shared by
every layer, one-node RMSNorm, RoPE and SwiGLU (kernels/rms_norm.py, rope.py, swiglu.py), SDPA with native GQA
(timed by benchmarks/training_forward.py: docs/performance.md#the-training-step). Under CPU autocast
(bf16 on CPUs with bf16 arithmetic) row counts bucketed for oneDNN pay (pads_rows); rows with enough padding
run every layer but attention on their real tokens only (compact); on CPU, in fp32 or
under autocast, attention runs as fp32 matmuls for rows up to EAGER_ATTENTION_MAX_LEN (cpu_attention: SDPA's
backward is slow there).

Same parameters, same module calls for every linear and the embedding, so LoRA adapters (peft wraps
those modules), DeepSpeed ZeRO-1/2 and checkpoints see nothing different; it returns what
`model.base_model(...).last_hidden_state` would. Exact up to float summation order (fp32: ~1e-6;
the parity test, tests/stages/common/training/test_llama_forward.py, states the bound). What it is not: a
general model runner. `supports` refuses (so callers keep transformers' forward) ZeRO-3 (parameters are
gathered by module hooks this code would bypass for the norms), attention dropout in training, and every
architecture the native engine's spec refuses.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from alignflow.kernels.rope import apply_rope
from alignflow.kernels.swiglu import silu_mul
from alignflow.stages.common.generation.interface import UnsupportedArchitectureError
from alignflow.stages.common.generation.native.model import rms_norm, signed_sin
from alignflow.stages.common.generation.native.spec import LlamaFamilySpec, rope_tables, spec_from_hf_config
from alignflow.stages.common.training import cpu_attention
from alignflow.stages.common.training.packing import compacts
from alignflow.stages.common.training.precision import EAGER_ATTENTION_MAX_LEN

# id(config) -> (a weak reference to that config, spec, cos, sin). PretrainedConfig defines __eq__ and so is
# not hashable, hence the id key; the reference proves the entry is that config's and not a dead one's whose
# id a new config reused (a stale spec gave a critic the wrong KV-head count in CI), and drops the entry with
# the config.
_TABLES: dict[int, tuple[weakref.ref, LlamaFamilySpec, Tensor, Tensor]] = {}
# id(config) -> (a weak reference to it, why llama_hidden_states cannot run it, or None): supports' cache.
_UNSUPPORTED: dict[int, tuple[weakref.ref, str | None]] = {}


def supports(backbone: Any) -> str | None:
    """None when `llama_hidden_states` runs this backbone exactly; else why not (one phrase).

    Every RL forward asks (11 times per demo iteration): the config's answer is kept per config object, as
    _spec_and_rope's tables are, because working it out again costs more than the rest of the call
    (spec_from_hf_config reads ~20 of transformers' config attributes, each through its __getattribute__)."""
    config = getattr(backbone, "config", None)
    if config is None or not hasattr(backbone, "layers") or not hasattr(backbone, "embed_tokens"):
        return "not a transformers Llama-family backbone"
    entry = _UNSUPPORTED.get(id(config))
    if entry is None or entry[0]() is not config:
        try:
            spec_from_hf_config(config, config.max_position_embeddings)
            reason = None
        except UnsupportedArchitectureError as exc:
            reason = str(exc).split(": ", 1)[-1].split(". Use")[0]
        entry = _UNSUPPORTED[id(config)] = (_forgetting_ref(config, _UNSUPPORTED), reason)
    if entry[1] is not None:
        return entry[1]
    if backbone.training and float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return f"attention_dropout={config.attention_dropout} in training"
    if any(hasattr(p, "ds_id") for p in backbone.parameters()):
        return "DeepSpeed ZeRO-3 partitions the parameters (gathered by module hooks)"
    return None


def _forgetting_ref(config: Any, table: dict[int, tuple]) -> weakref.ref:
    """A weak reference to `config` that drops table[id(config)] with the config
    (while the entry is its own)."""
    key = id(config)

    def forget(ref: weakref.ref) -> None:
        if key in table and table[key][0] is ref:
            del table[key]

    return weakref.ref(config, forget)


def _spec_and_rope(config: Any, device: torch.device) -> tuple[LlamaFamilySpec, Tensor, Tensor]:
    """The spec and cos/sin tables [max_position_embeddings, head_dim], built once per config object."""
    key = id(config)
    entry = _TABLES.get(key)
    if entry is None or entry[0]() is not config or entry[2].device != device:
        spec = spec_from_hf_config(config, config.max_position_embeddings)
        cos, sin = rope_tables(config, spec, config.max_position_embeddings)
        sin = signed_sin(sin)  # apply_rope's table
        entry = _TABLES[key] = (_forgetting_ref(config, _TABLES), spec, cos.to(device), sin.to(device))
    return entry[1], entry[2], entry[3]


def attention_biases(
    spec: LlamaFamilySpec,
    segment_ids: Tensor,
    dtype: torch.dtype,
    prefix_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
) -> dict[int | None, Tensor]:
    """Additive masks [B, 1, T, T] per distinct sliding window: query i sees key j when j <= i, j is in i's
    sequence (`segment_ids` equal and nonzero: an attention mask is one sequence per row; packed rows hold
    several, stages/common/training/packing.py) and i - j < window. Every position also sees itself, so a
    padding row is never empty (empty rows give NaN, and padding outputs feed nothing real: real queries never
    see padding keys).

    prefix_ids: packed rows that share a prompt: query i also sees the keys of segment prefix_ids[i] (its
    prompt's), and the window counts `position_ids` apart, not slots (a later response of the unit sits
    further from its prompt than its positions say).
    """
    width = segment_ids.shape[1]
    slots = torch.arange(width, device=segment_ids.device)
    i, j = slots[:, None], slots[None, :]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    if prefix_ids is not None:
        same = same | (prefix_ids[:, :, None] == segment_ids[:, None, :])
    base = (j <= i)[None] & same & (segment_ids != 0)[:, None, :]
    apart = (i - j)[None] if prefix_ids is None else position_ids[:, :, None] - position_ids[:, None, :]
    biases = {}
    for window in set(spec.sliding_windows):
        allowed = base if window is None else base & (apart < window)
        allowed = (allowed | (i == j)[None]).unsqueeze(1)
        biases[window] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
            ~allowed, float("-inf")
        )
    return biases


def bucketed_rows(count: int) -> int:
    """`count` rounded up to one of 8 sizes per octave (16 and less unchanged): at most 1/8 more rows."""
    step = 1 << max(0, count.bit_length() - 4)
    return -(-count // step) * step


def under_cpu_autocast(device: torch.device) -> bool:
    """Whether matmuls on `device` run in CPU autocast (bf16 through oneDNN):
    where bucketed rows and cpu_attention pay."""
    return device.type == "cpu" and torch.is_autocast_enabled("cpu")


def pads_rows(pad_rows: bool | None, device: torch.device) -> bool:
    """Whether the linear layers run on bucketed row counts: `pad_rows`, or when None, under CPU autocast.

    Why: under CPU autocast torch runs bf16 matmuls through oneDNN, which compiles a kernel for every new
    shape: a matmul at a new row count costs many times one at a count it has seen (MKL's fp32 costs the
    same either way), and packed RL minibatches have a new token count every iteration, which slows a
    whole GRPO step. Rounded up to bucketed_rows, the counts repeat after a few iterations."""
    return under_cpu_autocast(device) if pad_rows is None else pad_rows


def bucketed_keep(keep: Tensor, pad_rows: bool | None = None) -> Tensor:
    """`keep` (llama_hidden_states' read positions) lengthened to bucketed_rows by repeating its first index,
    where `pads_rows`: the heads after the backbone (LM, value, score) then also see a repeating row count.
    Callers read the first len(keep) rows of what comes out; the repeats' outputs get no gradient."""
    if not pads_rows(pad_rows, keep.device) or keep.numel() == 0:
        return keep
    extra = bucketed_rows(keep.numel()) - keep.numel()
    return torch.cat((keep, keep[:1].expand(extra))) if extra else keep


def llama_hidden_states(
    backbone: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    keep: Tensor | None = None,
    prefix_ids: Tensor | None = None,
    pad_rows: bool | None = None,
    compact: bool | None = None,
) -> Tensor:
    """The final-norm hidden states [B, T, H] of a transformers Llama/Qwen2/Mistral backbone (`model.model`).

    attention_mask: 1 on real tokens, or the segment ids of packed rows (stages/common/training/packing.py:
    each position attends to its own sequence only).
    keep: flat indices into the B * T positions that the caller reads (the response-predicting positions
    of an RL batch, a classifier's read-out): returns their rows, [N, H], equal to
    `llama_hidden_states(...).reshape(-1, H)[keep]`. Every layer's keys and values still need every
    position, but only the read positions' queries feed the output, so the last layer computes its
    attention for all and its o_proj, MLP and the final norm for the kept rows only (a faster
    fwd+bwd where responses are a fraction of the rows: benchmarks/training_forward.py).
    prefix_ids: packed rows whose sequences share a prompt (PackedRows.prefix_ids; attention_biases).

    compact: the embedding, linear layers, norms, RoPE and MLPs run on the real tokens only (attention_mask
    nonzero), and only attention on the [B, T] layout, its inputs scattered into it and its output gathered
    back (compact_slots); None: where there is enough padding to pay (compact_min_padding). Padding
    positions then come out as zeros rather than as what their masked computation gave (nothing reads them).
    pad_rows: the linear layers, norms and MLPs run on their rows zero-padded to bucketed_rows (attention on
    the real ones); None: where `pads_rows` (CPU autocast). The result is the same.

    Callers check `supports(backbone)` first. Arithmetic as transformers': RMSNorm in float32, rotate-half
    RoPE with the same tables, softmax(QK^T * scaling + mask) V, SwiGLU MLP.
    """
    config = backbone.config
    spec, cos_table, sin_table = _spec_and_rope(config, input_ids.device)
    batch, width = input_ids.shape
    positions = batch * width
    slots = compact_slots(attention_mask, keep, compact, spec.hidden_size)
    # The rows the linear layers see: every position, or the real ones (`slots`, in position order).
    tokens = positions if slots is None else slots.numel()
    x = backbone.embed_tokens(input_ids.reshape(-1) if slots is None else input_ids.reshape(-1)[slots])
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else x.dtype
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")
    padding = bucketed_rows(tokens) - tokens if pads_rows(pad_rows, x.device) else 0
    if padding:
        x = F.pad(x, (0, 0, 0, padding))  # zero rows: the norms give 0 there, nothing becomes NaN
    # [1, tokens, 1, D]: broadcast over heads in the [1, tokens, heads, D] layout the projections come out in.
    token_positions = position_ids.reshape(-1) if slots is None else position_ids.reshape(-1)[slots]
    cos = cos_table[token_positions].to(dtype)[None, :, None]
    sin = sin_table[token_positions].to(dtype)[None, :, None]
    heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    eps = spec.rms_norm_eps
    # On CPU, SDPA's flash-attention backward is slow at RL lengths (several times fp32 matmuls under bf16
    # autocast, ~20% slower in fp32): fp32 matmuls up to the eager-attention length (cpu_attention), whose
    # masks are built in fp32 once rather than cast in every layer. Not for bf16 weights outside autocast:
    # cpu_attention returns fp32, which o_proj would not take.
    explicit_attention = (
        (under_cpu_autocast(x.device) or (x.device.type == "cpu" and x.dtype == torch.float32))
        and width <= EAGER_ATTENTION_MAX_LEN
        and cpu_attention.fits(batch, heads, width)
    )
    biases = attention_biases(
        spec, attention_mask, torch.float32 if explicit_attention else dtype, prefix_ids, position_ids
    )

    def real(rows: Tensor) -> Tensor:
        # The first `tokens` rows, a view, so the padding rows never reach attention; no slice when there
        # are none, since a slice's backward writes a zero gradient of the whole block and copies into it.
        return rows[:tokens] if padding else rows

    def heads_of(rows: Tensor, count: int, rope: bool) -> Tensor:
        """A projection's real rows [tokens, count * D] -> [B, count, T, D] for attention (RoPE'd first)."""
        rows = real(rows)
        if rope:
            rows = apply_rope(rows.view(1, tokens, count, head_dim), cos, sin).view(tokens, -1)
        if slots is not None:  # index_copy: its backward is a gather (autograd's index_put's is far slower)
            rows = rows.new_zeros(positions, rows.shape[1]).index_copy(0, slots, rows)
        return rows.view(batch, width, count, head_dim).transpose(1, 2)

    kept_tokens = None if keep is None else (keep if slots is None else _token_rows(slots, positions)[keep])
    last = len(backbone.layers) - 1
    for index, layer in enumerate(backbone.layers):
        attention = layer.self_attn
        h = rms_norm(x, layer.input_layernorm.weight, eps)
        q = heads_of(attention.q_proj(h), heads, rope=True)
        k = heads_of(attention.k_proj(h), kv_heads, rope=True)
        v = heads_of(attention.v_proj(h), kv_heads, rope=False)
        if explicit_attention:
            o = cpu_attention.attention(q, k, v, biases[spec.sliding_windows[index]], attention.scaling)
        else:
            o = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=biases[spec.sliding_windows[index]],
                scale=attention.scaling,
                enable_gqa=kv_heads != heads,
            )
        o = o.transpose(1, 2).reshape(positions, heads * head_dim)
        if keep is not None and index == last:
            x, o = x[kept_tokens], o[keep]
        else:
            if slots is not None:  # index_select: its backward is an index_add
                o = o.index_select(0, slots)
            if padding:
                o = F.pad(o, (0, 0, 0, padding))
        x = x + attention.o_proj(o)
        h = rms_norm(x, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        x = x + mlp.down_proj(silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
    hidden = rms_norm(x, backbone.norm.weight, eps)
    if keep is None:
        hidden = real(hidden)
        if slots is not None:
            hidden = hidden.new_zeros(positions, hidden.shape[1]).index_copy(0, slots, hidden)
        return hidden.view(batch, width, -1)
    if not backbone.layers:  # no layer to select in
        hidden = hidden[kept_tokens]
    return hidden


# Compaction (llama_hidden_states' `compact`) pays where the padding is at least this share of the slots times
# 1 / hidden_size: its scatters and gathers around attention grow with the hidden size, what it saves in the
# linear layers with its square. Measured (benchmarks/compaction.py, a training step on a 2-core EPYC): the
# 256-wide RL benchmark model 0.98x at 3.6% padding, 1.11x at 15.6%, 1.21x at 25% (even at ~6%); the 64-wide
# demo model 0.97x at 15.6%, 1.09x at 25% (even at ~20%).
COMPACT_PADDING_WIDTH = 16


def compact_min_padding(hidden_size: int) -> float:
    """The share of padding from which llama_hidden_states compacts a `hidden_size`-wide model's rows (1/16 at
    256, 1/4 at 64, 1/48 at 768)."""
    return min(1.0, COMPACT_PADDING_WIDTH / hidden_size)


def compact_slots(
    attention_mask: Tensor, keep: Tensor | None, compact: bool | None, hidden_size: int
) -> Tensor | None:
    """The flat positions of the real tokens (attention_mask nonzero), in order, where llama_hidden_states
    runs compacted; None where it runs every position: `compact` False, no padding, less of it than
    compact_min_padding(hidden_size) when `compact` is None, or a kept position that is padding (the padded
    layout's response columns: every position's output is then needed)."""
    if compact is False:
        return None
    real = attention_mask.reshape(-1) != 0
    slots = real.nonzero().squeeze(1)  # also the count: one host sync where a count and then slots took two
    threshold = 0.0 if compact else compact_min_padding(hidden_size)
    if not compacts(slots.numel(), real.numel(), threshold):
        return None
    if keep is not None and keep.numel() and not bool(real[keep].all()):
        return None
    return slots


def _token_rows(slots: Tensor, positions: int) -> Tensor:
    """[positions] long: each position's row among the compacted tokens, -1 for padding."""
    rows = torch.full((positions,), -1, dtype=torch.long, device=slots.device)
    return rows.index_copy_(0, slots, torch.arange(slots.numel(), device=slots.device))
