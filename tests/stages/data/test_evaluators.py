"""The data's evaluator hook: the demo task's gold scorer for demo data, nothing for other data."""

import json

from alignflow.stages.data import demo_task
from alignflow.stages.data.evaluators import load_evaluator


def test_the_demo_task_names_its_gold_scorer_and_other_data_none(tmp_path):
    assert load_evaluator(tmp_path) is None  # no stats.json
    (tmp_path / "stats.json").write_text(json.dumps({"sources": {"eval_prompts": "s3://bucket/eval.jsonl"}}))
    assert load_evaluator(tmp_path) is None
    (tmp_path / "stats.json").write_text(json.dumps({"sources": {"prompts": "demo://seed=0/prompts"}}))
    assert load_evaluator(tmp_path) is demo_task.gold_score


def test_the_prompts_scored_decide(tmp_path):
    """Demo eval prompts beside the user's training prompts: evaluation scores gold, the RL stage does not."""
    sources = {"prompts": "/data/prompts.jsonl", "eval_prompts": "demo://seed=0/eval_prompts"}
    (tmp_path / "stats.json").write_text(json.dumps({"sources": sources}))
    assert load_evaluator(tmp_path) is demo_task.gold_score
    assert load_evaluator(tmp_path, prompts=("prompts",)) is None
