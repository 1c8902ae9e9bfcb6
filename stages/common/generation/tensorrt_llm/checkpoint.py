"""HF Llama checkpoint -> TensorRT-LLM checkpoint, sharded for a tensor x pipeline-parallel mapping, and back.

A TensorRT-LLM checkpoint is a folder with `config.json` (its PretrainedConfig: architecture,
dtype, shapes, `mapping`) and one `rank{i}.safetensors` per rank, i = pp_rank * tp_size + tp_rank
(TensorRT-LLM's Mapping). `trtllm-build` / `tensorrt_llm.builder.build` compile one engine per rank
from it. This module writes that folder with torch and safetensors only: it never imports
tensorrt_llm, so the resharding runs and is tested on any CPU.

Names and layout per rank (HF [out, in] shapes are kept; h query heads, g KV heads, d head size,
k = tp_size, V vocab, P = ceil(V / k)):

    transformer.vocab_embedding.weight           model.embed_tokens, whole [V, H] (first stage only;
                                                 use_parallel_embedding=false, TensorRT-LLM's default)
    transformer.layers.{j}.input_layernorm.weight
    transformer.layers.{j}.attention.qkv.weight  [q_r; k_r; v_r] of the rank's heads (h/k query heads,
      (.bias with attention_bias)                g/k KV heads; g < k: KV head r*g//k copied onto k/g ranks)
    transformer.layers.{j}.attention.dense.weight  o_proj, the input columns of the rank's query heads
      (.bias, whole: added once after the all-reduce)
    transformer.layers.{j}.post_layernorm.weight post_attention_layernorm
    transformer.layers.{j}.mlp.fc.weight         gate_proj rows (TensorRT-LLM's GatedMLP:
                                                 act(fc(x)) * gate(x))
    transformer.layers.{j}.mlp.gate.weight       up_proj rows
    transformer.layers.{j}.mlp.proj.weight       down_proj input columns
    transformer.ln_f.weight                      model.norm (last stage only)
    lm_head.weight                               [P, H] rows of lm_head (or of the tied embedding), the last
                                                 rank's tail zero-padded to P (last stage only)

j is the layer's index inside its pipeline stage: stage p holds layers [p L/P, (p+1) L/P) renumbered
from 0, as TensorRT-LLM's converter writes them. The column / row / vocab cuts are the native
engine's rules (`native/tensor_parallel.py`: SHARDING, shard_of, vocab_rows), not a second copy.

One code path converts both a checkpoint folder (tensors read one at a time from its safetensors)
and the trainer's refit stream: `StreamConverter` emits per-rank (name, tensor) pieces as HF tensors
arrive, buffering only q/k/v (and their biases) of a layer until all three are there.

Not here: building or running an engine (engine.py), quantisation, Qwen2 / Mistral (TensorRT-LLM
has other converters for them).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from alignflow.stages.common.generation.interface import (
    DTYPE_NAMES,
    UnsupportedArchitectureError,
    resolve_dtype,
)
from alignflow.stages.common.generation.native.spec import (
    LlamaFamilySpec,
    rope_parameters,
    spec_from_hf_config,
)
from alignflow.stages.common.generation.native.tensor_parallel import (
    TensorParallelError,
    check_tensor_parallel,
    hf_parameter_shape,
    shard_of,
    sharding_rule,
    vocab_rows,
)
from alignflow.stages.common.generation.native.weights import checkpoint_tensors

CONFIG_FILE = "config.json"
# Written into config.json under "alignflow" (TensorRT-LLM sets unknown keys as attributes and warns).
LAYOUT_VERSION = 1
# HF model_type -> TensorRT-LLM architecture name (its MODEL_MAP key for LLaMAForCausalLM).
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# RoPE variants TensorRT-LLM's Llama reads from `rotary_scaling` (None = plain RoPE).
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# HF per-layer suffix -> TensorRT-LLM per-layer suffix, for every tensor that is not part of the fused qkv.
LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attn.o_proj.weight": "attention.dense.weight",
    "self_attn.o_proj.bias": "attention.dense.bias",
    "post_attention_layernorm.weight": "post_layernorm.weight",
    "mlp.gate_proj.weight": "mlp.fc.weight",
    "mlp.up_proj.weight": "mlp.gate.weight",
    "mlp.down_proj.weight": "mlp.proj.weight",
}
QKV_PARTS = ("q_proj", "k_proj", "v_proj")


class CheckpointConversionError(ValueError):
    """A checkpoint or mapping the TensorRT-LLM converter cannot handle; the message says how to fix it."""


@dataclass(frozen=True)
class TrtLlmLayout:
    """A Llama model split over tp_size x pp_size ranks: what each rank holds and under which names."""

    spec: LlamaFamilySpec
    tp_size: int
    pp_size: int
    dtype: torch.dtype

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def layers_per_stage(self) -> int:
        return self.spec.num_layers // self.pp_size

    @property
    def vocab_padded(self) -> int:
        """Rows of the full (padded) lm_head: a multiple of tp_size."""
        return vocab_rows(self.spec.vocab_size, self.tp_size) * self.tp_size

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each rank holds: g / k, or 1 when g < k (each head copied onto k / g ranks)."""
        return max(self.spec.num_kv_heads // self.tp_size, 1)

    def rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    def stage_of(self, layer: int) -> tuple[int, int]:
        """(pipeline stage, index inside the stage) of a global layer index."""
        return divmod(layer, self.layers_per_stage)

    def stage_ranks(self, pp_rank: int) -> list[int]:
        return [self.rank(pp_rank, t) for t in range(self.tp_size)]

    def kv_shard(self, tensor: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """Rank tp_rank's rows of a k_proj / v_proj weight or bias (a view)."""
        g, d = self.spec.num_kv_heads, self.spec.head_dim
        if g % self.tp_size == 0:
            return shard_of(tensor, sharding_rule("self_attn.k_proj.weight"), tp_rank, self.tp_size)
        head = tp_rank * g // self.tp_size  # g < k: k / g consecutive ranks share one KV head
        return tensor.narrow(0, head * d, d)

    def lm_head_shard(self, tensor: torch.Tensor, tp_rank: int) -> torch.Tensor:
        """Rank tp_rank's [P, H] rows of the LM head, zero-padded past the vocabulary
        (a copy only when padded)."""
        piece = shard_of(tensor, sharding_rule("lm_head.weight"), tp_rank, self.tp_size)
        rows = vocab_rows(self.spec.vocab_size, self.tp_size)
        if piece.shape[0] < rows:
            pad = piece.new_zeros((rows - piece.shape[0], *piece.shape[1:]))
            piece = torch.cat([piece, pad])
        return piece

    def expected_names(self, rank: int) -> list[str]:
        """Every tensor name rank `rank`'s file holds, in a fixed order."""
        pp_rank = rank // self.tp_size
        names = ["transformer.vocab_embedding.weight"] if pp_rank == 0 else []
        for j in range(self.layers_per_stage):
            prefix = f"transformer.layers.{j}."
            names += [prefix + "input_layernorm.weight", prefix + "attention.qkv.weight"]
            if self.spec.qkv_bias:
                names.append(prefix + "attention.qkv.bias")
            names.append(prefix + "attention.dense.weight")
            if self.spec.o_bias:
                names.append(prefix + "attention.dense.bias")
            names += [
                prefix + s
                for s in ("post_layernorm.weight", "mlp.fc.weight", "mlp.gate.weight", "mlp.proj.weight")
            ]
        if pp_rank == self.pp_size - 1:
            names += ["transformer.ln_f.weight", "lm_head.weight"]
        return names


def _unsupported(model_type: str, reason: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"TensorRT-LLM checkpoint conversion cannot convert this checkpoint (model_type={model_type!r}): "
        f"{reason}. Use `engine.backend: native` (Llama, Qwen2, Mistral) or `engine.backend: hf` (any causal "
        "LM)."
    )


def layout_for(
    hf_config: Any, tp_size: int, pp_size: int = 1, dtype: str | torch.dtype = "float32"
) -> TrtLlmLayout:
    """Check that an HF config converts to a tp_size x pp_size TensorRT-LLM checkpoint and describe the split.

    Every problem is collected and reported together, each naming the value and how to fix it.
    """
    model_type = getattr(hf_config, "model_type", "?")
    if model_type not in ARCHITECTURES:
        raise _unsupported(
            model_type,
            f"only {', '.join(ARCHITECTURES)} is converted here (Qwen2 and Mistral "
            "have their own TensorRT-LLM converters, not wired into alignflow)",
        )
    try:
        spec = spec_from_hf_config(hf_config, hf_config.max_position_embeddings)
    except UnsupportedArchitectureError as exc:  # reword the native engine's message for this backend
        raise _unsupported(model_type, str(exc).split(": ", 1)[-1].split(". Use", 1)[0]) from None
    rope_type = rope_parameters(hf_config)["rope_type"]
    if rope_type not in ROPE_TYPES:
        raise _unsupported(
            model_type, f"rope_type {rope_type!r} (TensorRT-LLM's Llama reads {', '.join(ROPE_TYPES)})"
        )
    if isinstance(dtype, str) and dtype not in DTYPE_NAMES:
        raise CheckpointConversionError(f"dtype {dtype!r} is not supported; valid: {', '.join(DTYPE_NAMES)}")
    problems = []
    if tp_size < 1 or pp_size < 1:
        problems.append(f"tp_size={tp_size} and pp_size={pp_size} must both be >= 1")
    else:
        try:
            check_tensor_parallel(spec, tp_size, replicate_kv_heads=True)
        except TensorParallelError as exc:
            problems.append(
                str(exc)
                .replace("engine.tensor_parallel_size", "tp_size")
                .replace("tensor_parallel_size values", "tp_size values")
            )
        if spec.num_layers % pp_size:
            divisors = [p for p in range(1, spec.num_layers + 1) if spec.num_layers % p == 0]
            problems.append(
                f"pp_size={pp_size} does not divide num_hidden_layers={spec.num_layers}: every pipeline "
                "stage must hold the same number of layers (older TensorRT-LLM releases split only evenly); "
                f"valid pp_size values for this model are {', '.join(map(str, divisors))}"
            )
    if problems:
        raise CheckpointConversionError("; ".join(problems))
    return TrtLlmLayout(spec=spec, tp_size=tp_size, pp_size=pp_size, dtype=resolve_dtype(dtype))


def trtllm_config(hf_config: Any, layout: TrtLlmLayout) -> dict[str, Any]:
    """The config.json of the TensorRT-LLM checkpoint (the fields LLaMAConfig / PretrainedConfig read)."""
    spec = layout.spec
    rope = rope_parameters(hf_config)
    scaling = None
    if rope["rope_type"] != "default":
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        scaling["type"] = rope["rope_type"]  # TensorRT-LLM reads "type" (transformers 4's key) or "rope_type"
    return {
        "architecture": ARCHITECTURES[spec.model_type],
        "dtype": str(layout.dtype).removeprefix("torch."),
        "logits_dtype": "float32",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_size": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "norm_epsilon": spec.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": float(rope.get("rope_theta", 10000.0)),
        "rotary_scaling": scaling,
        "max_position_embeddings": hf_config.max_position_embeddings,
        "attn_bias": spec.qkv_bias,
        "mlp_bias": False,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "mapping": {"world_size": layout.world_size, "tp_size": layout.tp_size, "pp_size": layout.pp_size},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        "alignflow": {"layout_version": LAYOUT_VERSION, "source": "hf", "model_type": spec.model_type},
    }


@dataclass
class StreamConverter:
    """Turns a stream of (HF name, full tensor) into (rank, TensorRT-LLM name, tensor) pieces as they arrive.

    Pieces are views of the incoming tensor where no cast, fusion or padding is needed: copy them
    (into an engine, a file) before the caller frees or changes the tensor. What is held between
    calls: the q/k/v tensors (and biases) of each layer whose three have not all arrived (in the
    trainer's named_parameters order, q and k of one layer), nothing else. `ranks`: emit (and cut)
    only these ranks' pieces, e.g. the one rank an engine process holds. `finish()` raises naming
    any HF parameter that never came (unless partial) or q/k/v left waiting.
    """

    layout: TrtLlmLayout
    ranks: frozenset[int] | None = None
    seen: set[str] = field(default_factory=set)
    pending: dict[tuple[int, str], dict[str, torch.Tensor]] = field(default_factory=dict)
    known: frozenset[str] = field(init=False)

    def __post_init__(self) -> None:
        self.known = frozenset(self.hf_names())

    def hf_names(self) -> list[str]:
        """Every HF parameter the converter expects (lm_head.weight only when untied)."""
        spec = self.layout.spec
        per_layer = [f"self_attn.{p}.weight" for p in QKV_PARTS] + list(LAYER_NAMES)
        if spec.qkv_bias:
            per_layer += [f"self_attn.{p}.bias" for p in QKV_PARTS]
        if not spec.o_bias:
            per_layer.remove("self_attn.o_proj.bias")
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not spec.tie_word_embeddings:
            names.append("lm_head.weight")
        return names + [f"model.layers.{i}.{s}" for i in range(spec.num_layers) for s in per_layer]

    def feed(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[int, str, torch.Tensor]]:
        """The pieces HF tensor `name` completes (none while a layer's q/k/v are still incomplete)."""
        lay, spec = self.layout, self.layout.spec
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            return  # a tied model's LM head is its embedding, converted when that arrives
        self._check(name, tensor)
        self.seen.add(name)
        tensor = tensor.detach().to(lay.dtype)
        if name == "model.embed_tokens.weight":
            # whole on every rank of the first stage (no parallel embedding)
            for r in self._mine(lay.stage_ranks(0)):
                yield r, "transformer.vocab_embedding.weight", tensor
            if spec.tie_word_embeddings:
                yield from self._lm_head(tensor)
            return
        if name == "lm_head.weight":
            yield from self._lm_head(tensor)
            return
        if name == "model.norm.weight":
            for r in self._mine(lay.stage_ranks(lay.pp_size - 1)):
                yield r, "transformer.ln_f.weight", tensor
            return
        layer, suffix = _layer_of(name)
        stage, local = lay.stage_of(layer)
        prefix = f"transformer.layers.{local}."
        part = suffix.split(".")[1] if suffix.startswith("self_attn.") else ""
        if part in QKV_PARTS:
            kind = suffix.rsplit(".", 1)[1]  # weight | bias
            waiting = self.pending.setdefault((layer, kind), {})
            waiting[part] = tensor
            if len(waiting) < 3:
                return
            del self.pending[(layer, kind)]
            for r in self._mine(lay.stage_ranks(stage)):
                t = r % lay.tp_size
                q = shard_of(waiting["q_proj"], sharding_rule(suffix), t, lay.tp_size)
                fused = torch.cat([q, lay.kv_shard(waiting["k_proj"], t), lay.kv_shard(waiting["v_proj"], t)])
                yield r, f"{prefix}attention.qkv.{kind}", fused
            return
        rule = sharding_rule(suffix)
        for r in self._mine(lay.stage_ranks(stage)):
            yield r, prefix + LAYER_NAMES[suffix], shard_of(tensor, rule, r % lay.tp_size, lay.tp_size)

    def convert(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, partial: bool = False
    ) -> Iterator[tuple[int, str, torch.Tensor]]:
        """feed() every pair, then finish(partial)."""
        for name, tensor in named_tensors:
            yield from self.feed(name, tensor)
        self.finish(partial=partial)

    def finish(self, *, partial: bool = False) -> None:
        if self.pending:
            waiting = [
                f"model.layers.{layer}.self_attn.{{{','.join(sorted(set(QKV_PARTS) - set(got)))}}}.{kind}"
                for (layer, kind), got in sorted(self.pending.items())
            ]
            raise CheckpointConversionError(
                f"the stream ended with q/k/v incomplete: missing {', '.join(waiting)}; TensorRT-LLM fuses "
                "q, k and v into one attention.qkv tensor, so a refit must send all three of a layer together"
            )
        if not partial:
            missing = [n for n in self.hf_names() if n not in self.seen]
            if missing:
                raise CheckpointConversionError(
                    f"{len(missing)} HF parameters never arrived: {', '.join(missing[:6])}"
                    f"{' ...' if len(missing) > 6 else ''}; send every parameter, or pass partial=True"
                )

    def _mine(self, ranks: list[int]) -> list[int]:
        return ranks if self.ranks is None else [r for r in ranks if r in self.ranks]

    def _lm_head(self, tensor: torch.Tensor) -> Iterator[tuple[int, str, torch.Tensor]]:
        lay = self.layout
        for r in self._mine(lay.stage_ranks(lay.pp_size - 1)):
            yield r, "lm_head.weight", lay.lm_head_shard(tensor, r % lay.tp_size)

    def _check(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.known:
            raise CheckpointConversionError(
                f"unknown HF parameter {name!r} for this {self.layout.spec.model_type} model (expected names "
                "like model.layers.0.self_attn.q_proj.weight); is the stream from the same architecture?"
            )
        want = hf_parameter_shape(name, self.layout.spec)
        if tuple(tensor.shape) != want:
            raise CheckpointConversionError(
                f"{name}: shape {tuple(tensor.shape)}, the model's config says {want}"
            )


def _layer_of(name: str) -> tuple[int, str]:
    """model.layers.{i}.{suffix} -> (i, suffix)."""
    _, _, index, suffix = name.split(".", 3)
    return int(index), suffix


@dataclass
class ConversionReport:
    """What convert_checkpoint wrote."""

    out_dir: Path
    tp_size: int
    pp_size: int
    dtype: str
    bytes_per_rank: list[int]
    seconds: float

    def summary(self) -> str:
        sizes = ", ".join(f"rank{i} {b / 2**20:.2f} MiB" for i, b in enumerate(self.bytes_per_rank))
        return (
            f"tensorrt-llm checkpoint tp={self.tp_size} pp={self.pp_size} {self.dtype}: {sizes} "
            f"({sum(self.bytes_per_rank) / 2**20:.2f} MiB total) in {self.seconds:.2f} s -> {self.out_dir}"
        )


def convert_checkpoint(
    checkpoint_dir: str | Path,
    out_dir: str | Path,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    dtype: str = "float32",
    overwrite: bool = False,
) -> ConversionReport:
    """Write the TensorRT-LLM checkpoint of HF checkpoint `checkpoint_dir` into `out_dir`, atomically.

    The files go into a temporary sibling folder, config.json last, then the folder is renamed to
    `out_dir`: a reader never sees a half-written checkpoint. Memory: the rank files of the whole
    model (about the model's size, plus the replicated norms and embedding) while writing.
    """
    from safetensors.torch import save_file
    from transformers import AutoConfig

    started = time.perf_counter()
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    hf_config = AutoConfig.from_pretrained(checkpoint_dir)
    layout = layout_for(hf_config, tp_size, pp_size, dtype)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(
            f"{out_dir} exists and is not empty; choose another --out or pass overwrite=True (--overwrite)"
        )
    ranks: list[dict[str, torch.Tensor]] = [{} for _ in range(layout.world_size)]
    for rank, name, piece in StreamConverter(layout).convert(checkpoint_tensors(checkpoint_dir)):
        ranks[rank][name] = piece.contiguous().clone()  # own storage: safetensors refuses shared tensors
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 would outlive the rename
        sizes = []
        for i, tensors in enumerate(ranks):
            path = tmp / f"rank{i}.safetensors"
            save_file(tensors, str(path), metadata={"format": "pt"})
            os.chmod(path, 0o666 & ~umask)
            sizes.append(path.stat().st_size)
            ranks[i] = {}
        (tmp / CONFIG_FILE).write_text(json.dumps(trtllm_config(hf_config, layout), indent=2) + "\n")
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            out_dir.rename(old)
            tmp.rename(out_dir)
            shutil.rmtree(old)
        else:
            tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ConversionReport(
        out_dir,
        tp_size,
        pp_size,
        str(layout.dtype).removeprefix("torch."),
        sizes,
        time.perf_counter() - started,
    )


def read_config(checkpoint_dir: str | Path) -> dict[str, Any]:
    file = Path(checkpoint_dir) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{checkpoint_dir}: not a TensorRT-LLM checkpoint (no {CONFIG_FILE}); write one with "
            "python -m alignflow.stages.common.generation.tensorrt_llm.convert"
        )
    return json.loads(file.read_text())


def reassemble(checkpoint_dir: str | Path) -> dict[str, torch.Tensor]:
    """The HF state dict (name -> full tensor) a TensorRT-LLM checkpoint written here holds.

    The inverse of convert_checkpoint: q/k/v cut out of each rank's fused qkv and joined over the
    ranks (a replicated KV head taken once), row/column shards concatenated, the LM head's padding
    dropped, layers renumbered globally. A tied model gives no lm_head.weight (as save_pretrained).
    """
    from safetensors.torch import load_file

    cfg = read_config(checkpoint_dir)
    tp, pp = cfg["mapping"]["tp_size"], cfg["mapping"]["pp_size"]
    files = [load_file(str(Path(checkpoint_dir) / f"rank{i}.safetensors")) for i in range(tp * pp)]
    h, g, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_size"]
    q_rows, kv_rows = h // tp * d, max(g // tp, 1) * d
    per_stage = cfg["num_hidden_layers"] // pp
    kv_ranks = range(0, tp, max(tp // g, 1))  # one rank per distinct KV slice

    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": files[0]["transformer.vocab_embedding.weight"]
    }
    last = files[(pp - 1) * tp : pp * tp]
    out["model.norm.weight"] = last[0]["transformer.ln_f.weight"]
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = torch.cat([f["lm_head.weight"] for f in last])[: cfg["vocab_size"]]
    for stage in range(pp):
        stage_files = files[stage * tp : (stage + 1) * tp]
        for j in range(per_stage):
            src, dst = f"transformer.layers.{j}.", f"model.layers.{stage * per_stage + j}."
            for kind in ("weight", "bias"):
                if src + f"attention.qkv.{kind}" not in stage_files[0]:
                    continue
                parts = [
                    f[src + f"attention.qkv.{kind}"].split([q_rows, kv_rows, kv_rows]) for f in stage_files
                ]
                for r in range(tp):  # a KV head copied onto several ranks must be the same everywhere
                    first = r - r % max(tp // g, 1)
                    if not (
                        torch.equal(parts[r][1], parts[first][1])
                        and torch.equal(parts[r][2], parts[first][2])
                    ):
                        raise CheckpointConversionError(
                            f"{checkpoint_dir}: rank{stage * tp + r} {src}attention.qkv.{kind} holds other "
                            f"K/V values than rank{stage * tp + first}, which shares its KV head; re-convert "
                            "the checkpoint"
                        )
                out[dst + f"self_attn.q_proj.{kind}"] = torch.cat([p[0] for p in parts])
                out[dst + f"self_attn.k_proj.{kind}"] = torch.cat([parts[r][1] for r in kv_ranks])
                out[dst + f"self_attn.v_proj.{kind}"] = torch.cat([parts[r][2] for r in kv_ranks])
            for hf_suffix, trt_suffix in LAYER_NAMES.items():
                if src + trt_suffix not in stage_files[0]:
                    continue
                rule = sharding_rule(hf_suffix)
                pieces = [f[src + trt_suffix] for f in stage_files]
                out[dst + hf_suffix] = (
                    pieces[0] if rule.kind == "replicated" else torch.cat(pieces, dim=rule.dim)
                )
    return out
