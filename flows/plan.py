"""The pipeline's stage graph: which stage runs, with which config section, reading which upstream outputs.

Torch-free and Prefect-free, so it can be tested and printed on its own (`alignflow plan CONFIG`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from alignflow import start_checks
from alignflow.config import RL_ONLY_ENGINE_KEYS, PipelineConfig


@dataclass(frozen=True)
class StageCall:
    """One stage run of a pipeline: `key` is unique in the run (e.g. 'reward-rm2'), `stage` is the program."""

    key: str
    stage: str
    config: dict[str, Any]
    inputs: dict[str, str] = field(default_factory=dict)  # input name -> key of the upstream StageCall
    key_metric: str = ""

    def identity(self) -> dict[str, Any]:
        """The part of the config the output's key is made of: all of it, except where the RL stage runs (its
        trainer ranks, `ppo.resources`, and its rollout replicas, RL_ONLY_ENGINE_KEYS and
        `engine.tensor_parallel_size`). Its checkpoints hold nothing cut for a rank count and its rollouts'
        tokens do not depend on the replica that drew them, so a run retried on other machines (a node lost,
        or added) resumes the same output instead of starting another."""
        if self.stage != "ppo":
            return self.config
        placement = (*RL_ONLY_ENGINE_KEYS, "tensor_parallel_size")
        return {
            **self.config,
            "ppo": {k: v for k, v in self.config["ppo"].items() if k != "resources"},
            "engine": {k: v for k, v in self.config["engine"].items() if k not in placement},
        }


def plan(config: PipelineConfig) -> list[StageCall]:
    """The ordered stage calls of `config.stages` (a reward stage per entry of `reward.models`)."""
    dump = config.model_dump(mode="json")
    model = dump["model"]
    calls: list[StageCall] = []
    chosen = set(config.stages)
    if "data" in chosen:
        calls.append(StageCall("data", "data", {"data": dump["data"]}))
    if "base" in chosen:
        calls.append(StageCall("base", "base", {"model": model}, {"data": "data"}))
    if "sft" in chosen:
        calls.append(
            StageCall("sft", "sft", {"sft": dump["sft"], "model": model}, {"base": "base", "data": "data"})
        )
    reward_keys = []
    if "reward" in chosen:
        shared = {k: v for k, v in dump["reward"].items() if k != "models"}
        for rm in dump["reward"]["models"]:
            key = f"reward-{rm['name']}"
            reward_keys.append(key)
            calls.append(
                StageCall(
                    key,
                    "reward",
                    {"reward": shared, "reward_model": rm, "model": model},
                    {"sft": "sft", "data": "data"},
                )
            )
    # what the build depends on
    built = {k: v for k, v in dump["engine"].items() if k not in RL_ONLY_ENGINE_KEYS}
    if built["backend"] == "native":
        # The native engine is saved whole and split when the RL stage's rollout workers load it (each
        # tensor-parallel rank keeps its shard), so its tensor_parallel_size does not change the build (1
        # there: the same stage key as a one-process run, so a TP run reuses its engine).
        built["tensor_parallel_size"] = 1
    if "engine" in chosen:
        calls.append(
            StageCall("engine", "engine", {"engine": built, "model": model}, {"sft": "sft", "data": "data"})
        )
    rewards = {f"reward_{key.removeprefix('reward-')}": key for key in reward_keys}
    if "ppo" in chosen:
        calls.append(
            StageCall(
                "ppo",
                "ppo",
                {"ppo": dump["ppo"], "model": model, "engine": dump["engine"]},
                {"engine": "engine", "sft": "sft", "data": "data", **rewards},
            )
        )
    if "dpo" in chosen:
        calls.append(
            StageCall("dpo", "dpo", {"dpo": dump["dpo"], "model": model}, {"sft": "sft", "data": "data"})
        )
    if "evaluate" in chosen:
        # The policy input is named after the stage that trained it (the config allows exactly one).
        policy = "ppo" if "ppo" in chosen else "dpo"
        calls.append(
            StageCall(
                "evaluate",
                "evaluate",
                {"evaluate": dump["evaluate"], "model": model, "engine": built},
                {policy: policy, "sft": "sft", "data": "data", **rewards},
            )
        )
    return calls


@dataclass(frozen=True)
class StartFinding:
    """A start check of one stage call: `stage` is the call's key (e.g. 'reward-helpful'), `key` the dotted
    config key, `message` what the stage says. From `start_problems` a refusal; from `machine_findings` an
    unmet need of the machine the stage runs on."""

    stage: str
    key: str
    message: str


def start_problems(config: PipelineConfig) -> list[StartFinding]:
    """Every problem any stage call of `config` would refuse to start with (alignflow/start_checks.py: the
    stages make the same checks, with the same messages, when they start)."""
    workdir = Path(config.workdir).resolve()
    return [
        StartFinding(call.key, problem.key, problem.message)
        for call in plan(config)
        for problem in start_checks.stage_problems(call.stage, call.config, call.inputs, workdir)
    ]


def machine_findings(
    config: PipelineConfig, probe: bool = False, gpus: int | None = None
) -> tuple[list[StartFinding], list[str]]:
    """What the stage calls need of the machine they run on that this machine lacks, and the stages left out
    because they run as their own deployments (deployment.stage_infra: another machine or image).

    probe: start engine.worker_python to look for the backend's package; gpus: the GPU count to assume.
    """
    count = start_checks.visible_gpus() if gpus is None else gpus
    unmet, elsewhere = [], []
    for call in plan(config):
        if call.stage in config.deployment.stage_infra:
            elsewhere.append(call.key)
            continue
        for check in start_checks.machine_checks(call.stage, call.config, probe=probe, gpus=count):
            if check.unmet is not None:
                unmet.append(StartFinding(call.key, check.key, check.message))
    return unmet, elsewhere
