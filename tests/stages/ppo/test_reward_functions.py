"""Reward functions are called as TRL's GRPOTrainer calls them: keyword arguments, dataset columns too."""

from __future__ import annotations

import re

import pytest

from alignflow.stages.data.formats import PromptRecord
from alignflow.stages.ppo.reward_functions import call_reward_function, dataset_columns, ends_with_eos

# Three reward functions written the way TRL's documentation writes them: only the arguments they use, by
# name, and **kwargs for the rest.


def reward_len(completions, **kwargs):
    """Prefers completions of 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def format_reward(completions, **kwargs):
    """1.0 where the completion is '<think>...</think><answer>...</answer>'."""
    pattern = r"^<think>.*?</think><answer>.*?</answer>$"
    return [1.0 if re.match(pattern, completion) else 0.0 for completion in completions]


def answer_reward(prompts, completions, answer, **kwargs):
    """Reads the dataset's `answer` column: 1.0 where the completion contains the row's answer."""
    return [
        1.0 if expected in completion else 0.0
        for completion, expected in zip(completions, answer, strict=True)
    ]


PROMPTS = [
    PromptRecord.model_validate({"prompt": "2+2?", "answer": "4", "id": 7}),
    PromptRecord.model_validate({"prompt": "3+3?", "answer": "6"}),
]
ROWS = [0, 0, 1]  # prompt 0 twice (a GRPO group), then prompt 1
COMPLETIONS = ["<think>easy</think><answer>4</answer>", "five", "x" * 20]


def call(fn, **extra):
    return call_reward_function(
        fn.__name__,
        fn,
        [PROMPTS[i].prompt for i in ROWS],
        COMPLETIONS,
        completion_ids=[[1], [2], [3]],
        finish_reasons=["eos", "length", "eos"],
        **extra,
    )


def test_trls_documented_shapes_run_unchanged():
    columns = dataset_columns(PROMPTS, ROWS)
    assert columns == {"answer": ["4", "4", "6"], "id": [7, 7, None]}
    assert call(reward_len, **columns) == [-17.0, -16.0, 0.0]
    assert call(format_reward, **columns) == [1.0, 0.0, 0.0]
    assert call(answer_reward, **columns) == [1.0, 0.0, 0.0]


def test_functions_written_for_the_positional_call_keep_working():
    """The built-ins (and earlier user functions) name their first two parameters prompts and completions."""
    assert call(ends_with_eos) == [1.0, 0.0, 1.0]


def test_a_signature_that_cannot_take_the_call_gets_one_line_that_says_how_to_fix_it():
    def positional(p, c):
        return [0.0] * len(c)

    with pytest.raises(
        ValueError,
        match=r"reward function 'positional' cannot be called as TRL calls it .*"
        r"e\.g\. `def f\(completions, \*\*kwargs\)`",
    ):
        call(positional)

    def no_column(completions, answer, **kwargs):
        return [0.0] * len(completions)

    with pytest.raises(ValueError, match="missing a required argument: 'answer'"):
        call(no_column)  # the dataset has no such column: named before the function runs


def test_a_column_named_like_an_argument_is_not_passed_twice():
    records = [PromptRecord.model_validate({"prompt": "p", "completions": "clash", "topic": "cats"})]
    assert dataset_columns(records, [0, 0]) == {"topic": ["cats", "cats"]}
