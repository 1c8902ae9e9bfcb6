"""The hf engine: transformers `generate` on any causal LM, the reference and the fallback backend.

Sampling goes through the same on-device sampler as the native engine (alignflow.kernels.sample_tokens,
counter-based randomness per (seed, step)): a logits processor draws the token and hands generate a
one-hot score row, so generate runs in greedy mode and emits exactly the drawn token. The two
backends therefore sample identically from identical logits, and per-request seeds are honoured.
The model's own generation_config is replaced by a blank one so hub defaults (repetition penalty,
suppressed tokens...) never change the distribution the log-probs describe.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

import torch

from alignflow.config import EngineConfig
from alignflow.kernels.sampling import uniform_flags
from alignflow.stages.common.generation.interface import (
    ENGINE_CONFIG_FILE,
    ENGINE_FORMAT,
    ENGINE_LAYOUT_VERSION,
    Engine,
    EngineError,
    FinishReason,
    Generation,
    RefitError,
    RefitStats,
    SamplingParams,
    UnloadStats,
    WeightsAfterUnload,
    check_fits,
    copy_tokenizer_files,
    eos_ids_of,
    read_engine_config,
    resolve_device,
    resolve_dtype,
    sampler_path,
    validate_prompts,
    warn_if_cpu_emulates,
)
from alignflow.stages.common.models.loading import ENGINE_PICKLE_FIX, refuse_pickle

MODEL_DIR = "model"


class _CounterSampler:
    """A transformers logits processor that samples with alignflow.kernels and records what it drew."""

    def __init__(self, sampling: SamplingParams, seeds: list[int], prompt_width: int, device: torch.device,
                 keep_logits: bool, vocab_size: int):
        n = len(seeds)
        self.temperature = torch.full((n,), sampling.temperature, dtype=torch.float32, device=device)
        self.top_k = torch.full((n,), sampling.top_k, dtype=torch.long, device=device)
        self.top_p = torch.full((n,), sampling.top_p, dtype=torch.float32, device=device)
        self.seeds = torch.tensor(seeds, dtype=torch.long, device=device)
        self.flags = uniform_flags(sampling.temperature, sampling.top_k, sampling.top_p, vocab_size)
        self.prompt_width = prompt_width
        self.keep_logits = keep_logits
        self.tokens: list[torch.Tensor] = []
        self.logprobs: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from alignflow.kernels import sample_tokens

        step = input_ids.shape[1] - self.prompt_width
        sample = sample_tokens(scores.float(), self.temperature, self.top_k, self.top_p, self.seeds, step,
                               validate=False, flags=self.flags)
        self.tokens.append(sample.tokens)
        self.logprobs.append(sample.logprobs)
        if self.keep_logits:
            self.logits.append(scores.float().cpu())
        one_hot = torch.full_like(scores, float("-inf"))
        one_hot.scatter_(1, sample.tokens[:, None], 0.0)
        return one_hot


class HFEngine(Engine):
    """transformers generate; see the module docstring."""

    backend: ClassVar[str] = "hf"

    def __init__(
        self,
        model: Any,
        engine_config: EngineConfig,
        *,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
        tokenizer_source: Path | None,
        source_checkpoint: str | None,
    ):
        from transformers import GenerationConfig

        if engine_config.tensor_parallel_size != 1:
            raise NotImplementedError(
                f"engine.tensor_parallel_size={engine_config.tensor_parallel_size}: the hf engine runs on "
                "one device; set engine.tensor_parallel_size: 1"
            )
        warn_if_cpu_emulates(model.dtype, device)
        self.model = model.eval().to(device)
        self.model.generation_config = GenerationConfig()
        self.engine_config = engine_config
        self.device = device
        self._eos = eos_token_ids
        self.tokenizer_source = tokenizer_source
        self.source_checkpoint = source_checkpoint
        self._loaded = True
        self._weights_valid = True
        self._busy = False
        self._shapes: dict[
            str, torch.Size
        ] = {}  # each parameter's shape while discarded (keep_weights=False)
        # unload() copies the parameters to host memory where that frees something (a GPU); a test sets it on
        # CPU.
        self.offload_weights = device.type != "cpu"
        self._offloaded = False  # the parameters are host copies until reload()
        self._discarded = False

    @classmethod
    def build(
        cls,
        checkpoint_dir: str | Path,
        engine_config: EngineConfig,
        *,
        dtype: str = "float32",
        device: str | None = None,
    ) -> HFEngine:
        from transformers import AutoConfig, AutoModelForCausalLM

        checkpoint_dir = Path(checkpoint_dir)
        if not (checkpoint_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{checkpoint_dir}: no config.json; expected a Hugging Face causal-LM directory"
            )
        refuse_pickle(checkpoint_dir, fix=ENGINE_PICKLE_FIX)
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint_dir, dtype=resolve_dtype(dtype), attn_implementation="sdpa", use_safetensors=True
        )
        eos = eos_ids_of(checkpoint_dir, AutoConfig.from_pretrained(checkpoint_dir))
        return cls(
            model,
            engine_config,
            device=resolve_device(device),
            eos_token_ids=eos,
            tokenizer_source=checkpoint_dir,
            source_checkpoint=str(checkpoint_dir),
        )

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def execution_paths(self) -> dict[str, Any]:
        """transformers generate with the model's attention implementation, sampling through sample_tokens."""
        from alignflow.kernels._triton_dispatch import resolve_impl

        return {
            "backend": self.backend,
            "device": str(self.device),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "decode_step": "transformers generate",
            "attention": self.model.config._attn_implementation,
            "sampler": sampler_path(resolve_impl("auto", self.device, "sample_tokens")),
        }

    @property
    def loaded(self) -> bool:
        return self._loaded

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.tokenizer_source

    # -- generation -------------------------------------------------------------------------------
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        return_logits: bool = False,
    ) -> Generation:
        if not self._loaded:
            raise EngineError("the engine is unloaded; call reload() before generate()")
        if not self._weights_valid:
            raise EngineError("the engine holds no valid weights; call refit(...) with every parameter first")
        if self._busy:
            raise EngineError("generate() is already running on this engine (engines are not re-entrant)")
        prompts = validate_prompts(prompt_token_ids, self.vocab_size)
        check_fits(prompts, sampling, self.engine_config.max_seq_len, self.vocab_size)
        seeds = sampling.sequence_seeds(len(prompts))
        rows = self.engine_config.max_batch_size
        responses, logprobs, reasons, logits = [], [], [], []
        started, generated = time.perf_counter(), 0
        self._busy = True
        try:
            for start in range(0, len(prompts), rows):
                part = self._generate_batch(
                    prompts[start : start + rows], seeds[start : start + rows], sampling, return_logits
                )
                responses += part.response_token_ids
                logprobs += part.logprobs
                reasons += part.finish_reasons
                logits += part.logits or []
                generated += sum(part.lengths)
        finally:
            self._busy = False
        elapsed = time.perf_counter() - started
        return Generation(
            responses,
            logprobs,
            reasons,
            logits if return_logits else None,
            metrics={
                "timing/generate_s": elapsed,
                "perf/generated_tokens": generated,
                "perf/gen_tokens_per_s": generated / max(elapsed, 1e-9),
            },
        )

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingParams, return_logits: bool
    ) -> Generation:
        from transformers import GenerationConfig, LogitsProcessorList

        B, S = len(prompts), max(len(p) for p in prompts)
        ends = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self._eos))
        pad_id = min(ends) if ends else 0
        ids = torch.tensor(
            [[pad_id] * (S - len(p)) + p for p in prompts], dtype=torch.long, device=self.device
        )
        mask = torch.tensor(
            [[0] * (S - len(p)) + [1] * len(p) for p in prompts], dtype=torch.long, device=self.device
        )
        sampler = _CounterSampler(sampling, seeds, S, self.device, return_logits, self.vocab_size)
        config = GenerationConfig(
            max_new_tokens=sampling.max_new_tokens,
            min_new_tokens=0,
            do_sample=False,
            num_beams=1,
            eos_token_id=sorted(ends) or None,
            pad_token_id=pad_id,
        )
        self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=config,
            logits_processor=LogitsProcessorList([sampler]),
        )
        tokens = torch.stack(sampler.tokens, dim=1).tolist()  # [B, steps]
        lps = torch.stack(sampler.logprobs, dim=1).tolist()
        eos = set() if sampling.ignore_eos else set(self._eos)
        responses, logprobs, reasons, logits = [], [], [], []
        for b in range(B):
            row = tokens[b]
            n = next((i + 1 for i, tok in enumerate(row) if tok in ends), len(row))
            responses.append(row[:n])
            logprobs.append(lps[b][:n])
            last = row[n - 1]
            reason: FinishReason = "eos" if last in eos else "stop" if last in ends else "length"
            reasons.append(reason)
            if return_logits:
                logits.append(torch.stack([step[b] for step in sampler.logits[:n]]))
        return Generation(responses, logprobs, reasons, logits if return_logits else None)

    # -- refit ------------------------------------------------------------------------------------
    def refit(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, partial: bool = False
    ) -> RefitStats:
        if self._busy:
            raise EngineError("refit() called while generate() is running")
        if self._shapes and next(iter(self.model.parameters())).numel() == 0:
            raise EngineError(
                "weights were discarded by unload(keep_weights=False); call reload() before refit()"
            )
        if partial and self._discarded:
            raise RefitError("partial refit into discarded weights: send every parameter (partial=False)")
        started = time.perf_counter()
        params = dict(self.model.named_parameters(remove_duplicate=False))
        expected = {id(p) for p in self.model.parameters()}
        covered: set[int] = set()
        count = nbytes = 0
        try:
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if name.endswith("rotary_emb.inv_freq"):
                        continue
                    target = params.get(name)
                    if target is None:
                        raise RefitError(
                            f"unknown parameter name {name!r} for {type(self.model).__name__}; "
                            f"expected names like {next(iter(params))!r}"
                        )
                    if tuple(tensor.shape) != tuple(target.shape):
                        raise RefitError(
                            f"{name!r}: shape {tuple(tensor.shape)} but the model has {tuple(target.shape)}"
                        )
                    target.copy_(tensor.detach())
                    covered.add(id(target))
                    count += 1
                    nbytes += tensor.numel() * tensor.element_size()
            missing = expected - covered
            if missing and not partial:
                names = sorted(n for n, p in self.model.named_parameters() if id(p) in missing)
                raise RefitError(
                    f"refit did not cover {len(missing)} of {len(expected)} parameters (first: "
                    f"{names[:5]}); send every parameter, or pass partial=True"
                )
        except BaseException:
            self._weights_valid = False
            raise
        self._weights_valid = True
        self._discarded = False
        return RefitStats(tensors=count, bytes=nbytes, seconds=time.perf_counter() - started)

    # -- memory -----------------------------------------------------------------------------------
    def unload(self, *, keep_weights: bool = True) -> UnloadStats:
        """Parameters to host memory where `offload_weights` (GPU; pinned there), or freed with
        keep_weights=False (a full refit must follow reload). transformers allocates its KV cache inside each
        generate, so there is none to free between rollouts."""
        if self._busy:
            raise EngineError("unload() called while generate() is running")
        params = dict(self.model.named_parameters())  # tied weights once
        on_device = not (self._shapes or self._offloaded)
        weight_bytes = 0
        where: WeightsAfterUnload = "kept"
        if not keep_weights:
            weight_bytes = sum(p.numel() * p.element_size() for p in params.values()) if on_device else 0
            for name, param in params.items():
                self._shapes[name] = param.shape
                param.data = torch.empty(0, dtype=param.dtype, device=self.device)
            self._weights_valid, self._offloaded, self._discarded, where = False, False, True, "discarded"
        elif on_device and self.offload_weights:
            pinned = self.device.type == "cuda"
            host = {}
            for name, param in params.items():
                host[name] = torch.empty(param.shape, dtype=param.dtype, device="cpu", pin_memory=pinned)
                host[name].copy_(param.data, non_blocking=pinned)
                weight_bytes += param.numel() * param.element_size()
            if pinned:
                torch.cuda.synchronize(self.device)
            for name, param in params.items():
                param.data = host[name]
            self._offloaded, where = True, "offloaded"
        elif not on_device:
            where = "discarded" if self._shapes else "offloaded"
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self._loaded = False
        return UnloadStats(kv_cache_bytes=0, weight_bytes=weight_bytes, weights=where)

    def reload(self) -> None:
        pinned = self.device.type == "cuda"
        for name, param in self.model.named_parameters():
            if self._shapes:
                param.data = torch.empty(self._shapes[name], dtype=param.dtype, device=self.device)
            elif self._offloaded:
                param.data = param.data.to(self.device, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize(self.device)
        self._shapes, self._offloaded = {}, False
        self._loaded = True

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write engine_config.json, the model (save_pretrained) under model/, and tokenizer/."""
        if not self._weights_valid:
            raise EngineError("cannot save an engine without valid weights; refit it first")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path / MODEL_DIR)
        tokenizer_files = copy_tokenizer_files(self.tokenizer_source, path) if self.tokenizer_source else []
        meta = {
            "format": ENGINE_FORMAT,
            "layout_version": ENGINE_LAYOUT_VERSION,
            "backend": self.backend,
            "engine_config": self.engine_config.model_dump(mode="json"),
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "model_type": self.model.config.model_type,
            "eos_token_ids": list(self._eos),
            "weights": MODEL_DIR,
            "tokenizer": "tokenizer" if tokenizer_files else None,
            "source_checkpoint": self.source_checkpoint,
        }
        (path / ENGINE_CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        return path

    @classmethod
    def load(cls, path: str | Path, *, device: str | None = None) -> HFEngine:
        from transformers import AutoModelForCausalLM

        path = Path(path)
        meta = read_engine_config(path)
        if meta["backend"] != cls.backend:
            raise ValueError(
                f"{path} holds a {meta['backend']!r} engine, not {cls.backend!r}; use load_engine()"
            )
        refuse_pickle(path / MODEL_DIR, fix=ENGINE_PICKLE_FIX)
        model = AutoModelForCausalLM.from_pretrained(
            path / MODEL_DIR,
            dtype=resolve_dtype(meta["dtype"]),
            attn_implementation="sdpa",
            use_safetensors=True,
        )
        tokenizer_dir = path / meta["tokenizer"] if meta.get("tokenizer") else None
        return cls(
            model,
            EngineConfig.model_validate(meta["engine_config"]),
            device=resolve_device(device),
            eos_token_ids=tuple(meta["eos_token_ids"]),
            tokenizer_source=tokenizer_dir,
            source_checkpoint=meta.get("source_checkpoint"),
        )
