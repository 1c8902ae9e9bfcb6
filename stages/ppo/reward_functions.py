"""Reward functions named by import path ('pkg.module:function') with TRL's signature, plus two built-ins.

A reward function is called as TRL's GRPOTrainer calls it, with keyword arguments only:
`f(prompts=list[str], completions=list[str], completion_ids=list[list[int]], finish_reasons=list[str],
**columns) -> list[float]`, where `columns` are the prompt records' other fields (a dataset column
`answer` arrives as `answer=[...]`, one value per completion). So TRL's documented examples, such as
`def reward_len(completions, **kwargs)`, run unchanged.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

RewardFunction = Callable[..., list[float]]


def load_reward_function(path: str) -> RewardFunction:
    """Import 'pkg.module:function' (or 'pkg.module.function'); errors say what was missing."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"reward function '{path}': expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward function '{path}': cannot import module '{module_name}' ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward function '{path}': module '{module_name}' has no callable '{attr}'")
    return fn


# The arguments every reward function is given; a prompt record's column of the same name is not passed.
CALL_ARGUMENTS = ("prompts", "completions", "completion_ids", "finish_reasons")


def call_reward_function(name: str, fn: RewardFunction, prompts: list[str], completions: list[str],
                         **kwargs) -> list[float]:
    """Call `fn` with keyword arguments (prompts=, completions=, then `kwargs`: completion_ids, finish_reasons
    and the dataset's columns) and check it returned one number per completion.

    A function written for a positional call with other parameter names (`def f(p, c)`) gets a one-line error
    that says how to fix it. Non-finite values are passed on: the RL stage's NaN guard stops training with the
    iteration named.
    """
    try:
        inspect.signature(fn).bind(prompts=prompts, completions=completions, **kwargs)
    except TypeError as exc:
        raise ValueError(
            f"reward function '{name}' cannot be called as TRL calls it ({exc}): it is given keyword "
            f"arguments {', '.join(CALL_ARGUMENTS)} and the dataset's columns; name its parameters "
            "so (e.g. `def f(completions, **kwargs)`) and take the rest with **kwargs"
        ) from None
    except ValueError:  # no signature to inspect (a builtin): the call itself says what is wrong
        pass
    values = fn(prompts=prompts, completions=completions, **kwargs)
    if len(values) != len(completions):
        raise ValueError(
            f"reward function '{name}' returned {len(values)} values for {len(completions)} completions"
        )
    return [float(v) for v in values]


def dataset_columns(records: list, rows: list[int]) -> dict[str, list]:
    """The prompt records' extra fields as TRL passes dataset columns: name -> one value per row (None where a
    record lacks it), for the records at `rows` (a prompt repeated per completion); CALL_ARGUMENTS left
    out."""
    names = sorted({key for i in set(rows) for key in records[i].extras} - set(CALL_ARGUMENTS))
    return {name: [records[i].extras.get(name) for i in rows] for name in names}


def brevity(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """-0.01 per whitespace-separated word beyond 20: discourages rambling (an example shaping term)."""
    return [-0.01 * max(0, len(c.split()) - 20) for c in completions]


def ends_with_eos(
    prompts: list[str], completions: list[str], finish_reasons: list[str] | None = None, **kwargs
) -> list[float]:
    """1.0 for a completion that ended with EOS, else 0.0."""
    reasons = finish_reasons or ["eos"] * len(completions)
    return [1.0 if r == "eos" else 0.0 for r in reasons]


def letter_share(prompts: list[str], completions: list[str], letter: str = "e", **kwargs) -> list[float]:
    """The share of `letter` among a completion's characters (0.0 for an empty one).

    A rule-based reward that costs microseconds: the RL-speed benchmarks score with it, so that they
    time the RL loop and not a reward model (benchmarks/rl_ladder.py, and TRL's side of it).
    """
    return [c.count(letter) / len(c) if c else 0.0 for c in completions]
