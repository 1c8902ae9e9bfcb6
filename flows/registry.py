"""Model registry after a pipeline run: register policy and reward models as 'candidate', gate 'champion'.

The gate is a pure function of numbers measured in one evaluation run: the candidate policy and
the current champion are scored on the same held-out prompts, seeds and reward models, so their
rewards are comparable. The decision and its numbers are recorded on the model version, on the
pipeline's parent MLflow run, and as a Prefect artifact.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from alignflow import tracking
from alignflow.config import PipelineConfig
from alignflow.manifest import find_published
from alignflow.storage import join_uri


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reason: str
    candidate_reward: float
    baseline_reward: float
    baseline: str  # "champion vN" or "sft"
    kl_to_ref: float
    kl_budget: float


def decide(metrics: dict[str, float], kl_budget: float, min_improvement: float,
           champion_version: str | None) -> GateDecision:
    """Promote when held-out reward beats the champion's (or, with no champion yet, the SFT policy's)
    by at least `min_improvement` and the KL to the reference stays within the budget."""
    candidate = metrics["eval/policy_rm_score"]
    kl = metrics["eval/kl_to_ref"]
    if champion_version is not None and "eval/champion_rm_score" in metrics:
        baseline, name = metrics["eval/champion_rm_score"], f"champion v{champion_version}"
    else:
        baseline, name = metrics["eval/sft_rm_score"], "sft"
    common = dict(candidate_reward=candidate, baseline_reward=baseline, baseline=name, kl_to_ref=kl,
                  kl_budget=kl_budget)
    if kl > kl_budget:
        return GateDecision(False, f"KL to the reference {kl:.3f} exceeds the budget {kl_budget:.3f}", **common)
    if candidate < baseline + min_improvement:
        return GateDecision(False, f"held-out reward {candidate:.4f} does not beat {name}'s {baseline:.4f}"
                                   f" by {min_improvement:g}", **common)
    return GateDecision(True, f"held-out reward {candidate:.4f} beats {name}'s {baseline:.4f} "
                              f"with KL {kl:.3f} <= {kl_budget:.3f}", **common)


def champion_output(config: PipelineConfig, tracking_uri: str) -> tuple[str, str, str] | None:
    """(version, RL output URI, its manifest digest) of the current champion, when there is one."""
    version = tracking.alias_version(tracking_uri, config.registry.policy_name, "champion")
    if version is None:
        return None
    uri = version["tags"].get("alignflow.output_uri")
    manifest = find_published(uri, config.storage) if uri else None
    if manifest is None:
        return None
    return version["version"], uri, manifest.digest


def register_and_gate(config: PipelineConfig, rows: dict[str, dict[str, Any]], tracking_uri: str,
                      parent_run_id: str | None, champion_version: str | None) -> dict[str, Any]:
    """Register reward models and the policy as 'candidate'; move 'champion' if the gate passes."""
    registry = config.registry
    data_digest = rows["data"]["manifest_digest"]
    common_tags = {"alignflow.pipeline_run": parent_run_id or "", "alignflow.data_digest": data_digest}
    registered: dict[str, str] = {}
    for key, row in rows.items():
        if row["stage"] == "reward":
            name = f"{registry.reward_prefix}-{key.removeprefix('reward-')}"
            tags = {**common_tags, "alignflow.output_uri": row["output_uri"],
                    "eval.accuracy": row["metrics"].get("eval/accuracy", "")}
            registered[name] = tracking.register_version(tracking_uri, name, row["output_uri"],
                                                         row.get("mlflow_run_id"), tags)
    metrics = rows["evaluate"]["metrics"]
    ppo = rows["ppo"]
    tags = {**common_tags, "alignflow.output_uri": ppo["output_uri"],
            **{k.replace("/", "."): v for k, v in metrics.items()}}
    version = tracking.register_version(tracking_uri, registry.policy_name, join_uri(ppo["output_uri"], "policy"),
                                        ppo.get("mlflow_run_id"), tags)
    registered[registry.policy_name] = version
    decision = decide(metrics, config.evaluate.kl_budget, registry.min_improvement, champion_version)
    promoted = decision.promote and registry.promote
    if promoted:
        tracking.set_alias(tracking_uri, registry.policy_name, "champion", version)
    verdict = "promoted" if promoted else ("gate passed, promotion off" if decision.promote else "rejected")
    record = {"alignflow.promotion": verdict, "alignflow.promotion_reason": decision.reason}
    tracking.tag_version(tracking_uri, registry.policy_name, version, record)
    if parent_run_id:
        for key, value in record.items():
            tracking.run_tag(tracking_uri, parent_run_id, key, value)
    return {"registered": registered, "policy_version": version, "promoted": promoted, "verdict": verdict,
            **asdict(decision)}


def decision_markdown(result: dict[str, Any], policy_name: str) -> str:
    return "\n".join([
        f"## Promotion of `{policy_name}` v{result['policy_version']}: **{result['verdict']}**", "",
        result["reason"] + ".", "",
        "| | held-out reward | KL to reference |", "|---|---:|---:|",
        f"| candidate v{result['policy_version']} | {result['candidate_reward']:.4f} | {result['kl_to_ref']:.3f} |",
        f"| {result['baseline']} | {result['baseline_reward']:.4f} | (budget {result['kl_budget']:.3f}) |", ""])
