"""The checks a stage makes when it starts, as functions of its config sections: one copy, two callers.

The stages call them first thing and raise StageInputError with the problem's message; `alignflow validate`
and `alignflow plan` call them for every stage call a config makes (flows/plan.py's `start_problems`), so a
config that cannot start fails before anything runs, with the message the stage itself would print.

Two kinds of check:
- Config checks (`stage_problems`): a function of the stage's spec config and input names, nothing else;
  they pass or fail the same in the planner as in the stage.
- Machine checks (`machine_checks`): what the stage needs of the machine it runs on (the vllm or
  tensorrt_llm package in the interpreter that holds the engine, an NVIDIA GPU). The planner does not know
  that machine (in production a stage runs in its image on a GPU node), so each check says what it needs and
  what this machine shows; the CLI prints an unmet one as a note, or as a problem with `--here` (the stages
  run on this machine, as `alignflow run` runs them). Torch-free: GPUs are counted from the driver, packages
  found with importlib.util.find_spec (importing vllm would take many seconds), and engine.worker_python is
  only started (one find_spec probe) when asked.

What it is not: the data files' checks (stages/data/preflight.py), or checks that need the model's weights
or architecture (LoRA target modules, tensor-parallel head splits), which the stages make when they load them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from alignflow.config import (
    POLICY_STAGES,
    ROLLOUT_SECRET_MIN_CHARS,
    ROLLOUT_SECRET_VAR,
    DPOConfig,
    EngineConfig,
    EvaluateConfig,
    LoRAConfig,
    ModelConfig,
    PPOConfig,
    RewardConfig,
    SFTConfig,
)


@dataclass(frozen=True)
class StartProblem:
    """Why a stage would refuse to start:
    the dotted config key to change and the stage's own one-line message."""

    key: str
    message: str


# ----------------------------------------------------------------------------------------------
# Config checks, one function per check (the stages call these), then one per stage
# ----------------------------------------------------------------------------------------------


def batch_split(cfg: SFTConfig | RewardConfig | DPOConfig, section: str) -> StartProblem | None:
    """Whole micro-batches on every rank per optimizer step (sft, reward, dpo)."""
    world = cfg.resources.world_size
    if cfg.batch_size % (cfg.micro_batch_size * world) == 0:
        return None
    ranks = f" x the {world} ranks of {section}.resources (nproc_per_node x nnodes)" if world > 1 else ""
    return StartProblem(
        f"{section}.batch_size",
        f"{section}.batch_size={cfg.batch_size} must be a multiple of "
        f"{section}.micro_batch_size={cfg.micro_batch_size}{ranks}",
    )


def lora_zero_stage(lora: LoRAConfig, zero_stage: int, section: str) -> StartProblem | None:
    """LoRA under ZeRO-3 is refused: merging the adapters needs each whole weight on one rank."""
    if not (lora.enabled and zero_stage == 3):
        return None
    return StartProblem(
        f"{section}.lora",
        f"{section}.lora with {section}.zero_stage 3: merging the adapters needs "
        "whole weights; use zero_stage 2 (LoRA's optimizer state is small anyway)",
    )


def train_backend(setting: str, zero_stage: int, world: int) -> StartProblem | None:
    """ppo.train_backend 'torch' is plain torch AdamW in one process: no ZeRO, one rank."""
    if setting != "torch" or (zero_stage == 0 and world == 1):
        return None
    return StartProblem(
        "ppo.train_backend",
        f"ppo.train_backend 'torch' trains one rank without ZeRO (zero_stage "
        f"{zero_stage}, WORLD_SIZE {world}); use 'deepspeed' or 'auto'",
    )


def response_room(max_new_tokens: int, key: str, engine: EngineConfig) -> StartProblem | None:
    """A generated response must leave the engine's cache room for at least one prompt token."""
    if max_new_tokens < engine.max_seq_len:
        return None
    return StartProblem(
        key,
        f"{key}={max_new_tokens} leaves no room for a prompt in engine.max_seq_len="
        f"{engine.max_seq_len} (prompt + response tokens); lower {key} or raise "
        "engine.max_seq_len",
    )


def supervised_stage(cfg: SFTConfig | RewardConfig | DPOConfig, section: str) -> list[StartProblem]:
    """What a supervised stage's section (sft, reward, dpo) must satisfy before anything loads."""
    return [p for p in (batch_split(cfg, section), lora_zero_stage(cfg.lora, cfg.zero_stage, section)) if p]


def rl_stage(cfg: PPOConfig, engine: EngineConfig, reward_inputs: Iterable[str]) -> list[StartProblem]:
    """What the RL stage checks before it loads anything, in the order it reports them (it raises the first);
    reward_inputs: the names of its reward-model inputs (reward_<name>)."""
    has_rewards = bool(list(reward_inputs))
    problems: list[StartProblem | None] = []
    if not has_rewards and not cfg.reward_functions:
        problems.append(
            StartProblem(
                "ppo.reward_functions",
                "ppo needs at least one reward model input (reward_<name>) or ppo.reward_functions",
            )
        )
    if cfg.algorithm == "ppo" and not has_rewards:
        problems.append(
            StartProblem(
                "ppo.algorithm",
                "ppo.algorithm 'ppo' initialises its critic from a reward model: add one, or use grpo",
            )
        )
    problems.append(lora_zero_stage(cfg.lora, cfg.zero_stage, "ppo"))
    tp, workers = engine.tensor_parallel_size, engine.rollout_workers
    if tp > 1 and workers == 0:
        problems.append(
            StartProblem(
                "engine.rollout_workers",
                f"engine.tensor_parallel_size={tp} with "
                "engine.rollout_workers=0: tensor-parallel engines run in rollout workers; set "
                "engine.rollout_workers >= 1 (replicas of tensor_parallel_size processes each)",
            )
        )
    if engine.backend == "vllm" and workers == 0:
        # The trainer never imports vLLM: its CPU build makes torch.set_num_threads a no-op process-wide and
        # it keeps its parallel groups in module globals, next to DeepSpeed's.
        problems.append(
            StartProblem(
                "engine.rollout_workers",
                "engine.backend: vllm with engine.rollout_workers=0: "
                "the vLLM engine runs in rollout worker processes, never in the trainer's; set "
                "engine.rollout_workers >= 1",
            )
        )
    if engine.unload_during_training and cfg.async_rollouts:
        problems.append(
            StartProblem(
                "engine.unload_during_training",
                "engine.unload_during_training with "
                "ppo.async_rollouts: the engine is generating the next rollout while the "
                "trainer trains, so there is nothing to unload; turn one off",
            )
        )
    if tp > 1 and workers >= 1 and engine.backend != "native":
        # The rollout workers split a saved engine into tensor-parallel shards; only the native engine's
        # layout is cut that way (stages/ppo/rollout_workers.py refuses the others when it reads the saved
        # engine).
        problems.append(
            StartProblem(
                "engine.tensor_parallel_size",
                f"engine.tensor_parallel_size={tp} with rollout "
                f"workers needs engine.backend: native (engine.backend is {engine.backend!r}); "
                "set engine.tensor_parallel_size: 1",
            )
        )
    problems.append(train_backend(cfg.train_backend, cfg.zero_stage, cfg.resources.world_size))
    problems.append(response_room(cfg.max_new_tokens, "ppo.max_new_tokens", engine))
    return [p for p in problems if p]


def engine_stage(engine: EngineConfig) -> list[StartProblem]:
    """The engine stage builds one whole engine in one process."""
    if engine.tensor_parallel_size == 1:
        return []
    # The engine stage saves the whole engine; the RL stage's rollout workers split it when they load it (each
    # rank keeps its shard), and the flow gives a native build tensor_parallel_size 1 (flows/plan.py).
    return [
        StartProblem(
            "engine.tensor_parallel_size",
            f"engine.tensor_parallel_size={engine.tensor_parallel_size}: "
            "the engine stage builds a one-process engine; tensor-parallel replicas run in the RL stage's "
            "rollout workers (engine.backend: native, engine.rollout_workers >= 1): set "
            "engine.tensor_parallel_size: 1 in this stage's spec",
        )
    ]


def policy_input(inputs: Iterable[str]) -> StartProblem | None:
    """The evaluate stage compares exactly one policy input ('ppo' or 'dpo') with the SFT policy."""
    names = sorted(inputs)
    given = [name for name in POLICY_STAGES if name in names]
    if not given:
        return StartProblem(
            "stages",
            "stage 'evaluate' needs a policy input: 'ppo' (an RL stage output) or 'dpo' (a "
            f"DPO stage output); spec inputs: {names or 'none'}",
        )
    if len(given) > 1:
        return StartProblem(
            "stages", f"stage 'evaluate' evaluates one policy, but the spec has inputs {given}: pass one"
        )
    return None


def evaluate_stage(cfg: EvaluateConfig, engine: EngineConfig, inputs: Iterable[str]) -> list[StartProblem]:
    """What the evaluate stage checks before it loads anything."""
    return [
        p
        for p in (policy_input(inputs), response_room(cfg.max_new_tokens, "evaluate.max_new_tokens", engine))
        if p
    ]


def base_model_dir(
    base: str | None, workdir: str | os.PathLike, allow_pickle: bool = False
) -> StartProblem | None:
    """A local model.base (a path or file:// URI, relative to the workdir) must be a folder, and one whose
    weights are pickle files needs model.allow_pickle; s3:// ones are resolved against the object store by
    the base stage, which checks them the same way."""
    if not base or ("://" in base and not base.startswith("file://")):
        return None
    path = Path(base.removeprefix("file://"))
    if not path.is_absolute():
        path = Path(workdir) / path
    if not path.is_dir():
        return StartProblem(
            "model.base",
            f"model.base '{base}': no such directory; give a Hugging Face model folder "
            "or leave model.base empty for the tiny demo model",
        )
    from alignflow.stages.common.models.loading import ALLOW_PICKLE_SETTING, pickle_refusal  # torch-free

    refusal = pickle_refusal(path, allow_pickle)
    return None if refusal is None else StartProblem(ALLOW_PICKLE_SETTING, f"model.base: {refusal}")


def stage_problems(
    stage: str,
    config: Mapping[str, Any],
    inputs: Iterable[str] = (),
    workdir: str | os.PathLike | None = None,
) -> list[StartProblem]:
    """Every config problem the stage `stage` would refuse to start with, given its spec's config sections and
    input names (workdir: where the stage runs, for local model.base paths; None skips that check)."""

    def part(model: type, key: str) -> Any:
        return model.model_validate(config.get(key) or {})

    inputs = list(inputs)
    if stage in ("sft", "reward", "dpo"):
        model = {"sft": SFTConfig, "reward": RewardConfig, "dpo": DPOConfig}[stage]
        return supervised_stage(part(model, stage), stage)
    if stage == "ppo":
        return rl_stage(
            part(PPOConfig, "ppo"),
            part(EngineConfig, "engine"),
            [name for name in inputs if name.startswith("reward_")],
        )
    if stage == "engine":
        return engine_stage(part(EngineConfig, "engine"))
    if stage == "evaluate":
        return evaluate_stage(part(EvaluateConfig, "evaluate"), part(EngineConfig, "engine"), inputs)
    if stage == "base" and workdir is not None:
        model = part(ModelConfig, "model")
        problem = base_model_dir(model.base, workdir, model.allow_pickle)
        return [problem] if problem else []
    return []


# ----------------------------------------------------------------------------------------------
# Machine checks: what a stage needs of the machine it runs on
# ----------------------------------------------------------------------------------------------

# The stages that compute on model.device (data and base only read and write files).
DEVICE_STAGES = ("sft", "reward", "engine", "ppo", "dpo", "evaluate")
# The stages that hold an engine of engine.backend, and the package each backend needs there.
ENGINE_STAGES = ("engine", "ppo", "evaluate")
BACKEND_PACKAGES = {"vllm": "vllm", "tensorrt-llm": "tensorrt_llm"}
BACKEND_IMAGES = {
    "vllm": "the alignflow-engine-vllm image (containers/engine-vllm.Dockerfile)",
    "tensorrt-llm": "the alignflow-engine-tensorrt-llm image (containers/engine-tensorrt-llm.Dockerfile)",
}
PROBE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class MachineCheck:
    """What a stage needs of the machine it runs on (`need`), `unmet`: why this machine falls short (None: it
    does not), and `fix`: what to do about it."""

    key: str
    need: str
    unmet: str | None
    fix: str = ""

    @property
    def message(self) -> str:
        return f"{self.need}: {self.unmet}" + (f"; {self.fix}" if self.fix else "")


def visible_gpus() -> int:
    """NVIDIA GPUs this machine shows, without torch: the driver's /proc entries (or `nvidia-smi -L`),
    narrowed by CUDA_VISIBLE_DEVICES. It is what torch would see given a CUDA build of torch."""
    found = 0
    gpus = Path("/proc/driver/nvidia/gpus")
    if gpus.is_dir():
        found = sum(1 for _ in gpus.iterdir())
    else:
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
            found = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
        except (OSError, subprocess.SubprocessError):
            found = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        chosen = [d for d in visible.split(",") if d.strip()]
        chosen = chosen[: next((i for i, d in enumerate(chosen) if d.strip() == "-1"), len(chosen))]
        found = min(found, len(chosen))
    return found


def find_package(module: str, python: str | None = None, probe: bool = False) -> str | None:
    """None when `module` is importable by `python` (None: this interpreter), else why not. Another
    interpreter is only started with probe=True; without it the answer is 'not probed'."""
    if python is None:
        return (
            None
            if importlib.util.find_spec(module) is not None
            else (f"not importable by this interpreter ({sys.executable})")
        )
    path = Path(os.path.expanduser(python))
    if not (path.is_file() and os.access(path, os.X_OK)):
        return f"engine.worker_python={python}: no executable there"
    if not probe:
        return f"engine.worker_python={python} not probed (alignflow validate --here starts it to look)"
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
    try:
        done = subprocess.run(
            [str(path), "-c", code, module],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            env={**os.environ, "PYTHONNOUSERSITE": "1"},
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"engine.worker_python={python} did not answer a probe ({type(exc).__name__}: {exc})"
    return None if done.returncode == 0 else f"not importable by engine.worker_python={python}"


def machine_checks(
    stage: str, config: Mapping[str, Any], probe: bool = False, gpus: int | None = None
) -> list[MachineCheck]:
    """What `stage` needs of the machine it runs on, each with what this machine shows (gpus: the GPU count to
    assume, None: count this machine's; probe: start engine.worker_python to look for the backend's
    package)."""
    checks: list[MachineCheck] = []
    model = ModelConfig.model_validate(config.get("model") or {})
    count = visible_gpus() if gpus is None else gpus
    if stage in DEVICE_STAGES and model.device == "cuda":
        checks.append(
            MachineCheck(
                "model.device",
                "model.device: cuda needs an NVIDIA GPU",
                None if count else "this machine shows none",
                "run the stage on a GPU node or set model.device: cpu",
            )
        )
        section = config.get(stage) or {}
        ranks = (
            int((section.get("resources") or {}).get("nproc_per_node", 1)) if isinstance(section, dict) else 1
        )
        if count and ranks > count:
            checks.append(
                MachineCheck(
                    f"{stage}.resources.nproc_per_node",
                    f"{stage}.resources.nproc_per_node={ranks} ranks on model.device cuda need {ranks} GPUs",
                    f"this machine shows {count}",
                    "one rank per GPU",
                )
            )
    if stage in ENGINE_STAGES and "engine" in config:
        engine = EngineConfig.model_validate(config["engine"])
        package = BACKEND_PACKAGES.get(engine.backend)
        if package is not None:
            holder = "engine.worker_python" if engine.worker_python else "the stage's interpreter"
            checks.append(
                MachineCheck(
                    "engine.backend",
                    f"engine.backend: {engine.backend} needs the {package} package in {holder}",
                    find_package(package, engine.worker_python, probe),
                    f"run the stage in {BACKEND_IMAGES[engine.backend]}, or set engine.worker_python to a "
                    "venv with it",
                )
            )
        if stage == "ppo" and engine.rollout_nodes:
            has_secret = len(os.environ.get(ROLLOUT_SECRET_VAR, "")) >= ROLLOUT_SECRET_MIN_CHARS
            checks.append(
                MachineCheck(
                    "engine.rollout_nodes",
                    f"engine.rollout_nodes={engine.rollout_nodes} needs the rollout queues' shared secret in "
                    f"{ROLLOUT_SECRET_VAR} ({ROLLOUT_SECRET_MIN_CHARS}+ characters), on the trainer and "
                    "every rollout node",
                    None if has_secret else "this machine's environment has none",
                    f"set it, and start each rollout node with `python -m alignflow.stages ppo --spec SPEC "
                    f"--rollout-node I` (I < {engine.rollout_nodes}): the stage waits for them",
                )
            )
        if engine.backend == "tensorrt-llm":
            checks.append(
                MachineCheck(
                    "engine.backend",
                    "engine.backend: tensorrt-llm runs on NVIDIA GPUs only",
                    None if count else "this machine shows none",
                    f"run the stage in {BACKEND_IMAGES[engine.backend]} on a GPU node",
                )
            )
    return checks
