"""The promotion gate, a pure function of one evaluation's metrics, and what register_and_gate records."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from alignflow.flows import registry
from alignflow.flows.registry import NO_SCORE_REASON, decide, decision_markdown, policy_row, register_and_gate
from tests.conftest import small_config

KL_BUDGET = 5.0


def _metrics(
    rm: tuple[float, float] | None = None,
    gold: tuple[float, float] | None = None,
    kl: float = 1.0,
    champion_rm: float | None = None,
    champion_gold: float | None = None,
) -> dict[str, float]:
    """The evaluate stage's metrics: (policy, sft) per score that was measured,
    the champion's when it was scored."""
    metrics = {"eval/kl_to_ref": kl, "eval/policy_length": 5.0, "eval/sft_length": 6.0, "eval/n_prompts": 8.0}
    if rm is not None:
        metrics.update({"eval/policy_rm_score": rm[0], "eval/sft_rm_score": rm[1]})
    if gold is not None:
        metrics.update({"eval/policy_gold_score": gold[0], "eval/sft_gold_score": gold[1]})
    if champion_rm is not None:
        metrics["eval/champion_rm_score"] = champion_rm
    if champion_gold is not None:
        metrics["eval/champion_gold_score"] = champion_gold
    return metrics


# ----------------------------------------------------------------------------------------------
# decide(): one test per branch
# ----------------------------------------------------------------------------------------------


def test_rm_score_beats_sft_and_is_preferred_over_gold():
    # Gold says worse, the reward model says better: the gate uses the reward-model score, as it always did.
    decision = decide(_metrics(rm=(0.6, 0.1), gold=(-1.0, 0.0)), KL_BUDGET, 0.0, None)
    assert decision.promote is True and decision.score == "reward-model score"
    assert (decision.candidate_score, decision.baseline_score, decision.baseline) == (0.6, 0.1, "sft")
    assert decision.reason == "held-out reward 0.6000 beats sft's 0.1000 with KL 1.000 <= 5.000"


def test_rm_score_against_the_champion():
    decision = decide(_metrics(rm=(0.6, 0.1), champion_rm=0.7), KL_BUDGET, 0.0, "3")
    assert decision.promote is False and decision.baseline == "champion v3" and decision.baseline_score == 0.7
    assert decision.reason == "held-out reward 0.6000 does not beat champion v3's 0.7000 by 0"


def test_min_improvement_is_required():
    assert decide(_metrics(rm=(0.6, 0.1)), KL_BUDGET, 0.5, None).promote is True
    assert decide(_metrics(rm=(0.6, 0.1)), KL_BUDGET, 0.51, None).promote is False


def test_kl_over_budget_is_rejected_whatever_the_score():
    decision = decide(_metrics(gold=(1.0, -1.0), kl=6.0), KL_BUDGET, 0.0, None)
    assert decision.promote is False and decision.score == "gold score"
    assert decision.reason == "KL to the reference 6.000 exceeds the budget 5.000"


def test_without_reward_models_the_gate_uses_the_gold_score():
    decision = decide(_metrics(gold=(0.3, -0.2)), KL_BUDGET, 0.0, None)
    assert decision.promote is True and decision.score == "gold score"
    assert (decision.candidate_score, decision.baseline_score, decision.baseline) == (0.3, -0.2, "sft")
    assert decision.reason == "held-out gold score 0.3000 beats sft's -0.2000 with KL 1.000 <= 5.000"
    worse = decide(_metrics(gold=(-0.3, -0.2)), KL_BUDGET, 0.0, None)
    assert worse.promote is False and worse.reason.startswith(
        "held-out gold score -0.3000 does not beat sft's"
    )


def test_gold_score_against_the_champion():
    decision = decide(_metrics(gold=(0.3, -0.2), champion_gold=0.4), KL_BUDGET, 0.0, "2")
    assert decision.promote is False and decision.baseline == "champion v2" and decision.baseline_score == 0.4
    beaten = decide(_metrics(gold=(0.5, -0.2), champion_gold=0.4), KL_BUDGET, 0.0, "2")
    assert beaten.promote is True and beaten.reason.startswith(
        "held-out gold score 0.5000 beats champion v2's 0.4000"
    )


def test_a_champion_not_scored_in_this_evaluation_falls_back_to_sft():
    decision = decide(_metrics(gold=(0.3, -0.2)), KL_BUDGET, 0.0, "2")
    assert decision.baseline == "sft" and decision.baseline_score == -0.2


def test_with_no_score_nothing_is_promoted():
    decision = decide(_metrics(), KL_BUDGET, 0.0, "2")
    assert decision.promote is False and decision.reason == NO_SCORE_REASON
    assert decision.reason == "no held-out score to gate on (no reward model, no gold scorer)"
    assert decision.score is None and decision.candidate_score is None and decision.baseline_score is None


# ----------------------------------------------------------------------------------------------
# The policy row, the record and the Markdown
# ----------------------------------------------------------------------------------------------


def test_policy_row_is_the_ppo_or_the_dpo_row():
    ppo, dpo = {"stage": "ppo"}, {"stage": "dpo"}
    assert policy_row({"sft": {"stage": "sft"}, "ppo": ppo, "evaluate": {}}) is ppo
    assert policy_row({"sft": {"stage": "sft"}, "dpo": dpo, "evaluate": {}}) is dpo
    for rows in ({"sft": {}}, {"ppo": ppo, "dpo": dpo}):
        with pytest.raises(ValueError, match="exactly one"):
            policy_row(rows)


def test_register_and_gate_registers_a_dpo_policy_and_records_the_score(monkeypatch, tmp_path):
    calls: dict[str, list] = {"register": [], "alias": [], "tag": [], "run_tag": []}

    def register_version(uri, name, source, run_id, tags):
        calls["register"].append((name, source, run_id, tags))
        return "4"

    monkeypatch.setattr(registry.tracking, "register_version", register_version)
    monkeypatch.setattr(registry.tracking, "set_alias", lambda *a: calls["alias"].append(a))
    monkeypatch.setattr(registry.tracking, "tag_version", lambda *a: calls["tag"].append(a))
    monkeypatch.setattr(registry.tracking, "run_tag", lambda *a: calls["run_tag"].append(a))
    config = small_config(tmp_path, stages=["data", "base", "sft", "dpo", "evaluate"])
    rows = {
        "data": {"stage": "data", "manifest_digest": "d" * 64},
        "sft": {"stage": "sft", "output_uri": "file:///store/sft"},
        "dpo": {"stage": "dpo", "output_uri": "file:///store/dpo/abc", "mlflow_run_id": "run-dpo"},
        "evaluate": {"stage": "evaluate", "metrics": _metrics(gold=(0.3, -0.2))},
    }
    result = register_and_gate(config, rows, "sqlite:///unused.db", "parent", None)

    ((name, source, run_id, tags),) = calls["register"]  # no reward model to register
    assert (name, source, run_id) == ("alignflow-policy", "file:///store/dpo/abc/policy", "run-dpo")
    assert tags["alignflow.output_uri"] == "file:///store/dpo/abc" and tags["alignflow.policy_stage"] == "dpo"
    assert tags["eval.policy_gold_score"] == 0.3
    assert result["promoted"] is True and result["score"] == "gold score"
    assert calls["alias"] == [("sqlite:///unused.db", "alignflow-policy", "champion", "4")]
    record = calls["tag"][0][3]
    assert record == {
        "alignflow.promotion": "promoted",
        "alignflow.promotion_reason": result["reason"],
        "alignflow.promotion_score": "gold score",
    }
    assert {(key, value) for _, _, key, value in calls["run_tag"]} == set(record.items())


def test_decision_markdown_names_the_score_and_shows_missing_numbers():
    scored = {
        "policy_version": "4",
        "verdict": "promoted",
        **asdict(decide(_metrics(gold=(0.3, -0.2)), KL_BUDGET, 0.0, None)),
    }
    text = decision_markdown(scored, "alignflow-policy")
    assert "| | held-out gold score | KL to reference |" in text
    assert "| candidate v4 | 0.3000 | 1.000 |" in text and "| sft | -0.2000 | (budget 5.000) |" in text
    unscored = {
        "policy_version": "5",
        "verdict": "rejected",
        **asdict(decide(_metrics(), KL_BUDGET, 0.0, None)),
    }
    text = decision_markdown(unscored, "alignflow-policy")
    assert f"{NO_SCORE_REASON}." in text and "| candidate v5 | n/a | 1.000 |" in text
