"""Model registry after a pipeline run: register policy and reward models as 'candidate', gate 'champion'.

The policy is the output of whichever stage trained it, `ppo` (PPO/GRPO) or `dpo`: both keep the
checkpoint in `<output>/policy`. The gate is a pure function of numbers measured in one evaluation
run: the candidate policy and the current champion are scored on the same held-out prompts, seeds
and reward models, so their scores are comparable. It compares the reward-model score when the
evaluation had reward models, else the gold score (the demo task's hidden scorer), else it cannot
gate and does not promote. The decision, its numbers and the score it used are recorded on the
model version, on the pipeline's parent MLflow run, and as a Prefect artifact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from alignflow import tracking
from alignflow.config import POLICY_STAGES, PipelineConfig
from alignflow.manifest import find_published
from alignflow.storage import join_uri


@dataclass(frozen=True)
class GateScore:
    """A held-out score the gate can compare, and the evaluate stage's metric names for each policy."""

    name: str  # in the decision record
    words: str  # in the reason
    candidate: str
    sft: str
    champion: str


# In order of preference: the reward-model score PPO optimised (as the gate always did), else the gold score.
GATE_SCORES: tuple[GateScore, ...] = (
    GateScore("reward-model score", "held-out reward", "eval/policy_rm_score", "eval/sft_rm_score",
              "eval/champion_rm_score"),
    GateScore("gold score", "held-out gold score", "eval/policy_gold_score", "eval/sft_gold_score",
              "eval/champion_gold_score"),
)
NO_SCORE_REASON = "no held-out score to gate on (no reward model, no gold scorer)"


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reason: str
    score: str | None  # the score compared: a GateScore name, or None when there was none
    candidate_score: float | None
    baseline_score: float | None
    baseline: str  # "champion vN" or "sft"
    kl_to_ref: float
    kl_budget: float


def decide(metrics: dict[str, float], kl_budget: float, min_improvement: float,
           champion_version: str | None) -> GateDecision:
    """Promote when the candidate's held-out score beats the champion's (or, with no champion yet, the SFT
    policy's) by at least `min_improvement` and the KL to the reference stays within the budget.

    The score is the first of `GATE_SCORES` the evaluation measured: the reward-model score, else the gold
    score; with neither, nothing is promoted.
    """
    kl = metrics["eval/kl_to_ref"]
    score = next((s for s in GATE_SCORES if s.candidate in metrics), None)
    if score is None:
        return GateDecision(False, NO_SCORE_REASON, None, None, None, "sft", kl, kl_budget)
    candidate = metrics[score.candidate]
    if champion_version is not None and score.champion in metrics:
        baseline, name = metrics[score.champion], f"champion v{champion_version}"
    else:
        baseline, name = metrics[score.sft], "sft"
    common = dict(
        score=score.name,
        candidate_score=candidate,
        baseline_score=baseline,
        baseline=name,
        kl_to_ref=kl,
        kl_budget=kl_budget,
    )
    if kl > kl_budget:
        return GateDecision(
            False, f"KL to the reference {kl:.3f} exceeds the budget {kl_budget:.3f}", **common
        )
    if candidate < baseline + min_improvement:
        return GateDecision(
            False,
            f"{score.words} {candidate:.4f} does not beat {name}'s {baseline:.4f} by {min_improvement:g}",
            **common,
        )
    return GateDecision(
        True,
        f"{score.words} {candidate:.4f} beats {name}'s {baseline:.4f} with KL {kl:.3f} <= {kl_budget:.3f}",
        **common,
    )


def policy_row(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The run row of the stage that trained the policy: 'ppo' or 'dpo'
    (a pipeline that evaluates has one)."""
    found = [rows[key] for key in POLICY_STAGES if key in rows]
    if len(found) != 1:
        raise ValueError(
            f"registering a policy needs exactly one of the rows {list(POLICY_STAGES)}; the run has "
            f"{sorted(rows)}"
        )
    return found[0]


def champion_output(config: PipelineConfig, tracking_uri: str) -> tuple[str, str, str] | None:
    """(version, output URI of the stage that trained it, its manifest digest) of the current champion, if
    any.

    The evaluate stage reads the champion's checkpoint from `<output>/policy`, the layout of both policy
    stages.
    """
    version = tracking.alias_version(tracking_uri, config.registry.policy_name, "champion")
    if version is None:
        return None
    uri = version["tags"].get("alignflow.output_uri")
    manifest = find_published(uri, config.storage) if uri else None
    if manifest is None:
        return None
    return version["version"], uri, manifest.digest


def register_and_gate(
    config: PipelineConfig,
    rows: dict[str, dict[str, Any]],
    tracking_uri: str,
    parent_run_id: str | None,
    champion_version: str | None,
) -> dict[str, Any]:
    """Register reward models and the policy as 'candidate'; move 'champion' if the gate passes."""
    registry = config.registry
    data_digest = rows["data"]["manifest_digest"]
    common_tags = {"alignflow.pipeline_run": parent_run_id or "", "alignflow.data_digest": data_digest}
    registered: dict[str, str] = {}
    for key, row in rows.items():
        if row["stage"] == "reward":
            name = f"{registry.reward_prefix}-{key.removeprefix('reward-')}"
            tags = {
                **common_tags,
                "alignflow.output_uri": row["output_uri"],
                "eval.accuracy": row["metrics"].get("eval/accuracy", ""),
            }
            registered[name] = tracking.register_version(
                tracking_uri, name, row["output_uri"], row.get("mlflow_run_id"), tags
            )
    metrics = rows["evaluate"]["metrics"]
    policy = policy_row(rows)
    tags = {
        **common_tags,
        "alignflow.output_uri": policy["output_uri"],
        "alignflow.policy_stage": policy["stage"],
        **{k.replace("/", "."): v for k, v in metrics.items()},
    }
    version = tracking.register_version(
        tracking_uri,
        registry.policy_name,
        join_uri(policy["output_uri"], "policy"),
        policy.get("mlflow_run_id"),
        tags,
    )
    registered[registry.policy_name] = version
    decision = decide(metrics, config.evaluate.kl_budget, registry.min_improvement, champion_version)
    promoted = decision.promote and registry.promote
    if promoted:
        tracking.set_alias(tracking_uri, registry.policy_name, "champion", version)
    verdict = "promoted" if promoted else ("gate passed, promotion off" if decision.promote else "rejected")
    record = {
        "alignflow.promotion": verdict,
        "alignflow.promotion_reason": decision.reason,
        "alignflow.promotion_score": decision.score or "none",
    }
    tracking.tag_version(tracking_uri, registry.policy_name, version, record)
    if parent_run_id:
        for key, value in record.items():
            tracking.run_tag(tracking_uri, parent_run_id, key, value)
    return {
        "registered": registered,
        "policy_version": version,
        "promoted": promoted,
        "verdict": verdict,
        **asdict(decision),
    }


def decision_markdown(result: dict[str, Any], policy_name: str) -> str:
    """The promotion decision as Markdown (the Prefect artifact): verdict, reason,
    and the numbers compared."""

    def number(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    return "\n".join(
        [
            f"## Promotion of `{policy_name}` v{result['policy_version']}: **{result['verdict']}**",
            "",
            result["reason"] + ".",
            "",
            f"| | held-out {result['score'] or 'score'} | KL to reference |",
            "|---|---:|---:|",
            f"| candidate v{result['policy_version']} | {number(result['candidate_score'])} | "
            f"{result['kl_to_ref']:.3f} |",
            f"| {result['baseline']} | {number(result['baseline_score'])} | (budget "
            f"{result['kl_budget']:.3f}) |",
            "",
        ]
    )
