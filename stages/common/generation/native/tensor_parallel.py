"""Tensor parallelism of the native engine: which slice of every weight a rank keeps, and its collectives.

A Llama-family model split over k ranks in the Megatron way (Shoeybi et al., 2019), one rule per
Hugging Face parameter (`SHARDING`; h query heads, g KV heads, I intermediate, V vocab):

    q_proj, k_proj, v_proj (+ biases)  column-parallel by heads: rank r keeps query heads
                                       [r h/k, (r+1) h/k) and KV heads [r g/k, (r+1) g/k). The blocks
                                       are contiguous, so with GQA a rank's query heads attend to its
                                       own KV heads only, and the KV cache holds g/k heads per rank.
    o_proj                             row-parallel: the input columns of the rank's query heads; the
                                       partial outputs are summed (all_reduce), then the bias
                                       (Llama attention_bias) is added once.
    gate_proj, up_proj                 column-parallel: rows [r I/k, (r+1) I/k).
    down_proj                          row-parallel: input columns [r I/k, (r+1) I/k); all_reduce.
    embed_tokens                       vocab-parallel: rows [r P, (r+1) P), P = ceil(V / k) (the last
                                       rank's tail is zero padding when k does not divide V); an id
                                       outside the slice contributes zeros, then all_reduce.
    lm_head                            vocab-parallel: each rank computes the logits of its rows, and an
                                       all_gather gives every rank the full [.., V] logits.
    norms                              replicated.

Why all_gather the logits, not gather them to rank 0: every rank runs the same generate loop (SPMD)
and needs each sampled token for its next embedding. With the full logits on every rank, the
sampler (deterministic: its randomness is a function of the sequence seed and the step) picks the
same tokens everywhere with one collective per step; gathering to rank 0 would need a second one to
broadcast the tokens back, and a second code path for rank 0. The price is [B, V] per step on every
rank (64 x 32000 fp32: 8 MB), next to the 2 all_reduces of [B, H] per layer.

The pure part (`SHARDING`, `shard_range`, `vocab_rows`, `shard_of`, `shard_shape`,
`check_tensor_parallel`, `rank_spec`) knows nothing of torch.distributed; `TensorParallel` adds the
process group. This module does not hold weights (weights.py cuts each incoming full tensor with
`shard_of`, or places a slice the sender already cut) or run layers (model.py); the rollout workers'
trainer cuts with the same `shard_of`, so the split has one source of truth.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from alignflow.stages.common.generation.interface import EngineError, UnsupportedArchitectureError
from alignflow.stages.common.generation.native.spec import LlamaFamilySpec

ShardKind = Literal["column", "row", "vocab", "replicated"]


@dataclass(frozen=True)
class ShardRule:
    """How one HF parameter is split: `kind`, and the dim each rank keeps a slice of
    (None: the whole tensor)."""

    kind: ShardKind
    dim: int | None


_COLUMN, _ROW = ShardRule("column", 0), ShardRule("row", 1)
_VOCAB, _REPLICATED = ShardRule("vocab", 0), ShardRule("replicated", None)

# HF parameter (per-layer suffix, or the full name of a top-level one) -> its rule. Shapes are HF's
# [out_features, in_features]: column-parallel keeps rows (dim 0), row-parallel keeps columns (dim 1).
SHARDING: dict[str, ShardRule] = {
    "self_attn.q_proj.weight": _COLUMN,
    "self_attn.k_proj.weight": _COLUMN,
    "self_attn.v_proj.weight": _COLUMN,
    "self_attn.q_proj.bias": _COLUMN,
    "self_attn.k_proj.bias": _COLUMN,
    "self_attn.v_proj.bias": _COLUMN,
    "self_attn.o_proj.weight": _ROW,
    "self_attn.o_proj.bias": _REPLICATED,  # added once, after the all_reduce
    "mlp.gate_proj.weight": _COLUMN,
    "mlp.up_proj.weight": _COLUMN,
    "mlp.down_proj.weight": _ROW,
    "input_layernorm.weight": _REPLICATED,
    "post_attention_layernorm.weight": _REPLICATED,
    "model.embed_tokens.weight": _VOCAB,
    "lm_head.weight": _VOCAB,
    "model.norm.weight": _REPLICATED,
}


class TensorParallelError(UnsupportedArchitectureError):
    """A model that cannot be split over engine.tensor_parallel_size ranks (a ValueError,
    like any config mismatch)."""


def kv_heads_split(num_kv_heads: int, size: int, replicate_kv_heads: bool = False) -> bool:
    """Whether `size` ranks can hold the KV heads: g divisible by k, or (replicating) k divisible by g."""
    return num_kv_heads % size == 0 or (replicate_kv_heads and size % num_kv_heads == 0)


def valid_sizes(spec: LlamaFamilySpec, replicate_kv_heads: bool = False) -> list[int]:
    """Every tensor-parallel size the model splits over: common divisors of heads, KV heads and intermediate.

    replicate_kv_heads: KV heads may also be copied onto k / g ranks each when g < k (TensorRT-LLM does
    this); the native engine does not.
    """
    common = math.gcd(spec.num_heads, spec.intermediate_size)
    return [
        k
        for k in range(1, common + 1)
        if common % k == 0 and kv_heads_split(spec.num_kv_heads, k, replicate_kv_heads)
    ]


def check_tensor_parallel(spec: LlamaFamilySpec, size: int, replicate_kv_heads: bool = False) -> None:
    """Raise TensorParallelError unless `size` ranks can each hold whole query heads, KV heads and MLP rows.

    replicate_kv_heads: also accept g < k KV heads when k is a multiple of g (each KV head copied onto
    k / g ranks, as TensorRT-LLM's checkpoints do); the native engine leaves it False.
    """
    if size < 1:
        raise TensorParallelError(f"engine.tensor_parallel_size={size}: must be >= 1")
    problems = []
    if not kv_heads_split(spec.num_kv_heads, size, replicate_kv_heads):
        copied = (
            "KV heads are copied only when the size is a multiple of them"
            if replicate_kv_heads
            else "KV heads are not replicated across ranks"
        )
        grouped = (
            f" (grouped-query attention: {spec.num_heads} query heads on {spec.num_kv_heads} KV heads; "
            f"{copied})"
            if spec.num_kv_heads != spec.num_heads
            else ""
        )
        problems.append(f"num_key_value_heads={spec.num_kv_heads} is not divisible by it{grouped}")
    if spec.num_heads % size:
        problems.append(f"num_attention_heads={spec.num_heads} is not divisible by it")
    if spec.intermediate_size % size:
        problems.append(f"intermediate_size={spec.intermediate_size} is not divisible by it")
    if problems:
        raise TensorParallelError(
            f"engine.tensor_parallel_size={size} cannot split this {spec.model_type} model: "
            f"{'; '.join(problems)}. Each rank must hold whole heads: valid tensor_parallel_size values for "
            f"this model are {', '.join(map(str, valid_sizes(spec, replicate_kv_heads)))}"
        )


def shard_range(extent: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of rank `rank`'s equal share of `extent` (which `size` divides)."""
    if extent % size:
        raise ValueError(f"shard_range: {extent} does not split into {size} equal parts")
    per = extent // size
    return rank * per, (rank + 1) * per


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding / LM head every rank holds: ceil(V / k) (the last rank's tail is padding)."""
    return -(-vocab_size // size)


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """[start, stop) of the token ids rank `rank` owns (stop - start < vocab_rows on a padded last rank)."""
    rows = vocab_rows(vocab_size, size)
    return min(rank * rows, vocab_size), min((rank + 1) * rows, vocab_size)


def sharding_rule(param: str) -> ShardRule:
    """The rule of an HF parameter, given as its per-layer suffix or its full name."""
    if param in SHARDING:
        return SHARDING[param]
    suffix = param.split(".", 3)[-1] if param.startswith("model.layers.") else param
    if suffix not in SHARDING:
        raise KeyError(f"no tensor-parallel rule for {param!r}; known: {', '.join(SHARDING)}")
    return SHARDING[suffix]


def shard_of(tensor: torch.Tensor, rule: ShardRule, rank: int, size: int) -> torch.Tensor:
    """Rank `rank` of `size`'s slice of a full HF tensor: a view (narrow), so nothing is copied here.

    Copying the view into the rank's buffer copies the slice only; the full tensor can be freed as
    soon as the caller drops it.
    """
    if rule.kind == "replicated" or size == 1:
        return tensor
    assert rule.dim is not None
    extent = tensor.shape[rule.dim]
    start, stop = vocab_range(extent, rank, size) if rule.kind == "vocab" else shard_range(extent, rank, size)
    return tensor.narrow(rule.dim, start, stop - start)


def shard_shape(shape: tuple[int, ...], rule: ShardRule, rank: int, size: int) -> tuple[int, ...]:
    """The shape of `shard_of` of a tensor of `shape` (the same ranges, without a tensor)."""
    if rule.kind == "replicated" or size == 1:
        return tuple(shape)
    assert rule.dim is not None
    extent = shape[rule.dim]
    start, stop = vocab_range(extent, rank, size) if rule.kind == "vocab" else shard_range(extent, rank, size)
    return (*shape[: rule.dim], stop - start, *shape[rule.dim + 1 :])


def rank_spec(spec: LlamaFamilySpec, size: int) -> LlamaFamilySpec:
    """The model one rank holds: heads, KV heads and intermediate / k, vocab_size = its (padded) vocab rows.

    Every shape the forward pass, the weight buffers and the KV cache derive from a spec then
    describes the rank's shard; nothing in model.py needs to know about the split beyond the
    collectives.
    """
    check_tensor_parallel(spec, size)
    if size == 1:
        return spec
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // size,
        num_kv_heads=spec.num_kv_heads // size,
        intermediate_size=spec.intermediate_size // size,
        vocab_size=vocab_rows(spec.vocab_size, size),
    )


def hf_parameter_shape(param: str, spec: LlamaFamilySpec) -> tuple[int, ...]:
    """The full (unsplit) shape of an HF parameter of a model of `spec` (suffix or full name)."""
    H, Q, K, inner, V = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size, spec.vocab_size
    shapes = {
        "self_attn.q_proj.weight": (Q, H),
        "self_attn.k_proj.weight": (K, H),
        "self_attn.v_proj.weight": (K, H),
        "self_attn.q_proj.bias": (Q,),
        "self_attn.k_proj.bias": (K,),
        "self_attn.v_proj.bias": (K,),
        "self_attn.o_proj.weight": (H, Q),
        "self_attn.o_proj.bias": (H,),
        "mlp.gate_proj.weight": (inner, H),
        "mlp.up_proj.weight": (inner, H),
        "mlp.down_proj.weight": (H, inner),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
        "model.embed_tokens.weight": (V, H),
        "lm_head.weight": (V, H),
        "model.norm.weight": (H,),
    }
    suffix = param.split(".", 3)[-1] if param.startswith("model.layers.") else param
    return shapes[suffix]


class TensorParallel:
    """Rank `rank` of a tensor-parallel engine over `group`: its shard of the model and its collectives.

    Every rank of the group must make the same calls in the same order (build, generate, refit with
    the same arguments), as torchrun ranks running one program do.
    """

    def __init__(self, spec: LlamaFamilySpec, size: int, group: Any = None):
        import torch.distributed as dist

        check_tensor_parallel(spec, size)
        if not (dist.is_available() and dist.is_initialized()):
            raise EngineError(
                f"engine.tensor_parallel_size={size} needs torch.distributed initialised with {size} ranks "
                f"(one process per rank: torchrun --nproc-per-node {size}, or dist.init_process_group(...) "
                "before building the engine); set engine.tensor_parallel_size: 1 for a one-process engine"
            )
        self.group = group if group is not None else dist.group.WORLD
        ranks = dist.get_world_size(self.group)
        if ranks != size:
            raise EngineError(
                f"engine.tensor_parallel_size={size} but the process group has {ranks} ranks; pass a group "
                f"of exactly {size} ranks (process_group=dist.new_group(...)) or set "
                f"engine.tensor_parallel_size: {ranks}"
            )
        self.spec = spec
        self.size = size
        self.rank = dist.get_rank(self.group)
        self.backend = str(dist.get_backend(self.group))
        self.local_spec = rank_spec(spec, size)
        self.vocab_start, self.vocab_stop = vocab_range(spec.vocab_size, self.rank, size)

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}, backend={self.backend})"

    def cut(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice (a view) of the full HF tensor `param`."""
        return shard_of(tensor, sharding_rule(param), self.rank, self.size)

    def slice_shape(self, param: str) -> tuple[int, ...]:
        """The shape of this rank's slice of HF parameter `param` (suffix or full name)."""
        return shard_shape(hf_parameter_shape(param, self.spec), sharding_rule(param), self.rank, self.size)

    # -- collectives of the forward pass ---------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of the ranks' partial outputs (row-parallel linears), in place; x must be contiguous."""
        import torch.distributed as dist

        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def embed(self, ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel embedding: rows of the ids this rank owns, zeros for the others, summed over ranks.

        Exactly one rank contributes each row and the others add +0, so the result equals the
        unsplit embedding bit for bit.
        """
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_stop - self.vocab_start)
        x = F.embedding(local.masked_fill(outside, 0), table)
        return self.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor:
        """[..., P] logits of this rank's vocab rows -> [..., V] full logits on every rank (all_gather)."""
        import torch.distributed as dist

        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        full = torch.cat(parts, dim=-1)
        if full.shape[-1] != self.spec.vocab_size:  # padded rows of the last rank
            full = full[..., : self.spec.vocab_size].contiguous()
        return full
