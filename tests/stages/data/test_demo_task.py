"""The demo task: determinism, sizes, label noise, the gold scorer's orderings and a learnability proxy."""

from __future__ import annotations

import collections
import math
import os
import subprocess
import sys

import pytest

from alignflow.config import DemoTaskConfig
from alignflow.stages.data import demo_task as task
from alignflow.stages.data.formats import load_preferences, load_prompts, load_sft

SMALL = DemoTaskConfig(n_sft=300, n_preferences=400, n_prompts=64, n_eval_prompts=32, label_noise=0.1, seed=5)
OCEAN = "Write about the ocean.\n"


def gold_prefers(record) -> bool:
    return task.gold_score(record.prompt, record.chosen) > task.gold_score(record.prompt, record.rejected)


# --- files -------------------------------------------------------------------------------------------


def test_same_seed_gives_identical_bytes_and_another_seed_differs(tmp_path):
    first = task.generate_demo_task(SMALL, tmp_path / "a")
    second = task.generate_demo_task(SMALL, tmp_path / "b")
    other = task.generate_demo_task(SMALL.model_copy(update={"seed": 6}), tmp_path / "c")
    assert sorted(first) == ["eval_prompts", "preferences", "prompts", "sft"]
    for name, path in first.items():
        assert path.name == f"{name}.jsonl"
        assert path.read_bytes() == second[name].read_bytes()
        assert path.read_bytes() != other[name].read_bytes()


def test_sizes_follow_the_config_and_files_load(tmp_path):
    paths = task.generate_demo_task(SMALL, tmp_path)
    assert len(load_sft(paths["sft"])) == SMALL.n_sft
    assert len(load_preferences(paths["preferences"])) == SMALL.n_preferences
    assert len(load_prompts(paths["prompts"])) == SMALL.n_prompts
    assert len(load_prompts(paths["eval_prompts"])) == SMALL.n_eval_prompts


def test_records_carry_ids_and_topics_and_prompts_end_with_the_separator():
    sft = task.make_sft(SMALL)
    assert [r.extras["id"] for r in sft[:2]] == ["sft-000000", "sft-000001"]
    for record in sft:
        assert record.prompt.endswith(task.PROMPT_END)
        assert task.prompt_topic(record.prompt) == record.extras["topic"]
        assert not record.completion[0].isspace()


def test_eval_prompts_use_held_out_phrasings():
    train = {r.prompt for r in task.make_prompts(SMALL)} | {r.prompt for r in task.make_sft(SMALL)}
    held = {r.prompt for r in task.make_prompts(SMALL, held_out=True)}
    assert train.isdisjoint(held)
    assert {task.prompt_topic(p) for p in held} <= set(task.TOPICS)


def test_completions_are_one_or_two_short_sentences():
    counts = [len(task._words(r.completion)) for r in task.make_sft(SMALL)]
    assert min(counts) >= task.MIN_WORDS and max(counts) <= task.MAX_WORDS


def test_sft_quality_mix_matches_the_declared_shares():
    cfg = DemoTaskConfig(n_sft=2000, seed=1)
    shares = collections.Counter(r.extras["quality"] for r in task.make_sft(cfg))
    for quality, share in task.SFT_MIX:
        # binomial std at n=2000 is <= 0.011; 0.04 is 3.6 std
        assert abs(shares[quality] / cfg.n_sft - share) < 0.04, quality


# --- preferences -------------------------------------------------------------------------------------


@pytest.mark.parametrize("noise", [0.0, 0.1, 0.25])
def test_label_noise_swaps_exactly_that_fraction(noise):
    cfg = DemoTaskConfig(n_preferences=1000, label_noise=noise, seed=2)
    pairs = task.make_preferences(cfg)
    wrong = sum(not gold_prefers(r) for r in pairs)
    # Gold gaps are >= MIN_GOLD_GAP before the swap, so every wrong pair is a swapped one.
    assert wrong == round(noise * cfg.n_preferences)
    assert (len(pairs) - wrong) / len(pairs) >= 1 - noise - 0.03


def test_pairs_have_a_clear_gold_gap_and_two_different_answers():
    for record in task.make_preferences(SMALL):
        gap = abs(
            task.gold_score(record.prompt, record.chosen) - task.gold_score(record.prompt, record.rejected)
        )
        assert gap >= task.MIN_GOLD_GAP
        assert record.chosen != record.rejected


def test_the_preference_is_learnable_from_word_counts():
    """A proxy for the reward model: a linear model on word counts (plus the distinct-word ratio).

    Measured 0.900 against gold on 500 fresh pairs (0.828 against the 10%-noisy labels); the tiny
    transformer reward model gets 0.93 against gold (see demo_task.MIN_GOLD_GAP's comment).
    """
    train = task.make_preferences(DemoTaskConfig(n_preferences=1500, seed=0))
    test = task.make_preferences(DemoTaskConfig(n_preferences=500, seed=1))

    def features(text: str) -> collections.Counter:
        words = task._words(text)
        counts = collections.Counter(words)
        counts["<distinct_ratio>"] = len(set(words)) / len(words)
        return counts

    weights: dict[str, float] = collections.defaultdict(float)

    def score(f: collections.Counter) -> float:
        return sum(weights[k] * v for k, v in f.items())

    for _ in range(5):  # logistic regression on the Bradley-Terry likelihood, plain SGD
        for r in train:
            fc, fr = features(r.chosen), features(r.rejected)
            step = 0.1 * (1 - 1 / (1 + math.exp(-(score(fc) - score(fr)))))
            for k, v in fc.items():
                weights[k] += step * v
            for k, v in fr.items():
                weights[k] -= step * v
    agree = sum((score(features(r.chosen)) > score(features(r.rejected))) == gold_prefers(r) for r in test)
    assert agree / len(test) >= 0.85


# --- gold scorer ---------------------------------------------------------------------------------------


def test_gold_orders_positive_over_neutral_over_negative():
    positive = task.gold_score(OCEAN, "The waves are beautiful and the shore is lovely today.")
    neutral = task.gold_score(OCEAN, "The waves are large and the shore is wide today.")
    negative = task.gold_score(OCEAN, "The waves are ugly and the shore is dirty today.")
    assert positive > neutral > negative
    assert positive == pytest.approx(0.4 * 2 + 0.35 * 2)  # two topic words, two positive words
    assert neutral == pytest.approx(0.4 * 2)
    assert negative == pytest.approx(0.4 * 2 - 0.5 * 2)


def test_gold_penalises_repetition():
    once = task.gold_score(OCEAN, "The sea is lovely and the waves look bright near the shore.")
    repeated = task.gold_score(
        OCEAN, "The sea is lovely. The sea is lovely. The sea is lovely. The sea is lovely."
    )
    assert repeated < once
    # 16 words, 4 distinct: ratio 0.25 -> 5 * (0.60 - 0.25) = 1.75 off (one topic, one positive word)
    assert repeated == pytest.approx(0.4 + 0.35 - 1.75)


def test_gold_penalises_off_topic_words():
    on_topic = task.gold_score(OCEAN, "The fish is lovely and the coral is bright.")
    off_topic = task.gold_score(OCEAN, "The cows is lovely and the barn is bright.")
    mixed = task.gold_score(OCEAN, "The fish is lovely and the barn is bright.")
    assert on_topic > mixed > off_topic
    assert off_topic == pytest.approx(0.35 * 2 - 0.5 * 2)


def test_gold_scores_empty_and_garbage_very_low_and_stays_in_range():
    assert task.gold_score(OCEAN, "") == -2.0
    assert task.gold_score(OCEAN, "!!! ...") == -2.0
    assert task.gold_score(OCEAN, "xkcd blorp zzt frum") == -2.0
    assert task.gold_score(OCEAN, "The sea.") == pytest.approx(0.4 - 0.3 * 3)  # 3 words short of 5
    stuffed = " ".join([*task.TOPICS["ocean"][1], *task.POSITIVE])
    assert task.gold_score(OCEAN, stuffed) == 2.0  # caps: 3 topic + 3 positive words = 2.25, clipped
    scores = [
        task.gold_score(r.prompt, c) for r in task.make_preferences(SMALL) for c in (r.chosen, r.rejected)
    ]
    assert -2.0 <= min(scores) and max(scores) <= 2.0


def test_gold_finds_the_topic_in_rendered_chat_prompts():
    assert task.prompt_topic("User:\nShare your thoughts on outer space.\nAssistant:\n") == "space"
    assert task.prompt_topic("Hello there.") is None
    # Without a topic every topic word counts as off-topic.
    assert task.gold_score("Hello.\n", "The waves are lovely today.") < task.gold_score(
        OCEAN, "The waves are lovely today."
    )


def test_gold_reward_has_the_reward_function_signature():
    prompts, completions = [OCEAN, OCEAN], ["The waves are lovely today.", ""]
    assert task.gold_reward(prompts, completions, extra_column=[1, 2]) == [
        task.gold_score(p, c) for p, c in zip(prompts, completions, strict=True)
    ]
    with pytest.raises(ValueError, match="gold_reward got 2 prompts but 1 completions"):
        task.gold_reward(prompts, completions[:1])


def test_rl_has_headroom_over_the_sft_data():
    by_quality = collections.defaultdict(list)
    for r in task.make_sft(DemoTaskConfig(n_sft=1000, seed=3)):
        by_quality[r.extras["quality"]].append(task.gold_score(r.prompt, r.completion))
    mean = {q: sum(v) / len(v) for q, v in by_quality.items()}
    overall = sum(sum(v) for v in by_quality.values()) / 1000
    assert mean["good"] > mean["neutral"] > mean["negative"] > mean["offtopic"]
    assert mean["repetitive"] < 0 and mean["good"] > 1.2
    assert 0.3 < overall < 1.0  # mediocre: a policy that only wrote "good" answers would gain > 0.5


def test_every_word_of_the_task_is_in_the_tokenizer_corpus():
    corpus = task.demo_corpus(SMALL, n_texts=500)
    assert corpus == task.demo_corpus(SMALL, n_texts=500)
    seen = {w for text in corpus for w in task._words(text)}
    task_words = {w for name, (_, nouns) in task.TOPICS.items() for w in (name, *nouns)}
    assert task_words | set(task.POSITIVE) | set(task.NEGATIVE) | set(task.NEUTRAL) <= seen
    assert any(text.startswith("User:\n") for text in corpus)


def test_the_demo_task_imports_no_ml_library():
    code = (
        "import sys, alignflow.stages.data.demo_task, alignflow.stages.data.formats; "
        "print(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.stdout.strip() == "[]"
