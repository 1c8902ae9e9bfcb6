"""The stage contract: the spec a stage reads and the StageResult it prints as its last line.

The spec and the result are the only interface between the orchestration layer and a stage,
whether the stage runs as a local process, in a container, or as its own Prefect deployment.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from alignflow.config import StorageConfig
from alignflow.manifest import Manifest

REUSED_MESSAGE = "output already published with a matching manifest; reused"
# Environment variables with wall-clock times (time.time()) that let a stage say where its start-up went:
# when the flow launched the stage process, and when `alignflow run` started.
LAUNCHED_AT_VAR = "ALIGNFLOW_LAUNCHED_AT"
RUN_STARTED_AT_VAR = "ALIGNFLOW_RUN_STARTED_AT"

# The module that runs each stage, in pipeline order: `python -m <module> --spec SPEC`, or
# `python -m alignflow.stages <stage> --spec SPEC` by the stage's name. A stage's name is what configs, output
# paths and MLflow say; its module is named for what it is ("base" is the base-model stage).
STAGE_PROGRAMS = {"data": "alignflow.stages.data.stage", "base": "alignflow.stages.base_model",
                  "sft": "alignflow.stages.sft", "reward": "alignflow.stages.reward",
                  "engine": "alignflow.stages.engine", "ppo": "alignflow.stages.ppo.stage",
                  "dpo": "alignflow.stages.dpo.stage", "evaluate": "alignflow.stages.evaluate"}


def stage_program(stage: str) -> str:
    """The module whose `main(argv)` runs `stage`; a ValueError naming the stages for an unknown one."""
    try:
        return STAGE_PROGRAMS[stage]
    except KeyError:
        raise ValueError(f"unknown stage '{stage}'; stages: {', '.join(STAGE_PROGRAMS)}") from None


class TrackingUnavailableError(RuntimeError):
    """The MLflow server stayed unreachable past alignflow.tracking's outage limit. A stage reports it in one
    line and exits 1 (transient: the flow retries; an RL stage resumes from its last checkpoint)."""


class TrackingAccessError(RuntimeError):
    """The MLflow server refused the client's credentials (HTTP 401) or their rights (403). A setup error, not
    a passing fault: a stage reports it in one line and exits 2 (a retry would be refused the same way)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


class TrackingSpec(BaseModel):
    """Where a stage logs: the MLflow server/DB, experiment, and the pipeline's parent run."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    uri: str
    experiment: str
    parent_run_id: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)


class StageSpec(BaseModel):
    """Everything one stage run needs; written as JSON and passed by path or URI."""

    model_config = ConfigDict(extra="forbid")

    stage: str
    config: dict[str, Any] = Field(description="The stage's resolved config section(s).")
    inputs: dict[str, str] = Field(default_factory=dict, description="Input name -> published output URI.")
    input_digests: dict[str, str] = Field(default_factory=dict, description="Input name -> manifest digest.")
    output_uri: str
    storage: StorageConfig = Field(default_factory=StorageConfig)
    tracking: TrackingSpec | None = None
    code_version: str = "unknown"
    workdir: str = "."

    def dump(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.model_dump_json(indent=2))
        return path


class StageResult(BaseModel):
    """What a stage reports; printed as one JSON line, the last line of its output."""

    model_config = ConfigDict(extra="forbid")

    stage: str
    status: Literal["ok", "skipped", "failed"]
    output_uri: str | None = None
    manifest_digest: str | None = None
    metrics: dict[str, float] = Field(
        default_factory=dict, description="Key metrics (a few, not every step)."
    )
    key_metric: str | None = Field(None, description="Name of the metric that summarises the stage.")
    mlflow_run_id: str | None = None
    duration_s: float = 0.0
    message: str = ""
    devices: dict[str, str] = Field(
        default_factory=dict,
        description="Where the stage computed, by role (train, reference, score, generate, "
        "...): the device of the models themselves, e.g. 'cuda:0' or 'cpu'.",
    )

    @classmethod
    def from_manifest(
        cls, manifest: Manifest, status: Literal["ok", "skipped"], **fields: Any
    ) -> StageResult:
        """The result of a stage whose output `manifest` is published (its summary holds the key metrics)."""
        return cls(
            stage=manifest.stage,
            status=status,
            output_uri=manifest.uri,
            manifest_digest=manifest.digest,
            metrics={k: float(v) for k, v in manifest.summary.get("metrics", {}).items()},
            key_metric=manifest.summary.get("key_metric"),
            devices=dict(manifest.summary.get("devices", {})),
            **fields,
        )

    def to_line(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_output(cls, output: str) -> StageResult:
        """The StageResult in a stage's output: its last line that parses as one.

        Scanning from the end tolerates lines that libraries print at interpreter exit after ours.
        """
        lines = [ln.strip() for ln in output.strip().splitlines() if ln.strip()]
        if not lines:
            raise ValueError("stage printed nothing; expected a StageResult JSON line last")
        for line in reversed(lines[-50:]):
            if line.startswith("{"):
                try:
                    return cls.model_validate(json.loads(line))
                except ValueError:
                    continue
        raise ValueError(
            f"no StageResult JSON line at the end of the stage output (last line: {lines[-1][:200]!r})"
        )
