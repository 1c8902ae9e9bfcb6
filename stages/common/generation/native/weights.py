"""The native engine's inference weight layout and the streaming copy of Hugging Face tensors into it.

Layout (L layers, H hidden, I intermediate, V vocab, Q = heads*head_dim, K = kv_heads*head_dim):
    embed       [V, H]
    qkv_w       [L, Q + 2K, H]    rows: q_proj | k_proj | v_proj      (fused: one GEMM per layer)
    qkv_b       [L, Q + 2K]       Qwen2 / Llama attention_bias only
    o_w         [L, H, Q]
    o_b         [L, H]            Llama attention_bias only
    gate_up_w   [L, 2I, H]        rows: gate_proj | up_proj           (fused: one GEMM per layer)
    down_w      [L, H, I]
    ln_attn     [L, H]            input_layernorm
    ln_mlp      [L, H]            post_attention_layernorm
    norm        [H]
    lm_head     [V, H]            the same tensor as embed when embeddings are tied

Every HF parameter name maps to one slice of one buffer; a refit copies each incoming tensor into
its slice as it arrives (no second model copy, no re-allocation). This module does no arithmetic.

Tensor parallel (k ranks, see tensor_parallel.py): the same layout with the shapes of the rank's
shard (heads, KV heads, I / k; V -> ceil(V / k) vocab rows). An incoming full tensor is cut to the
rank's slice (a view) before the copy, so a rank copies its slice only and keeps no full tensor; an
incoming tensor of the slice's shape (the rollout workers' trainer sends each rank only its slice) is
copied as it is. The two shapes differ for every split parameter, so the shape says which arrived.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from alignflow.stages.common.generation.interface import RefitError, RefitStats
from alignflow.stages.common.generation.native.spec import LlamaFamilySpec
from alignflow.stages.common.generation.native.tensor_parallel import hf_parameter_shape

if TYPE_CHECKING:
    from alignflow.stages.common.generation.native.tensor_parallel import TensorParallel

# Per-layer HF suffix -> (buffer, which part of the fused rows).
_LAYER_PARTS: dict[str, tuple[str, str | None]] = {
    "self_attn.q_proj.weight": ("qkv_w", "q"),
    "self_attn.k_proj.weight": ("qkv_w", "k"),
    "self_attn.v_proj.weight": ("qkv_w", "v"),
    "self_attn.q_proj.bias": ("qkv_b", "q"),
    "self_attn.k_proj.bias": ("qkv_b", "k"),
    "self_attn.v_proj.bias": ("qkv_b", "v"),
    "self_attn.o_proj.weight": ("o_w", None),
    "self_attn.o_proj.bias": ("o_b", None),
    "mlp.gate_proj.weight": ("gate_up_w", "gate"),
    "mlp.up_proj.weight": ("gate_up_w", "up"),
    "mlp.down_proj.weight": ("down_w", None),
    "input_layernorm.weight": ("ln_attn", None),
    "post_attention_layernorm.weight": ("ln_mlp", None),
}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Non-parameter buffers some checkpoints carry; the engine computes its own RoPE tables.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def buffer_shapes(spec: LlamaFamilySpec) -> dict[str, tuple[int, ...]]:
    """Shape of every inference buffer (lm_head omitted when tied: it is `embed`)."""
    L, H, inner, V = spec.num_layers, spec.hidden_size, spec.intermediate_size, spec.vocab_size
    qkv = spec.q_size + 2 * spec.kv_size
    shapes = {
        "embed": (V, H),
        "qkv_w": (L, qkv, H),
        "o_w": (L, H, spec.q_size),
        "gate_up_w": (L, 2 * inner, H),
        "down_w": (L, H, inner),
        "ln_attn": (L, H),
        "ln_mlp": (L, H),
        "norm": (H,),
    }
    if spec.qkv_bias:
        shapes["qkv_b"] = (L, qkv)
    if spec.o_bias:
        shapes["o_b"] = (L, H)
    if not spec.tie_word_embeddings:
        shapes["lm_head"] = (V, H)
    return shapes


@dataclass
class Destination:
    """Where one HF tensor goes: rows [start, stop) of buffer[layer] (or the whole buffer)."""

    buffer: str
    layer: int | None
    start: int | None
    stop: int | None
    param: str = field(default="", compare=False)  # the HF parameter: per-layer suffix or top-level name

    @property
    def key(self) -> tuple[str, int | None, int | None]:
        return (self.buffer, self.layer, self.start)


class InferenceWeights:
    """The engine's own weight buffers, allocated once; refit copies into them in place.

    spec: the whole model. tp: this rank's place in a tensor-parallel engine (None: the whole model
    on one device); the buffers then have the shapes of `local_spec`, the rank's shard.
    """

    def __init__(self, spec: LlamaFamilySpec, dtype: torch.dtype, device: torch.device | str,
                 tp: TensorParallel | None = None):
        self.spec = spec
        self.tp = tp
        self.local_spec = tp.local_spec if tp is not None else spec
        self.dtype = dtype
        self.device = torch.device(device)
        self.buffers: dict[str, torch.Tensor] = self._new_buffers()
        q, k, i = self.local_spec.q_size, self.local_spec.kv_size, self.local_spec.intermediate_size
        self._row_ranges = {
            "q": (0, q),
            "k": (q, q + k),
            "v": (q + k, q + 2 * k),
            "gate": (0, i),
            "up": (i, 2 * i),
        }
        self.expected: set[tuple[str, int | None, int | None]] = {d.key for d in self._all_destinations()}

    # -- views the model code reads --------------------------------------------------------------
    def __getitem__(self, name: str) -> torch.Tensor:
        if name == "lm_head" and self.spec.tie_word_embeddings:
            return self.buffers["embed"]
        return self.buffers[name]

    def get(self, name: str) -> torch.Tensor | None:
        if name == "lm_head" or name in self.buffers:
            return self[name]
        return None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def data_ptrs(self) -> dict[str, int]:
        return {k: t.data_ptr() for k, t in self.buffers.items()}

    # -- HF name mapping ---------------------------------------------------------------------------
    def destination(self, hf_name: str) -> Destination | None:
        """Where an HF parameter goes; None for names that are deliberately ignored; RefitError if unknown."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        if hf_name == "model.embed_tokens.weight":
            return Destination("embed", None, None, None, hf_name)
        if hf_name == "model.norm.weight":
            return Destination("norm", None, None, None, hf_name)
        if hf_name == "lm_head.weight":
            # Tied: the trainer may or may not send lm_head; it is the embedding either way.
            return Destination(
                "embed" if self.spec.tie_word_embeddings else "lm_head", None, None, None, hf_name
            )
        match = _LAYER_NAME.match(hf_name)
        if match and match.group(2) in _LAYER_PARTS:
            layer = int(match.group(1))
            if layer >= self.spec.num_layers:
                raise RefitError(
                    f"{hf_name!r}: layer {layer} but the model has {self.spec.num_layers} layers"
                )
            buffer, part = _LAYER_PARTS[match.group(2)]
            if buffer not in self.buffers:
                raise RefitError(
                    f"{hf_name!r}: this {self.spec.model_type} model has no such parameter "
                    f"(qkv_bias={self.spec.qkv_bias}, o_bias={self.spec.o_bias})"
                )
            start, stop = self._row_ranges[part] if part else (None, None)
            return Destination(buffer, layer, start, stop, match.group(2))
        raise RefitError(
            f"unknown parameter name {hf_name!r} for a {self.spec.model_type} model; expected Hugging Face "
            "names such as 'model.layers.0.self_attn.q_proj.weight' (strip wrapper prefixes like 'module.')"
        )

    def _all_destinations(self) -> Iterator[Destination]:
        yield Destination("embed", None, None, None, "model.embed_tokens.weight")
        yield Destination("norm", None, None, None, "model.norm.weight")
        if not self.spec.tie_word_embeddings:
            yield Destination("lm_head", None, None, None, "lm_head.weight")
        for layer in range(self.spec.num_layers):
            for suffix in _LAYER_PARTS:
                buffer, part = _LAYER_PARTS[suffix]
                if buffer in self.buffers:
                    start, stop = self._row_ranges[part] if part else (None, None)
                    yield Destination(buffer, layer, start, stop, suffix)

    def view(self, dest: Destination) -> torch.Tensor:
        target = self.buffers[dest.buffer]
        if dest.layer is not None:
            target = target[dest.layer]
        if dest.start is not None:
            target = target[dest.start : dest.stop]
        return target

    @torch.no_grad()
    def copy_stream(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, partial: bool) -> RefitStats:
        """Copy each (HF name, tensor) into its slice as it arrives; check coverage at the end."""
        started = time.perf_counter()
        covered: set[tuple[str, int | None, int | None]] = set()
        count = nbytes = 0
        for name, tensor in named_tensors:
            dest = self.destination(name)
            if dest is None:
                continue
            target = self.view(dest)
            shape = tuple(tensor.shape)
            source = tensor.detach()
            if self.tp is None:
                if shape != tuple(target.shape):
                    raise RefitError(
                        f"{name!r}: shape {shape} but the engine expects {tuple(target.shape)}; "
                        "was the engine built from a checkpoint of a different architecture?"
                    )
            else:
                full, own = hf_parameter_shape(dest.param, self.spec), self.tp.slice_shape(dest.param)
                if shape == full:
                    # This rank's slice, a view: the copy below reads the slice only.
                    source = self.tp.cut(dest.param, source)
                elif shape != own:  # else: the sender already cut this rank's slice (the rollout workers)
                    raise RefitError(
                        f"{name!r}: shape {shape} but the engine expects {full} (or tensor-parallel rank "
                        f"{self.tp.rank}'s slice of it, {own}); was the engine built from a checkpoint of "
                        "a different architecture?"
                    )
                target = target[: source.shape[0]]  # a padded last vocab shard holds fewer real rows
            # copy_ casts dtype and moves device in one pass; a pinned CPU source copies asynchronously.
            target.copy_(source, non_blocking=tensor.device.type == "cpu" and tensor.is_pinned())
            covered.add(dest.key)
            count += 1
            nbytes += source.numel() * source.element_size()
            # Drop the full tensor before asking the stream for the next one, so the caller can free it
            # while producing the next: at most one incoming tensor is alive at a time.
            del tensor, source
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        missing = self.expected - covered
        if missing and not partial:
            names = sorted(self.hf_name(k) for k in missing)
            raise RefitError(
                f"refit did not cover {len(missing)} of {len(self.expected)} parameters (first: "
                f"{names[:5]}); the engine now holds a mix of old and new weights. Send every parameter, or "
                "pass partial=True if updating a subset is intended"
            )
        return RefitStats(tensors=count, bytes=nbytes, seconds=time.perf_counter() - started)

    def hf_name(self, key: tuple[str, int | None, int | None]) -> str:
        """The HF parameter name of a destination key (for error messages)."""
        buffer, layer, start = key
        top = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "lm_head": "lm_head.weight"}
        if layer is None:
            return top[buffer]
        for suffix, (buf, part) in _LAYER_PARTS.items():
            if buf == buffer and (self._row_ranges[part][0] if part else None) == start:
                return f"model.layers.{layer}.{suffix}"
        return f"{buffer}[{layer}]"

    # -- moving between devices (unload / reload) -------------------------------------------------
    def move_to(self, device: torch.device | str, *, pin: bool = False) -> None:
        """Move every buffer (new allocations on `device`; the old memory is freed)."""
        device = torch.device(device)
        moved = {}
        for name, t in self.buffers.items():
            new = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin and device.type == "cpu")
            new.copy_(t)
            moved[name] = new
        self.buffers = moved
        self.device = device

    def discard(self) -> None:
        """Free every buffer; allocate() must follow before any use."""
        self.buffers = {name: torch.empty(0, dtype=self.dtype) for name in self.buffers}

    def allocate(self, device: torch.device | str) -> None:
        """(Re)allocate uninitialised buffers on `device` (after discard)."""
        self.device = torch.device(device)
        self.buffers = self._new_buffers()

    def _new_buffers(self) -> dict[str, torch.Tensor]:
        """Uninitialised buffers of the held shapes on self.device (zeroed when tensor parallel: a padded
        last vocab shard has rows no refit writes, and their logits, cut off after the gather, stay
        finite)."""
        new = torch.empty if self.tp is None else torch.zeros
        return {
            name: new(shape, dtype=self.dtype, device=self.device)
            for name, shape in buffer_shapes(self.local_spec).items()
        }


def checkpoint_tensors(checkpoint_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream (name, tensor) from a checkpoint's safetensors shards, one tensor in memory at a time."""
    from safetensors import safe_open

    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (checkpoint_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        found = sorted(p.name for p in checkpoint_dir.iterdir()) if checkpoint_dir.is_dir() else []
        raise FileNotFoundError(
            f"{checkpoint_dir}: no model.safetensors or model.safetensors.index.json (found {found[:10]}); "
            "the native engine reads safetensors only: re-save with save_pretrained(..., "
            "safe_serialization=True)"
        )
    for file in files:
        with safe_open(str(checkpoint_dir / file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                yield name, handle.get_tensor(name)


def saved_engine_tensors(weights_file: Path, spec: LlamaFamilySpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream a saved (one-device) engine's fused buffers back as (HF name, tensor), one layer's slice at a
    time.

    A tensor-parallel rank loads a saved engine through this and its refit path (each rank cuts its shard
    of every full tensor), so no rank ever holds the whole model: the largest tensor alive is one layer's
    fused QKV or gate/up rows (or the embedding), read from the file with safetensors' slices.
    """
    from safetensors import safe_open

    q, k, inner = spec.q_size, spec.kv_size, spec.intermediate_size
    parts = {
        "qkv_w": (("q_proj.weight", 0, q), ("k_proj.weight", q, q + k), ("v_proj.weight", q + k, q + 2 * k)),
        "qkv_b": (("q_proj.bias", 0, q), ("k_proj.bias", q, q + k), ("v_proj.bias", q + k, q + 2 * k)),
        "gate_up_w": (("gate_proj.weight", 0, inner), ("up_proj.weight", inner, 2 * inner)),
    }
    whole = {
        "o_w": "self_attn.o_proj.weight",
        "o_b": "self_attn.o_proj.bias",
        "down_w": "mlp.down_proj.weight",
        "ln_attn": "input_layernorm.weight",
        "ln_mlp": "post_attention_layernorm.weight",
    }
    prefix = {"qkv_w": "self_attn.", "qkv_b": "self_attn.", "gate_up_w": "mlp."}
    with safe_open(str(weights_file), framework="pt", device="cpu") as handle:
        names = set(handle.keys())
        yield "model.embed_tokens.weight", handle.get_tensor("embed")
        yield "model.norm.weight", handle.get_tensor("norm")
        if "lm_head" in names:
            yield "lm_head.weight", handle.get_tensor("lm_head")
        for layer in range(spec.num_layers):
            for buffer in ("qkv_w", "qkv_b", "o_w", "o_b", "gate_up_w", "down_w", "ln_attn", "ln_mlp"):
                if buffer not in names:
                    continue  # qkv_b / o_b exist for biased models only
                rows = handle.get_slice(buffer)[layer : layer + 1][0]
                if buffer in whole:
                    yield f"model.layers.{layer}.{whole[buffer]}", rows
                    continue
                for suffix, start, stop in parts[buffer]:
                    yield f"model.layers.{layer}.{prefix[buffer]}{suffix}", rows[start:stop]
                del rows
