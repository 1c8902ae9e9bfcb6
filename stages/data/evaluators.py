"""A dataset's held-out evaluator: a scorer `f(prompt, completion) -> float` that the RL and evaluation stages
report beside the reward (`rollout/gold_score_mean`, `eval/policy_gold_score`) without knowing the task.

A task that can score answers by a rule the reward model never saw (the demo task's hidden preference)
names its scorer here, keyed by the scheme of the data stage's sources (`demo://...`); on data with no such
scorer the stages report no gold score. What it is not: a reward: no policy trains on it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from alignflow.stages.data import demo_task

Evaluator = Callable[[str, str], float]

# Source scheme -> the evaluator of the task the data stage generated from it.
TASK_EVALUATORS: dict[str, Evaluator] = {"demo": demo_task.gold_score}


def load_evaluator(
    data_dir: Path, prompts: tuple[str, ...] = ("eval_prompts", "prompts")
) -> Evaluator | None:
    """The data output's evaluator for answers to `prompts`, from its stats.json sources; None without one.

    The source of the prompts it will score decides: the first of `prompts` the data output has."""
    stats = Path(data_dir) / "stats.json"
    if not stats.is_file():
        return None
    sources = json.loads(stats.read_text()).get("sources", {})
    source = next((sources[name] for name in prompts if sources.get(name)), "")
    scheme, sep, _ = source.partition("://") if isinstance(source, str) else ("", "", "")
    return TASK_EVALUATORS.get(scheme) if sep else None
