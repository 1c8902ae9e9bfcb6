"""One clean run of every stage on the small test config: the reference the kill and disk-full tests compare
with, and the specs they re-run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alignflow.contract import StageSpec
from tests.conftest import small_config

PPO_SMALL = {"iterations": 4, "prompts_per_iteration": 8, "minibatch_size": 8, "max_new_tokens": 16,
             "checkpoint_every": 2}
STAGES = ["data", "base", "sft", "reward-rm", "engine", "ppo", "evaluate"]


def clean_pipeline(workdir: Path) -> tuple[Path, dict[str, dict[str, Any]], dict[str, StageSpec]]:
    """(workdir, result rows by stage key, the spec each stage ran with) of a pipeline run without faults."""
    from alignflow.flows.pipeline import alignflow_pipeline

    config = small_config(workdir, stages=["data", "base", "sft", "reward", "engine", "ppo", "evaluate"],
                          engine={"max_seq_len": 96, "max_batch_size": 32}, ppo=PPO_SMALL,
                          evaluate={"n_prompts": 8, "max_new_tokens": 16}, registry={"enabled": False})
    rows = {row["key"]: row for row in alignflow_pipeline(config)}
    assert {rows[k]["status"] for k in STAGES} == {"ok"}, rows
    specs = {}
    for key in STAGES:  # the flow keeps the spec of every stage it launched
        digest = rows[key]["output_uri"].rsplit("/", 1)[1]
        specs[key] = StageSpec.model_validate_json(
            (workdir / ".alignflow" / "specs" / f"{key}-{digest}.json").read_text())
    return workdir, rows, specs
