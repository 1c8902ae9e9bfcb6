"""Reward functions named by import path ('pkg.module:function') with TRL's signature, plus two built-ins.

A reward function is `f(prompts: list[str], completions: list[str], **kwargs) -> list[float]`;
kwargs carry `completion_ids` (list[list[int]]) and `finish_reasons` (list[str]).
"""

from __future__ import annotations

import importlib
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


def call_reward_function(name: str, fn: RewardFunction, prompts: list[str], completions: list[str],
                         **kwargs) -> list[float]:
    """Call `fn` and check it returned one number per completion.

    Non-finite values are passed on: the RL stage's NaN guard stops training with the iteration named.
    """
    values = fn(prompts, completions, **kwargs)
    if len(values) != len(completions):
        raise ValueError(f"reward function '{name}' returned {len(values)} values for {len(completions)} completions")
    return [float(v) for v in values]


def brevity(prompts: list[str], completions: list[str], **kwargs) -> list[float]:
    """-0.01 per whitespace-separated word beyond 20: discourages rambling (an example shaping term)."""
    return [-0.01 * max(0, len(c.split()) - 20) for c in completions]


def ends_with_eos(prompts: list[str], completions: list[str], finish_reasons: list[str] | None = None,
                  **kwargs) -> list[float]:
    """1.0 for a completion that ended with EOS, else 0.0."""
    reasons = finish_reasons or ["eos"] * len(completions)
    return [1.0 if r == "eos" else 0.0 for r in reasons]


def letter_share(prompts: list[str], completions: list[str], letter: str = "e", **kwargs) -> list[float]:
    """The share of `letter` among a completion's characters (0.0 for an empty one).

    A rule-based reward that costs microseconds: the RL-speed benchmarks score with it, so that they
    time the RL loop and not a reward model (benchmarks/rl_ladder.py, and TRL's side of it).
    """
    return [c.count(letter) / len(c) if c else 0.0 for c in completions]
