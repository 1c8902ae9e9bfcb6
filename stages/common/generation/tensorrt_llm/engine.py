"""The tensorrt-llm engine: a compiled TensorRT-LLM engine behind the Engine interface, refit with Refitter.

Build: the HF checkpoint is converted and sharded for engine.tensor_parallel_size ranks
(checkpoint.py, the same code the CPU tests check), each rank's engine is compiled with
`tensorrt_llm.builder.build(model, BuildConfig(use_refit=True))`, and this process runs its own
rank with `tensorrt_llm.runtime.ModelRunner` (one process per rank under MPI when tp > 1).
Refit: the trainer's (HF name, tensor) stream goes through checkpoint.StreamConverter; this rank's
pieces are set with `trt.Refitter.set_named_weights` under their TensorRT-LLM names (the names
the builder gives refittable weights) and committed with `refit_cuda_engine`.

Status: this module needs an NVIDIA GPU and the tensorrt_llm package (the
alignflow-engine-tensorrt-llm image). It has NOT run on this project's CPU machines; its tests
skip there. The runtime calls (ModelRunner.generate arguments, the runner's engine handle) follow
TensorRT-LLM 1.2's Python runtime and may need adjusting on first GPU run. Importing this module
never imports tensorrt_llm.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterable, Sequence
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
    check_fits,
    copy_tokenizer_files,
    eos_ids_of,
    read_engine_config,
    validate_prompts,
)
from alignflow.stages.common.generation.tensorrt_llm.checkpoint import (
    CheckpointConversionError,
    StreamConverter,
    TrtLlmLayout,
    convert_checkpoint,
    layout_for,
)

DOCKERFILE = "containers/engine-tensorrt-llm.Dockerfile"
ENGINE_DIR = "engines"


def require_tensorrt_llm(device: str | None) -> Any:
    """The tensorrt_llm module,
    or a BackendUnavailableError saying what is missing and where it is installed."""
    where = (
        f"run the stage in the alignflow-engine-tensorrt-llm image ({DOCKERFILE}) on an NVIDIA GPU node, "
        "or set engine.backend: native (or hf) to generate without it"
    )
    try:
        import tensorrt_llm
    except ImportError as exc:
        raise BackendUnavailableError(
            f"engine.backend: tensorrt-llm needs the tensorrt_llm package (TensorRT-LLM 1.2.x from "
            f"NVIDIA's index), which is not installed here ({exc}); {where}"
        ) from None
    if (device is not None and torch.device(device).type != "cuda") or not torch.cuda.is_available():
        raise BackendUnavailableError(
            f"engine.backend: tensorrt-llm runs on NVIDIA GPUs only and no CUDA device is available "
            f"(device={device!r}); {where}"
        )
    return tensorrt_llm


class TensorRTLLMEngine(Engine):
    """Rank `rank` of a TensorRT-LLM engine compiled with use_refit=True (see the module docstring)."""

    backend: ClassVar[str] = "tensorrt-llm"

    def __init__(self, engine_dir: Path, layout: TrtLlmLayout, meta: dict[str, Any], runner: Any, rank: int):
        self.engine_dir = engine_dir  # holds engines/ (TensorRT-LLM's engine folder) and tokenizer/
        self.layout = layout
        self.meta = meta
        self._runner = runner
        self.rank = rank
        self._weights_discarded = False

    # -- build / load ----------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        checkpoint_dir: str | Path,
        engine_config: EngineConfig,
        *,
        dtype: str = "float32",
        device: str | None = None,
    ) -> TensorRTLLMEngine:
        from transformers import AutoConfig

        checkpoint_dir = Path(checkpoint_dir)
        hf_config = AutoConfig.from_pretrained(checkpoint_dir)
        tp = engine_config.tensor_parallel_size
        layout = layout_for(hf_config, tp, 1, dtype)  # architecture / mapping errors first: they need no GPU
        trtllm = require_tensorrt_llm(device)
        from tensorrt_llm import BuildConfig
        from tensorrt_llm.builder import build as trt_build
        from tensorrt_llm.models import LLaMAForCausalLM

        work = Path(tempfile.mkdtemp(prefix="alignflow-trtllm-"))
        started = time.perf_counter()
        report = convert_checkpoint(checkpoint_dir, work / "checkpoint", tp_size=tp, dtype=dtype)
        build_config = BuildConfig(
            max_batch_size=engine_config.max_batch_size,
            max_input_len=engine_config.max_seq_len,
            max_seq_len=engine_config.max_seq_len,
            gather_generation_logits=True,  # log-probs computed here, as the other backends
            use_refit=True,
        )
        engine_dir = work / ENGINE_DIR
        for rank in range(tp):  # every rank's engine from one process: the build needs no collective
            model = LLaMAForCausalLM.from_checkpoint(str(report.out_dir), rank=rank)
            trt_build(model, build_config).save(str(engine_dir))
        shutil.rmtree(report.out_dir)
        meta = {
            "format": ENGINE_FORMAT,
            "layout_version": ENGINE_LAYOUT_VERSION,
            "backend": cls.backend,
            "tensorrt_llm_version": trtllm.__version__,
            "dtype": dtype,
            "tensor_parallel_size": tp,
            "max_batch_size": engine_config.max_batch_size,
            "max_seq_len": engine_config.max_seq_len,
            "hf_config": hf_config.to_dict(),
            "eos_token_ids": list(eos_ids_of(checkpoint_dir, hf_config)),
            "build_seconds": time.perf_counter() - started,
            "tokenizer_files": copy_tokenizer_files(checkpoint_dir, work),
        }
        return cls._start(work, layout, meta)

    @classmethod
    def _start(cls, root: Path, layout: TrtLlmLayout, meta: dict[str, Any]) -> TensorRTLLMEngine:
        import tensorrt_llm
        from tensorrt_llm.runtime import ModelRunner

        rank = tensorrt_llm.mpi_rank()
        if tensorrt_llm.mpi_world_size() != layout.tp_size:
            raise EngineError(
                f"engine.tensor_parallel_size={layout.tp_size} but this process runs in an MPI world of "
                f"{tensorrt_llm.mpi_world_size()}; start one process per rank (mpirun -n {layout.tp_size} "
                "...) or set engine.tensor_parallel_size: 1"
            )
        runner = ModelRunner.from_dir(str(root / ENGINE_DIR), rank=rank)
        return cls(root, layout, meta, runner, rank)

    @classmethod
    def load(cls, path: str | Path, *, device: str | None = None) -> TensorRTLLMEngine:
        from transformers import AutoConfig

        meta = read_engine_config(path)
        require_tensorrt_llm(device)
        config_class = AutoConfig.for_model(meta["hf_config"]["model_type"]).__class__
        hf_config = config_class.from_dict(meta["hf_config"])
        layout = layout_for(hf_config, meta["tensor_parallel_size"], 1, meta["dtype"])
        return cls._start(Path(path), layout, meta)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self._serialize_engine(path / ENGINE_DIR)  # this rank's engine with its refit weights
        if path.resolve() != self.engine_dir.resolve():
            # TensorRT-LLM's engine config.json (written by Engine.save at build) and the tokenizer files.
            shutil.copy2(self.engine_dir / ENGINE_DIR / "config.json", path / ENGINE_DIR / "config.json")
            if (self.engine_dir / "tokenizer").is_dir():
                shutil.copytree(self.engine_dir / "tokenizer", path / "tokenizer", dirs_exist_ok=True)
        (path / ENGINE_CONFIG_FILE).write_text(json.dumps(self.meta, indent=2, default=str))
        return path

    # -- generate ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        return_logits: bool = False,
    ) -> Generation:
        if self._runner is None:
            raise EngineError("the tensorrt-llm engine is unloaded; call reload() before generate")
        prompts = validate_prompts(prompt_token_ids, self.vocab_size)
        check_fits(prompts, sampling, self.meta["max_seq_len"], self.vocab_size)
        started = time.perf_counter()
        eos = self.eos_token_ids[0] if self.eos_token_ids and not sampling.ignore_eos else -1
        out = self._runner.generate(
            batch_input_ids=[torch.tensor(p, dtype=torch.int32) for p in prompts],
            max_new_tokens=sampling.max_new_tokens,
            end_id=eos,
            pad_id=max(eos, 0),
            temperature=max(sampling.temperature, 1e-5),
            top_k=1 if sampling.greedy else sampling.top_k,
            top_p=sampling.top_p,
            random_seed=sampling.sequence_seeds(len(prompts)),
            output_generation_logits=True,
            return_dict=True,
        )
        torch.cuda.synchronize()
        stops = set(sampling.stop_token_ids)
        ends = set() if sampling.ignore_eos else set(self.eos_token_ids)
        tokens, logprobs, reasons, all_logits = [], [], [], []
        for i, prompt in enumerate(prompts):
            seq = out["output_ids"][i, 0, len(prompt) : int(out["sequence_lengths"][i, 0])].tolist()
            reason: FinishReason = "length"
            for j, t in enumerate(seq):  # stop tokens are cut here: the engine only knows end_id
                if t in ends or t in stops:
                    seq, reason = seq[: j + 1], "eos" if t in ends else "stop"
                    break
            logits = out["generation_logits"][i, 0, : len(seq)].float()
            scaled = logits if sampling.greedy else logits / sampling.temperature
            lp = torch.log_softmax(scaled, dim=-1).gather(
                -1, torch.tensor(seq, device=logits.device)[:, None]
            )
            tokens.append(seq)
            logprobs.append(lp[:, 0].tolist())
            reasons.append(reason)
            all_logits.append(logits.cpu())
        seconds = time.perf_counter() - started
        return Generation(
            tokens,
            logprobs,
            reasons,
            logits=all_logits if return_logits else None,
            metrics={"perf/gen_tokens_per_s": sum(map(len, tokens)) / max(seconds, 1e-9)},
        )

    # -- refit ---------------------------------------------------------------------------------------------
    def refit(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, partial: bool = False
    ) -> RefitStats:
        """Set this rank's converted pieces with TensorRT's Refitter, then commit them in one
        refit_cuda_engine.

        Memory: the rank's new pieces stay on the GPU until the commit (TensorRT reads them then), so a
        refit holds about one extra copy of this rank's shard; the HF tensors themselves are dropped as
        soon as their pieces are cut (q/k/v of a layer wait for each other, see StreamConverter).
        """
        import tensorrt as trt

        if self._runner is None:
            raise EngineError("the tensorrt-llm engine is unloaded; call reload() before refit")
        if self._weights_discarded and partial:
            raise RefitError(
                "weights were discarded by unload(keep_weights=False): the next refit must be full"
            )
        started = time.perf_counter()
        refitter = trt.Refitter(self._trt_engine(), trt.Logger(trt.Logger.WARNING))
        known = set(refitter.get_all_weights())
        keep: list[torch.Tensor] = []
        count = size = 0
        try:
            converter = StreamConverter(self.layout, ranks=frozenset({self.rank}))
            for _rank, name, piece in converter.convert(named_tensors, partial=partial):
                if name not in known:
                    raise RefitError(
                        f"the engine has no refittable weight {name!r} (it was built without "
                        "use_refit=True, or by another TensorRT-LLM version); rebuild the engine"
                    )
                piece = piece.to("cuda", self.layout.dtype).contiguous()
                keep.append(piece)
                weights = trt.Weights(_trt_dtype(piece.dtype), piece.data_ptr(), piece.numel())
                if not refitter.set_named_weights(name, weights, trt.TensorLocation.DEVICE):
                    raise RefitError(f"TensorRT refused {name} {tuple(piece.shape)} {piece.dtype}")
                count, size = count + 1, size + piece.numel() * piece.element_size()
        except CheckpointConversionError as exc:
            raise RefitError(str(exc)) from None
        if not refitter.refit_cuda_engine():
            raise RefitError(
                f"TensorRT refit_cuda_engine failed; missing weights: {refitter.get_missing_weights()}"
            )
        torch.cuda.synchronize()
        self._weights_discarded = False
        return RefitStats(tensors=count, bytes=size, seconds=time.perf_counter() - started)

    # -- unload / reload -------------------------------------------------------------------------------------
    def unload(self, *, keep_weights: bool = True) -> UnloadStats:
        """Free the runner: the TensorRT engine with its weights, and the KV cache. With keep_weights the
        refit engine is serialized to disk first (the copy reload() reads back: the weights leave the GPU with
        the runner). reload() deserializes it: a new engine with new buffers and new execution contexts, so
        nothing captured against the old addresses survives. The bytes are TensorRT's allocations, which torch
        does not see: the serialized engine's size stands for the weights, the KV cache is not measured
        (None)."""
        if self._runner is None:
            return UnloadStats(
                kv_cache_bytes=0,
                weight_bytes=0,
                weights="discarded" if self._weights_discarded else "offloaded",
            )
        serialized = self._serialize_engine(self.engine_dir / ENGINE_DIR) if keep_weights else None
        self._weights_discarded = not keep_weights
        self._runner = None
        torch.cuda.empty_cache()
        return UnloadStats(
            kv_cache_bytes=None, weight_bytes=serialized, weights="offloaded" if keep_weights else "discarded"
        )

    def reload(self) -> None:
        if self._runner is None:
            from tensorrt_llm.runtime import ModelRunner

            self._runner = ModelRunner.from_dir(str(self.engine_dir / ENGINE_DIR), rank=self.rank)

    @property
    def loaded(self) -> bool:
        return self._runner is not None

    # -- description -----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.layout.spec.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return tuple(self.meta["eos_token_ids"])

    def execution_paths(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "tensorrt_llm": self.meta["tensorrt_llm_version"],
            "engine": "TensorRT (tensorrt_llm.builder.build, use_refit=True)",
            "refit": "trt.Refitter.set_named_weights from the resharding stream",
            "tensor_parallel_size": self.layout.tp_size,
            "sampler": "TensorRT-LLM's sampler",
        }

    def _trt_engine(self) -> Any:
        # ModelRunner -> GenerationSession -> _Runtime -> ICudaEngine
        return self._runner.session.runtime.engine

    def _serialize_engine(self, engine_dir: Path) -> int:
        """Write this rank's engine (with its refit weights); returns its size in bytes."""
        engine_dir.mkdir(parents=True, exist_ok=True)
        return (engine_dir / f"rank{self.rank}.engine").write_bytes(bytes(self._trt_engine().serialize()))


def _trt_dtype(dtype: torch.dtype) -> Any:
    import tensorrt as trt

    return {torch.float32: trt.float32, torch.float16: trt.float16, torch.bfloat16: trt.bfloat16}[dtype]
