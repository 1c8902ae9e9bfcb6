"""The evaluate stage's numbers and words for a DPO policy and without reward models (pure functions; the
stage itself on a DPO output with no reward model is run in test_evaluate.py, which has the fake pipeline)."""

from __future__ import annotations

import json

import pytest

from alignflow.flows.report import evaluation_markdown
from alignflow.stages.common.runtime import StageInputError
from alignflow.stages.evaluate import (
    SideResults,
    eval_metrics,
    headline,
    plots_to_draw,
    policy_input,
    read_history,
    render_report,
    reward_hacking_sentence,
    summarise,
    training_summary,
)

BASE = [0.1, -0.2, 0.3, 0.0]


def _side(gold: list[float] | None, rm: list[float] | None = None) -> SideResults:
    return SideResults(texts=["text"] * 4, rm_total=rm, rm_each={"rm": rm} if rm is not None else {},
                       gold=gold, lengths=[5] * 4, finish_reasons=["eos"] * 4)


def _dpo_history(steps: int, eval_every: int = 2) -> list[dict[str, float]]:
    """The DPO stage's metrics.jsonl rows: one per optimizer step, held-out metrics every `eval_every`
    steps."""
    rows = []
    for step in range(1, steps + 1):
        row = {"step": step, "train/loss": 0.69 - 0.05 * step, "train/lr": 1e-4,
               "rewards/chosen": 0.02 * step, "rewards/rejected": -0.01 * step,
               "rewards/margin": 0.03 * step, "rewards/accuracy": 0.5 + 0.05 * step}
        if step % eval_every == 0 or step == steps:
            row.update({"eval/loss": 0.7 - 0.04 * step, "eval/rewards_margin": 0.02 * step,
                        "eval/rewards_accuracy": 0.5 + 0.04 * step})
        rows.append(row)
    return rows


def _no_rm_result(gold_delta: float | None, kl: float = 1.0, steps: int = 12) -> dict:
    """eval.json content of a DPO policy on 4 prompts, no reward model; gold moved by `gold_delta` (None: no
    gold)."""
    gold = None if gold_delta is None else [b + gold_delta for b in BASE]
    result = summarise(_side(gold), _side(None if gold_delta is None else BASE), kl=[kl] * 4,
                       history=_dpo_history(steps), kl_budget=5.0, algorithm="dpo")
    result.update({"temperature": 0.0, "max_new_tokens": 8, "reward_models": [],
                   "training": training_summary("dpo", {"algorithm": "dpo", "loss": "sigmoid", "beta": 0.1,
                                                        "steps": steps}, _dpo_history(steps)),
                   "plots": plots_to_draw(_dpo_history(steps))})
    return result


# ----------------------------------------------------------------------------------------------
# Inputs and history
# ----------------------------------------------------------------------------------------------

def test_the_policy_input_is_ppo_or_dpo_and_exactly_one():
    assert policy_input({"ppo": "u", "sft": "u", "data": "u", "reward_rm": "u"}) == "ppo"
    assert policy_input({"dpo": "u", "sft": "u", "data": "u"}) == "dpo"
    with pytest.raises(StageInputError, match="needs a policy input: 'ppo' .* or 'dpo'"):
        policy_input({"sft": "u", "data": "u"})
    with pytest.raises(StageInputError,
                       match=r"evaluates one policy, but the spec has inputs \['ppo', 'dpo'\]"):
        policy_input({"ppo": "u", "dpo": "u", "sft": "u"})


def test_read_history_orders_dpo_steps_and_rl_iterations(tmp_path):
    dpo = _dpo_history(5)
    (tmp_path / "dpo.jsonl").write_text("".join(json.dumps(r) + "\n" for r in reversed(dpo)))
    assert [r["step"] for r in read_history(tmp_path / "dpo.jsonl", "dpo")] == [1, 2, 3, 4, 5]
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps({"iteration": float(i)}) + "\n" for i in (3, 1, 2)))
    assert [r["iteration"] for r in read_history(tmp_path / "rl.jsonl")] == [1.0, 2.0, 3.0]
    with pytest.raises(StageInputError,
                       match="the 'dpo' input must be a dpo stage output with metrics.jsonl"):
        read_history(tmp_path / "missing.jsonl", "dpo")


def test_training_summary_counts_dpo_steps_and_rl_iterations():
    history = _dpo_history(7)
    assert training_summary("dpo", {"algorithm": "dpo", "loss": "ipo", "beta": 0.5, "steps": 7}, history) == {
        "algorithm": "dpo", "loss": "ipo", "beta": 0.5, "steps": 7}
    assert training_summary("dpo", {}, history)["steps"] == 7  # no alignflow_run.json: the history's length
    assert training_summary("ppo", {"algorithm": "grpo", "iterations": 3}, []) == {"algorithm": "grpo",
                                                                                   "iterations": 3}


def test_plots_follow_the_metrics_in_the_history():
    assert plots_to_draw(_dpo_history(4)) == ["implicit_rewards", "accuracy", "loss"]
    rl = [{"iteration": 1.0, "rollout/score_mean": 0.1, "kl/mean": 0.2, "rollout/response_length_mean": 7.0}]
    assert plots_to_draw(rl) == ["reward", "kl", "length"]
    # GRPO with no reference model logs no kl/mean: no empty KL plot.
    assert plots_to_draw([{"iteration": 1.0, "rollout/reward_total_mean": 0.1}]) == ["reward"]
    assert plots_to_draw([{"step": 1, "unplotted/metric": 1.0}]) == []
    assert plots_to_draw([{"rewards/margin": 0.3}]) == []  # no step or iteration: nothing to plot against


# ----------------------------------------------------------------------------------------------
# Numbers without reward models
# ----------------------------------------------------------------------------------------------

def test_without_reward_models_the_rm_numbers_are_absent():
    result = _no_rm_result(gold_delta=0.2)
    assert result["rm_available"] is False and result["gold_available"] is True
    for key in ("rm_delta", "rm_delta_se", "win_rate_rm"):
        assert result[key] is None
    assert result["policy"]["rm_score"] is None and result["policy"]["rm_scores"] == {}
    assert result["reward_hacking"] is None  # not checked, which is not the same as checked and not found
    assert result["gold_delta"] == pytest.approx(0.2) and result["win_rate_gold"] == 1.0
    metrics = eval_metrics(result)
    assert not [k for k in metrics if "rm" in k]
    assert metrics["eval/gold_delta"] == pytest.approx(0.2)
    assert metrics["eval/policy_gold_score"] == pytest.approx(0.25)
    assert set(metrics) == {"eval/kl_to_ref", "eval/policy_length", "eval/sft_length", "eval/n_prompts",
                            "eval/policy_gold_score", "eval/sft_gold_score", "eval/gold_delta",
                            "eval/win_rate_gold"}
    json.dumps(result, allow_nan=False)  # eval.json: nulls, no NaN


def test_headline_without_reward_models():
    assert headline(_no_rm_result(gold_delta=0.123)) == ("policy vs SFT on 4 prompts: gold +0.123 (win rate "
                                                         "100%), KL 1.00 nats")
    assert headline(_no_rm_result(gold_delta=None, kl=0.42)) == (
        "policy vs SFT on 4 prompts: no score (no reward model, no gold scorer), KL 0.42 nats")


def test_headline_with_reward_models_is_unchanged():
    result = summarise(_side(BASE, rm=[b + 0.5 for b in BASE]), _side(BASE, rm=BASE), kl=[1.0] * 4,
                       history=[], kl_budget=5.0)
    assert result["rm_available"] is True and result["reward_hacking"] is False
    assert headline(result) == ("policy vs SFT on 4 prompts: RM +0.500 (win rate 100%), gold +0.000 "
                                "(win rate 50%), KL 1.00 nats")


# ----------------------------------------------------------------------------------------------
# Words
# ----------------------------------------------------------------------------------------------

def test_report_without_reward_models_omits_their_rows_and_says_why():
    sample = {"prompt": "Write about the sea.", "sft_response": "x", "policy_response": "Lovely.",
              "sft_gold": -2.0, "policy_gold": -0.85}
    report = render_report(_no_rm_result(gold_delta=0.2), [sample], n_shown=1)
    assert "4 held-out prompts; dpo policy after 12 steps; temperature 0" in report
    assert "iterations" not in report
    assert "reward models: none given." in report
    assert "reward-model score (z)" not in report and "Per reward model" not in report
    assert ("No reward model was given, so there is no reward-model score and no reward-hacking check"
            in report)
    assert "| gold score | +0.050 | +0.250 | +0.200 ± 0.000 | 100.0% |" in report
    assert ("- The policy improved on the gold score; no reward-hacking check without a reward model and the "
            "KL is within budget.") in report
    assert "| # | prompt | SFT response | gold | policy response | gold |" in report
    assert "| 1 | Write about the sea. | x | -2.00 | Lovely. | -0.85 |" in report
    for name in ("implicit_rewards", "accuracy", "loss"):
        assert f"![{name}](plots/{name}.png)" in report
    assert "plots/reward.png" not in report and "plots/kl.png" not in report


def test_report_with_no_score_at_all_says_nothing_measures_quality():
    report = render_report(_no_rm_result(gold_delta=None), [], n_shown=0)
    assert "| gold score | n/a | n/a | n/a | n/a |" in report and "Gold score unavailable" in report
    assert "- No score measures the policy's quality here (no reward model, and no gold scorer" in report


def test_dpo_warnings_give_dpo_advice():
    over = render_report(_no_rm_result(gold_delta=0.2, kl=7.5), [], n_shown=0)
    assert "**KL warning**: the policy is 7.50 nats per response" in over and "raise dpo.beta" in over
    assert "ppo.kl_coef" not in over
    sentence = reward_hacking_sentence(0.8, -0.3, gold_se=0.1, algorithm="dpo")
    assert sentence.startswith("Reward hacking on held-out prompts: the reward-model score rose by +0.800 ")
    assert "DPO never saw the reward model" in sentence and "ppo." not in sentence
    assert "raise ppo.kl_coef" in reward_hacking_sentence(0.8, -0.3, gold_se=0.1)


def test_prefect_artifact_is_the_report_head_without_plots_or_samples():
    sample = {"prompt": "p", "sft_response": "x", "policy_response": "y", "sft_gold": 0.0, "policy_gold": 1.0}
    head = evaluation_markdown(render_report(_no_rm_result(gold_delta=0.2), [sample], n_shown=1))
    assert "## Findings" in head and "No reward model was given" in head
    assert "## Training curves" not in head and "## Sample responses" not in head and "plots/" not in head
