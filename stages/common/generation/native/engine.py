"""The native engine for Llama-family models: static KV cache, batched prefill, on-device sampling, refit.

It turns prompt token ids into sampled responses with per-token log-probabilities; it knows nothing
of PPO or tokenizers. Weights live in `InferenceWeights` (fused QKV, fused gate/up) and are only
ever overwritten in place by `refit`, so a refit costs one copy of the weights and nothing else.

Memory (documented contract of unload/reload): unload() drops the KV cache and the captured decode steps
(CUDA graphs); on GPU the weights are copied into a pinned host copy (allocated at the first unload and
reused after) and freed on the device, so reload() brings back exactly the weights it had and a partial
(LoRA) refit still works; keep_weights=False frees them instead (reload() allocates fresh buffers and a
full refit must follow). On CPU the weights already live in host memory, so keep_weights=True leaves them
in place (`offload_weights` set on a CPU engine runs the GPU's path, for tests). Reload allocates the weights
and the cache at new addresses, so a captured step is captured again on first use (_decode_graphed).

CPU speed (engine.cpu_prepack, on by default): every linear weight also has a packed copy
(prepack.py: 16-column blocks for the skinny_linear kernel in fp32 (AVX-512 or AVX2), oneDNN's layout in
bf16), repacked at the end of each refit; the copies double the weight memory and make the decode
GEMMs faster than F.linear (docs/performance.md#cpu-kernels). With engine.compile the decode step and sampler
are compiled during build/load (warmup), so "built" means ready to decode at full speed. In fp32 on one CPU
device (engine.cpu_decode_loop, on by default) a generate's whole decode loop runs in one C++ call instead
(decode_loop.py; docs/performance.md#generation-engine-throughput), the torch step staying for what it does
not cover (top-k/top-p sampling, sliding windows, o_proj biases) and as its reference in the tests.

Tensor parallel (engine.tensor_parallel_size = k > 1, tensor_parallel.py): one engine per rank of a
torch.distributed group of k processes (the world group unless `process_group` is passed), each
holding its shard of the weights and of the KV cache; every rank makes the same calls with the same
arguments and returns the same tokens. Refit takes the same stream of full HF tensors on every
rank, and each rank copies only its slice. TP engines decode eagerly: engine.compile and CUDA graphs
apply to k = 1 only (a collective inside a compiled or captured step is not supported here yet), and
save() is refused (build each rank from the checkpoint). k = 1 runs no collective at all.
"""

from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch

from alignflow.config import EngineConfig
from alignflow.kernels import decode_attention as cpu_decode_attention
from alignflow.kernels import decode_loop as cpp_decode_loop
from alignflow.kernels import rng, sample_tokens, skinny_linear
from alignflow.kernels._chunked_sampling import gumbel_noise_steps
from alignflow.kernels._triton_dispatch import cpp_available, resolve_impl
from alignflow.kernels.sampling import BatchFlags, kept_set_thresholds, uniform_flags
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
from alignflow.stages.common.generation.native import decode_loop, prepack
from alignflow.stages.common.generation.native.graphed_loop import GraphedLoop, capture_graph
from alignflow.stages.common.generation.native.model import (
    DecodeMasks,
    KVCache,
    LlamaFamilyModel,
    prefill_masks,
)
from alignflow.stages.common.generation.native.spec import LlamaFamilySpec, rope_tables, spec_from_hf_config
from alignflow.stages.common.generation.native.tensor_parallel import TensorParallel, check_tensor_parallel
from alignflow.stages.common.generation.native.weights import (
    InferenceWeights,
    checkpoint_tensors,
    saved_engine_tensors,
)

WEIGHTS_FILE = "weights.safetensors"
# On GPU, checking "all sequences finished?" syncs the host with the device; every 8 steps it costs
# at most 7 wasted decode steps per generate call instead of one sync per token.
GPU_STOP_CHECK_EVERY = 8


@dataclass
class _GraphedStep:
    """A static-shape decode step for one batch-size bucket: its input buffers and how to replay it.

    On CUDA `replay` launches the captured graph; elsewhere it calls the same static-shape step
    eagerly, which lets CPU tests exercise every buffer, slot and mask the graph path uses.
    """

    tokens: torch.Tensor  # [bucket, 1] long
    positions: torch.Tensor  # [bucket, 1] long
    slot: torch.Tensor  # [1] long
    masks: dict[int | None, torch.Tensor]  # window -> additive [bucket, 1, 1, S_max]
    graph: Any = None
    logits: torch.Tensor | None = None  # [bucket, V], written by replay
    epoch: int = 0  # the engine's storage epoch at capture: the replay reads that epoch's weights and cache
    replay: Callable[[], None] = field(default=lambda: None)


class NativeEngine(Engine):
    """Llama-family engine; see the module docstring."""

    backend: ClassVar[str] = "native"
    # How many engines were built or loaded in this process: a refit must leave it unchanged.
    builds: ClassVar[int] = 0

    def __init__(
        self,
        hf_config: Any,
        engine_config: EngineConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        eos_token_ids: tuple[int, ...],
        tokenizer_source: Path | None,
        source_checkpoint: str | None,
        process_group: Any = None,
    ):
        self.hf_config = hf_config
        self.engine_config = engine_config
        self.spec: LlamaFamilySpec = spec_from_hf_config(hf_config, engine_config.max_seq_len)
        # Tensor parallel: this rank's shard and collectives (None for one device: no collective anywhere).
        tp_size = engine_config.tensor_parallel_size
        self.tp = TensorParallel(self.spec, tp_size, process_group) if tp_size > 1 else None
        warn_if_cpu_emulates(dtype, device)
        self.dtype = dtype
        self.device = device
        self._eos = eos_token_ids
        self.tokenizer_source = tokenizer_source
        self.source_checkpoint = source_checkpoint
        self.weights = InferenceWeights(self.spec, dtype, device, self.tp)
        # The shapes this process holds: the whole model, or this rank's shard.
        self.local_spec: LlamaFamilySpec = self.weights.local_spec
        cos, sin = rope_tables(hf_config, self.spec, engine_config.max_seq_len)
        layout = None
        if engine_config.cpu_prepack:
            layout = prepack.layout_for(device, dtype, engine_config.cpu_kernels)
        # engine.cpu_linear_weights: bf16 blocked copies, where the engine keeps blocked copies at all
        self.linear_weights_dtype = (
            torch.bfloat16
            if layout == "blocked" and engine_config.cpu_linear_weights == "bfloat16"
            else torch.float32
        )
        self._prepacked = (
            prepack.Prepacked(
                self.weights, engine_config.max_batch_size, layout, blocked_dtype=self.linear_weights_dtype
            )
            if layout
            else None
        )
        # Every weight under the layout's prepack.min_packed_bytes (the demo model): plain F.linear, without
        # even the custom op's dispatch. execution_paths says so.
        self._prepack_skipped = (
            layout if self._prepacked is not None and not self._prepacked.packs_any() else None
        )
        if self._prepack_skipped:
            self._prepacked = None
        self.model = LlamaFamilyModel(
            self.local_spec,
            self.weights,
            cos.to(device, dtype),
            sin.to(device, dtype),
            linear=prepack.linear if self._prepacked else torch.nn.functional.linear,
            cpu_attention=engine_config.cpu_kernels
            and cpu_decode_attention.supports(device, dtype, self.spec.head_dim),
            tp=self.tp,
            decode_kernels=engine_config.gpu_decode_kernels,
            fused_ops=engine_config.gpu_fused_ops,
        )
        # The whole decode loop in one C++ call where it applies (decode_loop.py); None: the torch step below.
        self._decode_loop_reason = decode_loop.unsupported_reason(
            self.local_spec, dtype, device, engine_config, self.tp is not None
        )
        self._decode_loop = (
            decode_loop.CppDecodeLoop(self.local_spec, self.weights, self.linear_weights_dtype)
            if self._decode_loop_reason is None
            else None
        )
        self.cache: KVCache | None = self._new_cache()
        self._weights_valid = False  # set once a full weight stream has been copied in
        self._busy = False
        # Prefill rows with the same prompt once (_prefill); False: every row's own, the reference.
        self.share_prompt_prefill = True
        self._graphs: dict[int, _GraphedStep] = {}
        # engine.cuda_graph_loop: (bucket, sampling flags) -> the in-graph decode loop (graphed_loop.py)
        self._loops: dict[tuple[int, BatchFlags], GraphedLoop] = {}
        self._graph_loop_failed = False  # a capture failed: decode per step from then on
        self._graph_pool = None
        # Bumped whenever the weight buffers or the KV cache are allocated anew (reload): a captured step
        # replays against the addresses of its capture, so a step of an older epoch is captured again, never
        # replayed.
        self._storage_epoch = 0
        # unload(keep_weights=True) moves the weights to host memory where that frees something: on a GPU. On
        # a CPU they are in host memory already; a test sets it there to run the GPU's path (new buffers at
        # reload).
        self.offload_weights = device.type != "cpu"
        self._host_weights: dict[str, torch.Tensor] = {}  # the offloaded copy, one per buffer, kept for reuse
        self._offloaded = False  # weights.buffers are the host copy (unloaded); reload() moves them back
        # Tensor parallel decodes eagerly (module docstring): compile and CUDA graphs for one device only.
        self._compile = engine_config.compile and self.tp is None
        if engine_config.compile and self.tp is not None:
            warnings.warn(
                f"engine.compile ignored with engine.tensor_parallel_size={tp_size}: tensor-parallel "
                "engines decode eagerly",
                RuntimeWarning,
                stacklevel=2,
            )
        self._use_graphs = engine_config.cuda_graphs and device.type == "cuda" and self.tp is None
        # engine.compile: the decode step and the sampler are compiled with automatic dynamic shapes
        # (dynamic=None): a size becomes symbolic once it is seen to change, so after warmup() one
        # graph serves every step (slot, kv length) and batch size, while the model's own sizes
        # (heads, head_dim, hidden, vocab) stay constants the C++ code is specialised for, which gives a
        # faster decode step than dynamic=True (every size symbolic).
        # Sampler: on CPU with the C++ kernels (engine.cpu_kernels; AVX-512, or its AVX2 build on CPUs
        # without it) both engines call the kernel eagerly: the reference's tokens, faster than the compiled
        # reference and the chunked sampler (docs/performance.md#cpu-kernels, benchmarks/sampler_bench.py).
        # Otherwise a compiled engine compiles the torch reference (impl="torch": ~40 small integer/float
        # ops over [B, V] that inductor fuses into one loop) and an eager one takes the chunked CPU sampler
        # (same tokens, several times faster than the eager reference), or on CUDA impl="auto": the Triton
        # kernel.
        cpp_sampler = device.type == "cpu" and engine_config.cpu_kernels and cpp_available()
        self._step = torch.compile(self.model.forward, dynamic=None) if self._compile else self.model.forward
        if cpp_sampler:
            self._sample, self._sample_impl = sample_tokens, "cpp"
        elif self._compile:
            self._sample = torch.compile(sample_tokens, dynamic=None)
            self._sample_impl = "torch" if device.type == "cpu" else "auto"
        else:
            self._sample, self._sample_impl = sample_tokens, "chunked" if device.type == "cpu" else "auto"
        NativeEngine.builds += 1

    def execution_paths(self) -> dict[str, Any]:
        """The code each part of generation runs here: decode step, linears, decode attention, sampler.

        On CPU the fast paths depend on the machine (AVX-512, a compiler for the C++ kernels) and on
        config (engine.cpu_prepack, engine.cpu_kernels); a path that is not taken says why.
        """
        config, cpu = self.engine_config, self.device.type == "cpu"
        if self._use_graphs:
            step = "CUDA graph per batch bucket"
            if config.gpu_decode_kernels == "triton":
                step += fused_ops_path(config.gpu_fused_ops)
        else:
            step = "torch.compile" if self._compile else "eager"
        layout = self._prepacked.layout if self._prepacked is not None else None
        linear = {
            "blocked": (
                f"skinny_linear ({skinny_linear.isa()} C++) up to {skinny_linear.max_rows()} rows, "
                "F.linear above"
                if self.linear_weights_dtype == torch.float32
                else f"skinny_linear ({skinny_linear.isa()} C++) on bfloat16 blocks up to "
                f"{skinny_linear.max_rows()} rows, F.linear on the bf16-rounded weight above"
            ),
            "onednn": "oneDNN prepacked",
            None: "F.linear",
        }[layout]
        if self._prepack_skipped:
            linear += (
                f" (every weight is under {prepack.min_packed_bytes(self._prepack_skipped) >> 10} KiB, where "
                f"{self._prepack_skipped} packing does not pay)"
            )
        if self.model.cpu_attention:
            attention = "decode_attention (AVX-512 C++)"
        else:
            attention = "torch (one query per row, KV groups folded)"
            if cpu and self.dtype == torch.float32 and config.cpu_kernels:
                if cpu_decode_attention.available():
                    attention += (
                        "; the C++ kernel takes head_dim a multiple of 16 up to 256, "
                        f"not {self.spec.head_dim}"
                    )
                else:
                    attention += f"; no C++ kernel: {cpu_decode_attention.unavailable_reason()}"
        sampler = sampler_path(resolve_impl(self._sample_impl, self.device, "sample_tokens"))
        if self._sample is not sample_tokens:
            sampler += ", compiled"
        if self._decode_loop is not None:
            loop = f"C++ decode loop ({cpp_decode_loop.isa()}, kernels/decode_loop.py)"
            step = f"{loop}; with top-k/top-p sampling {step}"
        paths: dict[str, Any] = {
            "backend": self.backend,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "decode_step": step,
            "linear": linear,
            "decode_attention": attention,
            "prefill_attention": "sdpa",
            "sampler": sampler,
        }
        if self.tp is not None:
            paths["tensor_parallel"] = (
                f"rank {self.tp.rank} of {self.tp.size} ({self.tp.backend}): column-parallel QKV and "
                "gate/up, row-parallel o_proj and down (all_reduce), vocab-parallel embedding and LM head "
                "(all_gather); eager decode (no compile, no CUDA graphs)"
            )
        if cpu and self._decode_loop is None:
            paths["decode_loop"] = f"not used: {self._decode_loop_reason}"
        if cpu and self.dtype == torch.float32:
            if not config.cpu_kernels:
                paths["cpu_kernels"] = "off (engine.cpu_kernels: false)"
            elif (reason := skinny_linear.unavailable_reason()) is not None:
                paths["cpu_kernels"] = f"unavailable: {reason}"
            if not config.cpu_prepack:
                paths["cpu_prepack"] = "off (engine.cpu_prepack: false)"
        if config.cpu_linear_weights == "bfloat16" and self.linear_weights_dtype != torch.bfloat16:
            paths["cpu_linear_weights"] = (
                "bfloat16 not applied: it rounds the blocked copies of a float32 CPU engine with the C++ "
                f"kernels, and this one ({self.dtype} on {self.device.type}) keeps none"
            )
        return paths

    def _new_cache(self) -> KVCache:
        # local_spec: a tensor-parallel rank caches its own KV heads only.
        return KVCache(
            self.local_spec,
            self.engine_config.max_batch_size,
            self.engine_config.max_seq_len,
            self.dtype,
            self.device,
        )

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        checkpoint_dir: str | Path,
        engine_config: EngineConfig,
        *,
        dtype: str = "float32",
        device: str | None = None,
        process_group: Any = None,
    ) -> NativeEngine:
        """Read config.json, allocate buffers, stream the safetensors shards into them (one tensor at a time).

        With engine.tensor_parallel_size = k > 1 every rank of `process_group` (default: the world
        group, which must then have k ranks) calls build; each reads the checkpoint and keeps its slice.
        """
        from transformers import AutoConfig

        checkpoint_dir = Path(checkpoint_dir)
        if not (checkpoint_dir / "config.json").is_file():
            raise FileNotFoundError(
                f"{checkpoint_dir}: no config.json; expected a Hugging Face causal-LM directory"
            )
        hf_config = AutoConfig.from_pretrained(checkpoint_dir)
        # Fail on the architecture (and its split over tensor-parallel ranks) before allocating.
        check_tensor_parallel(
            spec_from_hf_config(hf_config, engine_config.max_seq_len), engine_config.tensor_parallel_size
        )
        engine = cls(
            hf_config,
            engine_config,
            dtype=resolve_dtype(dtype),
            device=resolve_device(device),
            eos_token_ids=eos_ids_of(checkpoint_dir, hf_config),
            tokenizer_source=checkpoint_dir,
            source_checkpoint=str(checkpoint_dir),
            process_group=process_group,
        )
        engine.weights.copy_stream(checkpoint_tensors(checkpoint_dir), partial=False)
        engine._weights_written()
        engine.warmup()
        return engine

    def warmup(self) -> float:
        """Compile now rather than inside the first generate (engine.compile only); returns seconds spent.

        Part of build and load: a compiled engine is not built until its decode step is. Two short
        generates with temperature 1 and no top-k/top-p (the RL default; other sampling modes compile
        their sampler on first use), over several decode steps and at two batch sizes: the varying
        dims are marked dynamic before the first compile (_mark_dynamic), and the second generate
        makes a graph that specialised on one of them anyway recompile in the build, not in the
        first real generate. Those sizes avoid every size the step also sees (heads, head_dim, cache shape,
        ...): dynamo gives equal sizes one symbol, so a warm-up at batch 2 on a model with 2 KV heads would
        compile a graph valid only while batch == 2 and the first real generate would recompile (seconds).
        Size 1 is avoided too (it is specialised).
        """
        if not self._compile or self.cache is None:
            return 0.0
        spec, config = self.spec, self.engine_config
        taken = {
            0,
            1,
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
            spec.hidden_size,
            spec.intermediate_size,
            spec.vocab_size,
            spec.num_layers,
            spec.q_size,
            spec.kv_size,
            config.max_batch_size,
            config.max_seq_len,
        }
        new_tokens = 3
        batch_sizes = [b for b in range(2, config.max_batch_size) if b not in taken][:2] or [1]
        # Prompt width w: the decode steps use slots w .. w + new_tokens - 1 and kv lengths up to w +
        # new_tokens.
        width = next(
            (
                w
                for w in range(2, config.max_seq_len - new_tokens)
                if taken.isdisjoint(range(w, w + new_tokens + 1))
                and not set(batch_sizes) & set(range(w, w + new_tokens + 1))
            ),
            2,
        )
        started = time.perf_counter()
        for rows in batch_sizes:
            self.generate(
                [[0] * width] * rows,
                SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True),
            )
        return time.perf_counter() - started

    def _weights_written(self) -> None:
        """The plain buffers hold a complete, consistent set of weights: derived copies follow them."""
        if self._prepacked is not None:
            self._prepacked.refresh()
        if self._decode_loop is not None:
            self._decode_loop.refresh()
        self._weights_valid = True

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @property
    def max_seq_len(self) -> int:
        return self.engine_config.max_seq_len

    @property
    def loaded(self) -> bool:
        return self.cache is not None

    # -- generation -------------------------------------------------------------------------------
    def _check_ready(self) -> None:
        if self.cache is None:
            raise EngineError("the engine is unloaded; call reload() before generate()")
        if not self._weights_valid:
            raise EngineError(
                "the engine holds no valid weights (unload(keep_weights=False) discarded them, or a refit "
                "failed); call refit(...) with every parameter first"
            )
        if self._busy:
            raise EngineError("generate() is already running on this engine (engines are not re-entrant)")

    def generate(
        self,
        prompt_token_ids: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        return_logits: bool = False,
    ) -> Generation:
        """Generate for any number of prompts, max_batch_size rows at a time. See Engine.generate."""
        self._check_ready()
        prompts = validate_prompts(prompt_token_ids, self.vocab_size)
        check_fits(prompts, sampling, self.max_seq_len, self.vocab_size)
        seeds = sampling.sequence_seeds(len(prompts))
        rows = self.engine_config.max_batch_size
        parts = []
        self._busy = True
        try:
            for start in range(0, len(prompts), rows):
                parts.append(
                    self._generate_batch(
                        prompts[start : start + rows], seeds[start : start + rows], sampling, return_logits
                    )
                )
        finally:
            # An exception or KeyboardInterrupt mid-decode leaves nothing half-done that matters: every
            # generate rewrites the cache slots it reads, so the engine stays usable.
            self._busy = False
        return _merge(parts)

    @torch.no_grad()
    def _generate_batch(
        self, prompts: list[list[int]], seeds: list[int], sampling: SamplingParams, return_logits: bool
    ) -> Generation:
        started = time.perf_counter()
        dev, cache = self.device, self.cache
        assert cache is not None
        B, S = len(prompts), max(len(p) for p in prompts)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.long)
        tokens = torch.tensor([[0] * (S - len(p)) + p for p in prompts], dtype=torch.long, device=dev)
        pad = (S - lens).to(dev)
        lens = lens.to(dev)
        positions = (torch.arange(S, device=dev)[None, :] - pad[:, None]).clamp(min=0)
        logits = self._prefill(cache, prompts, tokens, positions, pad)
        masks = DecodeMasks(self.spec, pad, self.max_seq_len, self.dtype)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        prefill_s = time.perf_counter() - started

        temperature = torch.full((B,), sampling.temperature, dtype=torch.float32, device=dev)
        top_k = torch.full((B,), sampling.top_k, dtype=torch.long, device=dev)
        top_p = torch.full((B,), sampling.top_p, dtype=torch.float32, device=dev)
        seed_t = torch.tensor(seeds, dtype=torch.long, device=dev)
        ends = torch.zeros(self.vocab_size, dtype=torch.bool, device=dev)
        if not sampling.ignore_eos and self._eos:
            ends[list(self._eos)] = True
        if sampling.stop_token_ids:
            ends[sampling.stop_token_ids] = True

        new = sampling.max_new_tokens
        flags = uniform_flags(sampling.temperature, sampling.top_k, sampling.top_p, self.vocab_size)
        if self._decode_loop is not None and not (flags.any_top_k or flags.any_top_p):
            # Every step in one C++ call: the loop below, through the same kernels, without Python per step.
            kept = torch.empty((B, new, self.vocab_size), dtype=torch.float32) if return_logits else None
            out_tokens, out_logprobs, lengths, steps = self._decode_loop.run(
                logits,
                cache.k,
                cache.v,
                self.model.cos,
                self.model.sin,
                masks.bias,
                lens,
                S,
                temperature,
                seed_t,
                ends,
                new,
                kept,
            )
            return self._generation(
                started,
                prefill_s,
                sampling,
                out_tokens,
                out_logprobs,
                lengths,
                steps,
                None if kept is None else kept[:, :steps],
            )
        out_tokens = torch.zeros((B, new), dtype=torch.long, device=dev)
        out_logprobs = torch.zeros((B, new), dtype=torch.float32, device=dev)
        lengths = torch.full((B,), new, dtype=torch.long, device=dev)
        finished = torch.zeros(B, dtype=torch.bool, device=dev)
        kept_logits: list[torch.Tensor] = []
        check_every = GPU_STOP_CHECK_EVERY if dev.type == "cuda" else 1
        steps = 0
        # One SamplingParams for the whole batch: its flags (above) let the sampler branch on Python values
        # (no per-step host sync, no graph break in the compiled sampler).
        self._mark_dynamic(temperature, top_k, top_p, seed_t)  # once: they live for the whole batch
        # The compiled torch sampler would sort every row for top-k/top-p (many times the cost of sampling
        # without truncation); eagerly its thresholds come from sorted prefixes.
        eager_thresholds = (
            self._compile and self._sample_impl == "torch" and (flags.any_top_k or flags.any_top_p)
        )
        # The eager chunked sampler takes its Gumbel noise from windows of steps computed here (the RNG is a
        # pure function of seed, step and token: rng.py) instead of hashing in each of its calls, which on a
        # small model (the demo's [32, 512] logits) is ~25 of the decode step's ~280 operator calls; one
        # window per call. A window is at most NOISE_WINDOW_ELEMENTS noise values, and only as many steps as
        # remain.
        noise = (
            NoiseWindows(seed_t, new, self.vocab_size)
            if self._sample_impl == "chunked" and not flags.all_greedy
            else None
        )
        if (
            self._use_graphs
            and self.engine_config.cuda_graph_loop
            and not (return_logits or self._compile or self._graph_loop_failed)
        ):
            looped = self._decode_in_graph(
                logits, lens, S, masks, (temperature, top_k, top_p, seed_t), ends, new, flags
            )
            if looped is not None:
                return self._generation(started, prefill_s, sampling, *looped, None)
        for t in range(new):
            # Values were checked once by SamplingParams: skip the per-call check (a host sync on GPU).
            # The step as a [B] tensor, not an int: see _mark_dynamic.
            steps_t = torch.full((B,), t, dtype=torch.long, device=dev)
            self._mark_dynamic(logits, steps_t)
            thresholds = None
            if eager_thresholds:
                thresholds = kept_set_thresholds(logits, temperature, top_k, top_p, flags)
                self._mark_dynamic(thresholds)
            sample = self._sample(
                logits,
                temperature,
                top_k,
                top_p,
                seed_t,
                steps_t,
                self._sample_impl,
                validate=False,
                flags=flags,
                thresholds=thresholds,
                noise=None if noise is None else noise.at(t),
            )
            out_tokens[:, t] = sample.tokens
            out_logprobs[:, t] = sample.logprobs
            if return_logits:
                kept_logits.append(logits.float().cpu())
            hit = ends[sample.tokens] & ~finished
            lengths = torch.where(hit, t + 1, lengths)
            finished |= hit
            steps = t + 1
            if t + 1 == new or ((t + 1) % check_every == 0 and bool(finished.all())):
                break
            logits = self._decode(sample.tokens, lens + t, S + t, masks)
        stacked = torch.stack(kept_logits, dim=1) if return_logits else None  # [B, steps, V]
        return self._generation(
            started, prefill_s, sampling, out_tokens, out_logprobs, lengths, steps, stacked
        )

    def _generation(
        self,
        started: float,
        prefill_s: float,
        sampling: SamplingParams,
        out_tokens: torch.Tensor,
        out_logprobs: torch.Tensor,
        lengths: torch.Tensor,
        steps: int,
        stacked_logits: torch.Tensor | None,
    ) -> Generation:
        """The Generation of a decode loop's outputs: tokens, log-probs [B, new], lengths [B],
        logits [B, steps, V]."""
        dev = self.device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - started
        lengths_l = lengths.tolist()
        tokens_l = out_tokens.tolist()
        logprobs_l = out_logprobs.tolist()
        responses, logprobs, reasons = [], [], []
        eos = set(self._eos) if not sampling.ignore_eos else set()
        for b, n in enumerate(lengths_l):
            responses.append(tokens_l[b][:n])
            logprobs.append(logprobs_l[b][:n])
            reasons.append(_finish_reason(tokens_l[b][n - 1], eos, sampling.stop_token_ids))
        generated = sum(lengths_l)
        per_row_logits = None
        if stacked_logits is not None:
            per_row_logits = [stacked_logits[b, :n] for b, n in enumerate(lengths_l)]
        return Generation(
            response_token_ids=responses,
            logprobs=logprobs,
            finish_reasons=reasons,
            logits=per_row_logits,
            metrics={
                "timing/prefill_s": prefill_s,
                "timing/generate_s": elapsed,
                "perf/decode_steps": steps,
                "perf/generated_tokens": generated,
                "perf/gen_tokens_per_s": generated / max(elapsed, 1e-9),
            },
        )

    def _prefill(
        self,
        cache: KVCache,
        prompts: list[list[int]],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        pad: torch.Tensor,
    ) -> torch.Tensor:
        """The last position's logits [B, V] of every prompt, its keys and values written to cache rows
        0..B-1.

        Rows with the same prompt (GRPO's group of completions per prompt, n samples) are computed once
        (share_prompt_prefill) and their cache rows copied: the prefill's work goes with the distinct prompts.
        """
        first: dict[tuple[int, ...], int] = {}  # prompt -> its index among the distinct ones
        heads: list[int] = []  # the row each distinct prompt first appears in
        inverse = []
        for row, prompt in enumerate(map(tuple, prompts)):
            if prompt not in first:
                first[prompt] = len(heads)
                heads.append(row)
            inverse.append(first[prompt])
        width = tokens.shape[1]
        if not self.share_prompt_prefill or len(heads) == len(prompts):
            return self.model.forward(
                cache, tokens, positions, 0, prefill_masks(self.spec, pad, width, self.dtype), pad=pad
            )
        distinct = torch.tensor(heads, device=tokens.device)
        logits = self.model.forward(
            cache,
            tokens[distinct],
            positions[distinct],
            0,
            prefill_masks(self.spec, pad[distinct], width, self.dtype),
            pad=pad[distinct],
        )
        index = torch.tensor(inverse, device=tokens.device)
        for layer in cache.k + cache.v:
            layer[: len(prompts), :, :width] = layer[index, :, :width]  # the gather copies before the write
        return logits[index]

    def _decode(
        self, tokens: torch.Tensor, positions: torch.Tensor, slot: int, masks: DecodeMasks
    ) -> torch.Tensor:
        """Logits [B, V] of one decode step: tokens, positions [B]; the new keys go to cache slot `slot`."""
        assert self.cache is not None
        if self._use_graphs:
            return self._decode_graphed(tokens, positions, slot, masks)
        step_masks = masks.at(slot, slot + 1)
        tokens, positions = tokens[:, None], positions[:, None]
        self._mark_dynamic(tokens, positions)
        self._mark_dynamic(*step_masks.values(), dims=(0, 3))
        # slot=None: the step reads slot = kv_len - 1 from the masks' (dynamic) last dim.
        return self._step(self.cache, tokens, positions, None, step_masks)

    def _mark_dynamic(self, *tensors: torch.Tensor, dims: tuple[int, ...] = (0,)) -> None:
        """Tell torch.compile that these dims (batch; kv length of the masks) vary, before it first compiles.

        Under automatic dynamic shapes a size or int argument is first compiled as a constant and
        only made symbolic when it changes, one more compile each time. Marking the varying dims
        up front, and passing the decode step and the sampler no int that changes per step (the
        cache slot comes from the masks' shape, the sampling step is a [B] tensor), leaves one
        graph per function, where marks on the batch dim alone, or none, leave several, each a compile of
        minutes on a ~110M model. "maybe": a batch of 1 is
        still specialised rather than rejected.
        """
        if self._compile:
            for tensor in tensors:
                for dim in dims:
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)

    # -- CUDA graphs (GPU only) ---------------------------------------------------------------------
    def _bucket(self, batch: int) -> int:
        bucket = 1
        while bucket < batch:
            bucket *= 2
        return min(bucket, self.engine_config.max_batch_size)

    def _decode_graphed(
        self, tokens: torch.Tensor, positions: torch.Tensor, slot: int, masks: DecodeMasks
    ) -> torch.Tensor:
        B = tokens.shape[0]
        bucket = self._bucket(B)
        step = self._graphs.get(bucket)
        if step is not None and step.epoch != self._storage_epoch:
            # Captured against buffers that reload() replaced: replaying it would read freed memory.
            self._graphs.clear()
            self._graph_pool = None
            step = None
        if step is None:
            try:
                step = self._capture(bucket)
            except Exception as exc:  # noqa: BLE001 - capture problems must not stop generation
                warnings.warn(
                    f"CUDA graph capture failed ({exc!r}); decoding eagerly from now on", stacklevel=2
                )
                self._use_graphs = False
                return self._decode(tokens, positions, slot, masks)
            self._graphs[bucket] = step
        step.tokens.zero_()
        step.tokens[:B, 0].copy_(tokens)
        step.positions.zero_()
        step.positions[:B, 0].copy_(positions)
        step.slot.fill_(slot)
        for window, mask in masks.at(slot, self.max_seq_len).items():
            # Rows past B keep an all-zero mask: they attend to finite stale keys, never to nothing.
            step.masks[window][:B].copy_(mask)
        step.replay()
        assert step.logits is not None
        return step.logits[:B]

    def _decode_in_graph(
        self,
        logits: torch.Tensor,
        lens: torch.Tensor,
        width: int,
        masks: DecodeMasks,
        sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        ends: torch.Tensor,
        new: int,
        flags: BatchFlags,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """The decode loop of _generate_batch as one replay per token (graphed_loop.py): (tokens [B, new],
        log-probs [B, new], lengths [B], steps), views of the loop's buffers; None where the loop cannot be
        captured (the caller decodes per step)."""
        batch = logits.shape[0]
        key = (self._bucket(batch), flags)
        loop = self._loops.get(key)
        if loop is not None and loop.epoch != self._storage_epoch:
            self._loops.clear()  # captured against buffers reload() replaced (as _decode_graphed)
            loop = None
        if loop is None:
            try:
                loop = self._capture_loop(key[0], flags)
            except Exception as exc:  # noqa: BLE001 - capture problems must not stop generation
                warnings.warn(
                    f"CUDA graph capture of the decode loop failed ({exc!r}); decoding per step from now on",
                    stacklevel=3,
                )
                self._graph_loop_failed = True
                return None
            self._loops[key] = loop
        temperature, top_k, top_p, seeds = sampling
        steps_t = torch.zeros(batch, dtype=torch.long, device=self.device)
        first = self._sample(
            logits, temperature, top_k, top_p, seeds, steps_t, self._sample_impl, validate=False, flags=flags
        )
        loop.start(first, lens, width, masks.at(width, self.max_seq_len), sampling, ends, new)
        check_every = GPU_STOP_CHECK_EVERY if self.device.type == "cuda" else 1
        steps = 1
        while steps < new and not (steps % check_every == 0 and bool(loop.finished.all())):
            loop.replay()
            steps += 1
        return loop.out_tokens[:batch, :new], loop.out_logprobs[:batch, :new], loop.lengths[:batch], steps

    def _capture_loop(self, bucket: int, flags: BatchFlags) -> GraphedLoop:
        loop = GraphedLoop.empty(
            bucket, self.max_seq_len, self.vocab_size, set(self.spec.sliding_windows), self.dtype,
            self.device, self._storage_epoch,
        )
        cache = self.cache

        def run() -> None:
            loop.body(self._step, self._sample, cache, flags, self._sample_impl)

        if self.device.type != "cuda":
            # As a graph does: replay against the cache and weight buffers of the capture (as _capture).
            buffers = dict(self.weights.buffers)

            def eager_replay() -> None:
                current, self.weights.buffers = self.weights.buffers, buffers
                try:
                    run()
                finally:
                    self.weights.buffers = current

            loop.replay = eager_replay
            return loop
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        loop.graph = capture_graph(run, self.device, self._graph_pool)
        loop.replay = loop.graph.replay
        return loop

    def _capture(self, bucket: int) -> _GraphedStep:
        dev, S = self.device, self.max_seq_len
        step = _GraphedStep(
            tokens=torch.zeros((bucket, 1), dtype=torch.long, device=dev),
            positions=torch.zeros((bucket, 1), dtype=torch.long, device=dev),
            # Warm-up and capture write into the last slot, which a running generation has not
            # reached yet (and overwrites before it reads it), so capturing mid-generate is safe.
            slot=torch.full((1,), S - 1, dtype=torch.long, device=dev),
            masks={
                w: torch.zeros((bucket, 1, 1, S), dtype=self.dtype, device=dev)
                for w in set(self.spec.sliding_windows)
            },
            epoch=self._storage_epoch,
        )

        def run() -> torch.Tensor:
            return self._step(self.cache, step.tokens, step.positions, step.slot, step.masks)

        if dev.type != "cuda":
            # As a graph does: replay against the cache and weight buffers of the capture, not the current
            # ones, so a CPU test sees what a step replayed after reload() (new buffers) would compute.
            cache, buffers = self.cache, dict(self.weights.buffers)

            def eager_replay() -> None:
                current, self.weights.buffers = self.weights.buffers, buffers
                try:
                    step.logits = self._step(cache, step.tokens, step.positions, step.slot, step.masks)
                finally:
                    self.weights.buffers = current

            step.replay = eager_replay
            return step
        def record() -> None:
            step.logits = run()  # the capture's output buffer is what every replay writes

        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        step.graph = capture_graph(record, dev, self._graph_pool)
        step.replay = step.graph.replay
        return step

    # -- reference path ---------------------------------------------------------------------------
    @torch.no_grad()
    def forward_logits(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Logits [len_i, V] float32 at every position of each sequence, from one batched prefill.

        The slow, simple path (no decode loop): tests compare it and the decode loop with transformers.
        """
        self._check_ready()
        seqs = validate_prompts(sequences, self.vocab_size)
        if len(seqs) > self.engine_config.max_batch_size or max(map(len, seqs)) > self.max_seq_len:
            raise ValueError(
                f"forward_logits takes at most {self.engine_config.max_batch_size} sequences of at "
                f"most {self.max_seq_len} tokens"
            )
        dev, S = self.device, max(len(s) for s in seqs)
        tokens = torch.tensor([[0] * (S - len(s)) + s for s in seqs], dtype=torch.long, device=dev)
        pad = torch.tensor([S - len(s) for s in seqs], dtype=torch.long, device=dev)
        positions = (torch.arange(S, device=dev)[None, :] - pad[:, None]).clamp(min=0)
        assert self.cache is not None
        logits = self.model.forward(
            self.cache,
            tokens,
            positions,
            0,
            prefill_masks(self.spec, pad, S, self.dtype),
            logits_for="all",
            pad=pad,
        )
        return [logits[b, S - len(s) :].cpu() for b, s in enumerate(seqs)]

    # -- refit -------------------------------------------------------------------------------------
    def refit(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, partial: bool = False
    ) -> RefitStats:
        """Copy (HF name, tensor) pairs into the fused buffers in place; see InferenceWeights.copy_stream."""
        if self._busy:
            raise EngineError("refit() called while generate() is running")
        if self.weights.buffers["embed"].numel() == 0:
            raise EngineError(
                "the engine's weights were discarded by unload(keep_weights=False); call reload() "
                "before refit()"
            )
        if partial and not self._weights_valid:
            raise RefitError("partial refit into discarded weights: send every parameter (partial=False)")
        try:
            stats = self.weights.copy_stream(named_tensors, partial=partial)
        except BaseException:
            # Some slices may hold new values and others old ones: refuse to generate from the mix.
            self._weights_valid = False
            raise
        self._weights_written()
        return stats

    # -- memory -----------------------------------------------------------------------------------
    def unload(self, *, keep_weights: bool = True) -> UnloadStats:
        """Free the KV cache and the captured steps; the weights to the host copy where `offload_weights`
        (GPU), or freed with keep_weights=False. See the module docstring."""
        if self._busy:
            raise EngineError("unload() called while generate() is running")
        kv_bytes = self.cache.nbytes() if self.cache is not None else 0
        self.cache = None
        self._graphs.clear()  # their graph pool goes with them (empty_cache below gives it back)
        self._loops.clear()
        self._graph_pool = None
        discarded = self.weights.buffers["embed"].numel() == 0
        on_device = not (discarded or self._offloaded)
        weight_bytes = 0
        where: WeightsAfterUnload = "kept"
        if not keep_weights:
            weight_bytes = self.weights.nbytes() if on_device else 0
            self._clear_derived()
            self.weights.discard()
            self._host_weights, self._offloaded, self._weights_valid = {}, False, False
            where = "discarded"
        elif on_device and self.offload_weights:
            weight_bytes = self.weights.nbytes()
            self._offload()
            where = "offloaded"
        elif not on_device:  # unloaded already
            where = "discarded" if discarded else "offloaded"
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return UnloadStats(kv_cache_bytes=kv_bytes, weight_bytes=weight_bytes, weights=where)

    def reload(self) -> None:
        """New weight buffers (from the host copy, or empty after a discard) and a new zeroed KV cache."""
        if self.weights.buffers["embed"].numel() == 0:
            self.weights.allocate(self.device)
            self._storage_epoch += 1
        elif self._offloaded:
            self._restore()
        if self.cache is None:
            self.cache = self._new_cache()
            self._storage_epoch += 1

    def _offload(self) -> None:
        """Copy every weight buffer into the host copy (pinned on CUDA, so the copies run at full PCIe speed)
        and let the device buffers go. The host copy is allocated at the first unload and reused by every
        later one: pinning gigabytes of host memory costs far more than copying into it."""
        pinned = self.device.type == "cuda"
        if not self._host_weights:
            self._host_weights = {
                name: torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
                for name, t in self.weights.buffers.items()
            }
        for name, t in self.weights.buffers.items():
            self._host_weights[name].copy_(t, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize(self.device)  # the host copy is complete before the device buffers go
        self._clear_derived()  # CPU only: packed copies keyed by the buffers' addresses
        # A refit while unloaded writes into the host copy, which reload() then carries back.
        self.weights.buffers = dict(self._host_weights)
        self.weights.device = torch.device("cpu")
        self._offloaded = True

    def _restore(self) -> None:
        """The inverse of _offload: fresh device buffers filled from the host copy
        (which stays for the next one)."""
        pinned = self.device.type == "cuda"
        restored = {}
        for name, host in self._host_weights.items():
            restored[name] = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            restored[name].copy_(host, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize(self.device)
        self.weights.buffers = restored
        self.weights.device = self.device
        self._offloaded = False
        self._storage_epoch += 1
        if self._weights_valid:
            self._weights_written()  # CPU only: the packed copies and the C++ loop's blocked ones follow

    def _clear_derived(self) -> None:
        if self._prepacked is not None:
            self._prepacked.clear()
        if self._decode_loop is not None:
            self._decode_loop.clear()

    # -- persistence ------------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write engine_config.json, config.json, weights.safetensors (inference layout) and tokenizer/."""
        from safetensors.torch import save_file

        if self.tp is not None:
            raise EngineError(
                f"save() of a tensor-parallel engine (engine.tensor_parallel_size={self.tp.size}): each rank "
                "holds a shard only; build every rank from the Hugging Face checkpoint instead, or save a "
                "tensor_parallel_size 1 engine"
            )
        if not self._weights_valid:
            raise EngineError("cannot save an engine without valid weights; refit it first")
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        save_file(
            {name: t.detach().contiguous().cpu() for name, t in self.weights.buffers.items()},
            str(path / WEIGHTS_FILE),
            metadata={"format": ENGINE_FORMAT},
        )
        self.hf_config.to_json_file(str(path / "config.json"))
        tokenizer_files = copy_tokenizer_files(self.tokenizer_source, path) if self.tokenizer_source else []
        meta = {
            "format": ENGINE_FORMAT,
            "layout_version": ENGINE_LAYOUT_VERSION,
            "backend": self.backend,
            "engine_config": self.engine_config.model_dump(mode="json"),
            "dtype": str(self.dtype).removeprefix("torch."),
            "model_type": self.spec.model_type,
            "spec": self.spec.to_dict(),
            "eos_token_ids": list(self._eos),
            "weights": WEIGHTS_FILE,
            "tokenizer": "tokenizer" if tokenizer_files else None,
            "source_checkpoint": self.source_checkpoint,
        }
        (path / ENGINE_CONFIG_FILE).write_text(json.dumps(meta, indent=2))
        return path

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        device: str | None = None,
        tensor_parallel_size: int = 1,
        process_group: Any = None,
    ) -> NativeEngine:
        """Load a saved engine. tensor_parallel_size = k > 1: this process is one rank of a k-rank engine over
        `process_group` (default: the world group); every rank calls load and keeps its shard, streaming the
        saved (one-device) buffers through refit one layer at a time (weights.saved_engine_tensors), so no
        rank holds the whole model."""
        from safetensors import safe_open
        from transformers import AutoConfig

        path = Path(path)
        meta = read_engine_config(path)
        if meta["backend"] != cls.backend:
            raise ValueError(
                f"{path} holds a {meta['backend']!r} engine, not {cls.backend!r}; use load_engine()"
            )
        hf_config = AutoConfig.from_pretrained(path)
        tokenizer_dir = path / meta["tokenizer"] if meta.get("tokenizer") else None
        engine_config = EngineConfig.model_validate(meta["engine_config"])
        if engine_config.tensor_parallel_size != 1:
            raise ValueError(
                f"{path}: a saved engine holds the whole model (tensor_parallel_size 1), not "
                f"{engine_config.tensor_parallel_size}; rebuild it"
            )
        if tensor_parallel_size > 1:
            check_tensor_parallel(
                spec_from_hf_config(hf_config, engine_config.max_seq_len), tensor_parallel_size
            )
            engine_config = engine_config.model_copy(update={"tensor_parallel_size": tensor_parallel_size})
        engine = cls(
            hf_config,
            engine_config,
            dtype=resolve_dtype(meta["dtype"]),
            device=resolve_device(device),
            eos_token_ids=tuple(meta["eos_token_ids"]),
            tokenizer_source=tokenizer_dir,
            source_checkpoint=meta.get("source_checkpoint"),
            process_group=process_group,
        )
        if _json_roundtrip(engine.spec.to_dict()) != meta["spec"]:
            raise ValueError(
                f"{path}: config.json does not describe the model in engine_config.json (edited?)"
            )
        if engine.tp is not None:
            engine.weights.copy_stream(
                saved_engine_tensors(path / meta["weights"], engine.spec), partial=False
            )
            engine._weights_written()
            engine.warmup()
            return engine
        with safe_open(str(path / meta["weights"]), framework="pt", device="cpu") as handle, torch.no_grad():
            names = set(handle.keys())
            expected = set(engine.weights.buffers)
            if names != expected:
                raise ValueError(
                    f"{path / meta['weights']}: tensors {sorted(names ^ expected)} missing or unexpected"
                )
            for name in names:
                src = handle.get_tensor(name)
                dst = engine.weights.buffers[name]
                if tuple(src.shape) != tuple(dst.shape):
                    raise ValueError(f"{name}: saved shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
                dst.copy_(src)
        engine._weights_written()
        engine.warmup()
        return engine

    @property
    def tokenizer_dir(self) -> Path | None:
        """Where this engine's tokenizer files are (a saved engine carries a copy in tokenizer/)."""
        return self.tokenizer_source


# Noise values per NoiseWindows window (4 MiB of fp32; the hash holds two int32 buffers as large while it
# runs).
NOISE_WINDOW_ELEMENTS = 1 << 20


class NoiseWindows:
    """The chunked sampler's Gumbel noise for a generate call's steps,
    computed a window of steps at a time."""

    def __init__(self, seeds: torch.Tensor, steps: int, vocab_size: int):
        self.k1, self.k2 = rng.row_keys_per_step(seeds, steps)
        self.vocab_size = vocab_size
        self.width = max(1, NOISE_WINDOW_ELEMENTS // max(1, seeds.shape[0] * vocab_size))
        self.start, self.window = 0, None

    def at(self, step: int) -> torch.Tensor:
        """[B, V] fp32: rng.gumbel_noise(*rng.row_keys(seeds, step), V)."""
        if self.window is None or not self.start <= step < self.start + self.window.shape[1]:
            self.start = step
            self.window = gumbel_noise_steps(self.k1, self.k2[:, step : step + self.width], self.vocab_size)
        return self.window[:, step - self.start]


# What each fused op of the GPU decode step replaces, as execution_paths names it.
_FUSED_OP_WORDS = {
    "rope_cache_write": "RoPE + cache write",
    "live_attention": "attention over the live length",
    "add_rms_norm": "add + RMSNorm",
    "silu_mul": "SiLU x up",
}


def fused_ops_path(fused_ops: list[str]) -> str:
    """The decode-step path's suffix under engine.gpu_decode_kernels: triton, naming the ops that run as
    Triton kernels and those that run as their torch references (engine.gpu_fused_ops)."""
    fused = [_FUSED_OP_WORDS[op] for op in _FUSED_OP_WORDS if op in fused_ops]
    kept = [_FUSED_OP_WORDS[op] for op in _FUSED_OP_WORDS if op not in fused_ops]
    text = f", fused Triton ops ({', '.join(fused) or 'none'}: kernels/decode_step.py)"
    return text + (f", torch references for {', '.join(kept)}" if kept else "")


def _json_roundtrip(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _finish_reason(last: int, eos: set[int], stops: list[int]) -> FinishReason:
    """Why a sequence ended, from its last token (EOS wins when a token is both)."""
    if last in eos:
        return "eos"
    if last in stops:
        return "stop"
    return "length"


def _merge(parts: list[Generation]) -> Generation:
    if len(parts) == 1:
        return parts[0]
    metrics: dict[str, float] = {}
    for key in ("timing/prefill_s", "timing/generate_s", "perf/decode_steps", "perf/generated_tokens"):
        metrics[key] = sum(p.metrics.get(key, 0.0) for p in parts)
    metrics["perf/gen_tokens_per_s"] = metrics["perf/generated_tokens"] / max(
        metrics["timing/generate_s"], 1e-9
    )
    return Generation.concatenated(parts, metrics)
