"""The synthetic demo task: "write about a topic" prompts, mixed-quality data and the gold scorer; torch-free.

What this is: a deterministic generator (pure Python, random.Random(seed)) of the four datasets the
pipeline needs (SFT, preference pairs, RL prompts, held-out eval prompts) plus `gold_score`, the
hidden ground truth that defines which answers are better. The reward model only ever sees the
preference pairs; the gold scorer is for evaluation (and tests). What it is not: a language task
worth solving. It exists so a CPU-sized pipeline can show RL moving a measurable number.

The task. 16 topics, each with 10 topic words (its name and 9 nouns). A prompt asks to write about a
topic ("Write about the ocean.\\n"); an answer is one or two short sentences (8-20 words) built from
templates whose slots take topic nouns and adjectives. Answer qualities, with their gold score
(mean, min..max over 2000 samples):

    good        on-topic nouns, mostly positive adjectives        +1.4   +0.4 .. +2.0
    neutral     on-topic nouns, neutral adjectives                +0.9   +0.4 .. +1.2
    negative    on-topic nouns, mostly negative adjectives        +0.1   -0.7 .. +1.2
    offtopic    nouns of another topic, mostly neutral adjectives -1.0   -1.5 .. +0.2
    repetitive  one short sentence said 3-5 times                 -0.9   -1.6 .. -0.6
    garbage     letter soup, or a 2-word fragment (pairs only)    -1.2   -2.0 .. -0.5

SFT data is a mix (40% good, 30% neutral, 10% negative, 10% off-topic, 10% repetitive), so the SFT
policy is mediocre (the data's mean gold is +0.67) and RL has room up to +2.0. Preference pairs put
two answers of different quality to the same prompt (gold gap >= 0.5, so no label is a near-tie),
chosen = higher gold, then exactly round(label_noise * n) pairs are swapped. The cues are mostly
word-level (sentiment words, repetition), which a small transformer learns; whether nouns match the
prompt's topic needs prompt-answer matching, which a 2-layer 64-wide reward model does not learn from
3000 pairs (0.5-0.7 right on such pairs), so off-topic answers are only 5% of pairs.

The gold score (see `gold_score`), on the lowercase words w_1..w_n of the completion (regex [a-z]+):

    score = 0.40 * min(on, 3)           distinct topic words of the prompt's topic
          + 0.35 * min(pos, 3)          distinct positive words
          - 0.50 * min(neg, 3)          distinct negative words
          - 0.50 * min(off, 3)          distinct topic words of other topics
          - 5.00 * max(0, 0.60 - distinct_ratio)    distinct_ratio = |set(w)| / n
          - 2.00 * unknown_fraction     share of words outside the task's vocabulary
          - 0.30 * max(0, 5 - n)        fewer than 5 words
    clipped to [-2, 2]; n = 0 scores -2.

The caps (3) keep word-stuffing from paying without bound. The distinct-ratio threshold 0.60 sits
below 99% of the templated answers (median 0.89, 1st percentile 0.61: "the" and "is" repeat) and
well above a sentence said three or more times (0.20-0.33), which loses 1.35-2.0.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from alignflow.config import DemoTaskConfig
from alignflow.stages.data.formats import (
    Message,
    PreferenceRecord,
    PromptRecord,
    SFTRecord,
    render_messages_fallback,
    write_jsonl,
)

# ---------------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------------

# topic name -> (how prompts say it, 9 topic nouns). Every word is unique across the whole task.
TOPICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ocean": (
        "the ocean",
        ("waves", "sea", "tide", "fish", "shore", "coral", "boats", "seagulls", "dolphins"),
    ),
    "forest": (
        "the forest",
        ("trees", "moss", "leaves", "owls", "ferns", "pines", "trail", "deer", "mushrooms"),
    ),
    "city": (
        "the city",
        ("streets", "buildings", "traffic", "subway", "towers", "crowds", "cafes", "bridges", "taxis"),
    ),
    "music": (
        "music",
        ("songs", "guitar", "drums", "melody", "piano", "concert", "rhythm", "singer", "violin"),
    ),
    "garden": (
        "the garden",
        ("flowers", "roses", "tulips", "soil", "bees", "hedges", "vegetables", "fountain", "butterflies"),
    ),
    "mountain": (
        "the mountain",
        ("peaks", "cliffs", "summit", "glacier", "rocks", "valley", "climbers", "ridge", "goats"),
    ),
    "kitchen": (
        "the kitchen",
        ("oven", "bread", "soup", "spices", "knives", "pans", "recipes", "stove", "cookies"),
    ),
    "winter": (
        "winter",
        ("snow", "ice", "frost", "sleds", "snowmen", "mittens", "blizzard", "fireplace", "icicles"),
    ),
    "space": (
        "outer space",
        ("stars", "planets", "rockets", "moon", "comets", "galaxy", "astronauts", "orbit", "meteors"),
    ),
    "library": (
        "the library",
        ("books", "shelves", "pages", "librarian", "novels", "readers", "atlas", "archives", "bookmarks"),
    ),
    "river": (
        "the river",
        ("current", "banks", "canoe", "stream", "rapids", "otters", "dam", "reeds", "pebbles"),
    ),
    "desert": (
        "the desert",
        ("sand", "dunes", "cactus", "camels", "oasis", "lizards", "mirage", "canyon", "scorpions"),
    ),
    "school": (
        "school",
        ("teachers", "students", "lessons", "classroom", "homework", "chalk", "desks", "recess", "notebooks"),
    ),
    "farm": (
        "the farm",
        ("cows", "barn", "tractor", "hay", "chickens", "pigs", "fields", "orchard", "sheep"),
    ),
    "football": (
        "football",
        ("players", "goal", "stadium", "coach", "referee", "team", "fans", "ball", "kickoff"),
    ),
    "railway": (
        "the railway",
        (
            "trains",
            "tracks",
            "station",
            "tickets",
            "platform",
            "locomotive",
            "carriages",
            "conductor",
            "timetable",
        ),
    ),
}
POSITIVE: tuple[str, ...] = (
    "beautiful",
    "wonderful",
    "bright",
    "lovely",
    "peaceful",
    "amazing",
    "joyful",
    "delightful",
    "charming",
    "pleasant",
    "cheerful",
    "gorgeous",
)
NEGATIVE: tuple[str, ...] = (
    "ugly",
    "terrible",
    "dull",
    "awful",
    "boring",
    "gloomy",
    "nasty",
    "horrible",
    "dirty",
    "miserable",
    "dreadful",
    "broken",
)
NEUTRAL: tuple[str, ...] = (
    "large",
    "small",
    "old",
    "new",
    "usual",
    "ordinary",
    "busy",
    "quiet",
    "wide",
    "plain",
    "distant",
    "common",
)

# Sentence templates: {n} takes a noun, {a} an adjective (each slot filled independently).
TEMPLATES: tuple[str, ...] = (
    "The {n} is {a}.",
    "The {n} is {a} and the {n} is {a}.",
    "I think the {n} looks {a} today.",
    "We walked past the {a} {n} near the {n}.",
    "Everyone says the {n} feels {a} in the morning.",
    "There is a {a} {n} next to the {n}.",
    "My friend likes the {a} {n}.",
    "In the evening the {n} seems {a} and {a}.",
    "The {a} {n} and the {a} {n} are here.",
    "You can see the {n} and the {n} from far away.",
)
# Prompt phrasings: RL/SFT/preference prompts use the training set, eval prompts the held-out set.
TRAIN_PHRASINGS: tuple[str, ...] = (
    "Write about {t}.",
    "Tell me about {t}.",
    "Describe {t}.",
    "Say something about {t}.",
)
TRAIN_SUFFIXES: tuple[str, ...] = ("", " Keep it short.", " Use one or two sentences.", " Be descriptive.")
EVAL_PHRASINGS: tuple[str, ...] = (
    "Write a few words about {t}.",
    "Share your thoughts on {t}.",
    "Give a short description of {t}.",
)
EVAL_SUFFIXES: tuple[str, ...] = ("", " Please be brief.", " Two sentences at most.")
PROMPT_END = "\n"  # the separator the completion follows (see formats.py: a newline is a BPE boundary)

Quality = Literal["good", "neutral", "negative", "offtopic", "repetitive", "garbage"]
SFT_MIX: tuple[tuple[Quality, float], ...] = (
    ("good", 0.4),
    ("neutral", 0.3),
    ("negative", 0.1),
    ("offtopic", 0.1),
    ("repetitive", 0.1),
)
# Preference pair types (two qualities) and their shares; the gold score decides which is chosen.
PAIR_MIX: tuple[tuple[tuple[Quality, Quality], float], ...] = (
    (("good", "negative"), 0.30),
    (("good", "neutral"), 0.25),
    (("neutral", "negative"), 0.20),
    (("good", "repetitive"), 0.10),
    (("neutral", "repetitive"), 0.05),
    (("good", "garbage"), 0.05),
    (("good", "offtopic"), 0.03),
    (("neutral", "offtopic"), 0.02),
)
# Measured (a 2-layer 64-wide Llama RM from random init, the default reward config: 2 epochs, lr 1e-3,
# batch 32, 3000 pairs with 10% label noise; scored on 600 fresh pairs): held-out accuracy 0.85 (data
# seeds 0 and 1) against the noisy labels, whose ceiling is 0.90, and 0.93 against gold. Earlier mixes:
# 10% off-topic pairs 0.83 / 0.82; 25% off-topic pairs with a 0.3 gap 0.70.
MIN_GOLD_GAP = 0.5  # pairs closer than this are redrawn: a near-tie label is noise the RM cannot learn
MIN_WORDS, MAX_WORDS = 8, 20

_WORD = re.compile(r"[a-z]+")
_TOPIC_OF_WORD: dict[str, str] = {w: name for name, (_, nouns) in TOPICS.items() for w in (name, *nouns)}
_TOPIC_WORDS: dict[str, frozenset[str]] = {
    name: frozenset((name, *nouns)) for name, (_, nouns) in TOPICS.items()
}
_POSITIVE, _NEGATIVE = frozenset(POSITIVE), frozenset(NEGATIVE)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


KNOWN_WORDS: frozenset[str] = frozenset(
    set(_TOPIC_OF_WORD)
    | _POSITIVE
    | _NEGATIVE
    | set(NEUTRAL)
    | {w for t in TEMPLATES for w in _words(t.replace("{n}", "").replace("{a}", ""))}
    | {
        w
        for p in (*TRAIN_PHRASINGS, *TRAIN_SUFFIXES, *EVAL_PHRASINGS, *EVAL_SUFFIXES)
        for w in _words(p.replace("{t}", ""))
    }
    | {w for _, (said, _) in TOPICS.items() for w in _words(said)}
)


# ---------------------------------------------------------------------------------------------------
# Gold scorer
# ---------------------------------------------------------------------------------------------------


def prompt_topic(prompt: str) -> str | None:
    """The topic a prompt asks about (the first topic name among its words), or None."""
    for word in _words(prompt):
        if word in TOPICS:
            return word
    return None


def gold_score(prompt: str, completion: str) -> float:
    """The hidden preference: higher is better, in [-2, 2]. Formula in the module docstring.

    `prompt` may be the raw prompt or any rendering of it (a chat template's text works: the topic
    is found by its name among the words). `completion` is the decoded answer, without special tokens.
    """
    words = _words(completion)
    n = len(words)
    if n == 0:
        return -2.0
    distinct = set(words)
    topic = prompt_topic(prompt)
    own = _TOPIC_WORDS[topic] if topic else frozenset()
    on = len(distinct & own)
    off = sum(1 for w in distinct if w in _TOPIC_OF_WORD and w not in own)
    pos = len(distinct & _POSITIVE)
    neg = len(distinct & _NEGATIVE)
    unknown = sum(1 for w in words if w not in KNOWN_WORDS) / n
    score = (
        0.40 * min(on, 3)
        + 0.35 * min(pos, 3)
        - 0.50 * min(neg, 3)
        - 0.50 * min(off, 3)
        - 5.0 * max(0.0, 0.60 - len(distinct) / n)
        - 2.0 * unknown
        - 0.30 * max(0, 5 - n)
    )
    return max(-2.0, min(2.0, score))


def gold_reward(prompts: Sequence[str], completions: Sequence[str], **_: object) -> list[float]:
    """`gold_score` with TRL's reward-function signature, for `ppo.reward_functions` or evaluation.

    Import path: "alignflow.stages.data.demo_task:gold_reward". Optimising it directly skips the
    reward model (an oracle run, useful as the upper reference).
    """
    if len(prompts) != len(completions):
        raise ValueError(f"gold_reward got {len(prompts)} prompts but {len(completions)} completions")
    return [gold_score(p, c) for p, c in zip(prompts, completions, strict=True)]


# ---------------------------------------------------------------------------------------------------
# Generators
# ---------------------------------------------------------------------------------------------------


def make_prompt(rng: random.Random, topic: str, held_out: bool = False) -> str:
    """One prompt instance for `topic` (training phrasings, or the held-out eval phrasings)."""
    phrasings, suffixes = (EVAL_PHRASINGS, EVAL_SUFFIXES) if held_out else (TRAIN_PHRASINGS, TRAIN_SUFFIXES)
    said = TOPICS[topic][0]
    return rng.choice(phrasings).format(t=said) + rng.choice(suffixes) + PROMPT_END


def _fill(
    rng: random.Random, templates: Sequence[str], nouns: Sequence[str], adjectives: Sequence[str]
) -> str:
    """Fill templates, drawing nouns and adjectives without replacement where the pools allow."""
    noun_pool, adj_pool = list(nouns), list(adjectives)
    rng.shuffle(noun_pool)
    rng.shuffle(adj_pool)
    out = []
    for template in templates:
        parts = re.split(r"(\{n\}|\{a\})", template)
        for i, part in enumerate(parts):
            if part == "{n}":
                parts[i] = noun_pool.pop() if noun_pool else rng.choice(nouns)
            elif part == "{a}":
                parts[i] = adj_pool.pop() if adj_pool else rng.choice(adjectives)
        out.append("".join(parts))
    return " ".join(out)


def _sentences(rng: random.Random, nouns: Sequence[str], adjectives: Sequence[str]) -> str:
    """One or two template sentences with MIN_WORDS..MAX_WORDS words."""
    while True:
        picked = [rng.choice(TEMPLATES)]
        if len(_words(picked[0])) < MIN_WORDS or rng.random() < 0.4:
            picked.append(rng.choice(TEMPLATES))
        text = _fill(rng, picked, nouns, adjectives)
        if MIN_WORDS <= len(_words(text)) <= MAX_WORDS:
            return text


def _mixed(rng: random.Random, main: Sequence[str], other: Sequence[str], share_other: float) -> list[str]:
    """An adjective pool mostly from `main`, with about `share_other` of `other` mixed in."""
    pool = [a for a in main if rng.random() >= share_other]
    pool += [a for a in other if rng.random() < share_other]
    return pool or list(main)


def make_completion(rng: random.Random, topic: str, quality: Quality) -> str:
    """One answer of the given quality to a prompt about `topic`."""
    nouns = (topic, *TOPICS[topic][1])
    if quality == "good":
        return _sentences(rng, nouns, _mixed(rng, POSITIVE, NEUTRAL, 0.2))
    if quality == "neutral":
        return _sentences(rng, nouns, NEUTRAL)
    if quality == "negative":
        return _sentences(rng, nouns, _mixed(rng, NEGATIVE, NEUTRAL, 0.2))
    if quality == "offtopic":
        other = rng.choice([t for t in TOPICS if t != topic])
        return _sentences(rng, (other, *TOPICS[other][1]), _mixed(rng, NEUTRAL, POSITIVE, 0.2))
    if quality == "repetitive":
        adjectives = POSITIVE if rng.random() < 0.5 else NEUTRAL
        # The short templates ("The {n} is {a}.", "My friend likes the {a} {n}."), said 3+ times, <= 20 words.
        sentence = _fill(rng, [rng.choice((TEMPLATES[0], TEMPLATES[6]))], nouns, adjectives)
        return " ".join([sentence] * rng.randint(3, max(3, MAX_WORDS // len(_words(sentence)))))
    if quality == "garbage":
        if rng.random() < 0.5:
            letters = "bcdfghjklmnpqrstvwxz"
            return " ".join(
                "".join(rng.choice(letters) for _ in range(rng.randint(3, 7)))
                for _ in range(rng.randint(3, 10))
            )
        return f"The {rng.choice(nouns)}."
    raise ValueError(
        f"unknown quality {quality!r}; valid: good, neutral, negative, offtopic, repetitive, garbage"
    )


def _weighted(rng: random.Random, mix: Sequence[tuple[object, float]]) -> object:
    return rng.choices([item for item, _ in mix], weights=[w for _, w in mix], k=1)[0]


def make_sft(cfg: DemoTaskConfig) -> list[SFTRecord]:
    """`cfg.n_sft` SFT examples of mixed quality (SFT_MIX)."""
    rng = random.Random(f"{cfg.seed}/sft")
    records = []
    for i in range(cfg.n_sft):
        topic = rng.choice(list(TOPICS))
        quality = _weighted(rng, SFT_MIX)
        records.append(
            SFTRecord(
                prompt=make_prompt(rng, topic),
                completion=make_completion(rng, topic, quality),
                id=f"sft-{i:06d}",
                topic=topic,
                quality=quality,
            )
        )
    return records


def make_preferences(cfg: DemoTaskConfig) -> list[PreferenceRecord]:
    """`cfg.n_preferences` pairs (PAIR_MIX), chosen = higher gold; round(label_noise * n) pairs swapped."""
    rng = random.Random(f"{cfg.seed}/preferences")
    records = []
    for i in range(cfg.n_preferences):
        topic = rng.choice(list(TOPICS))
        prompt = make_prompt(rng, topic)
        while True:
            first, second = _weighted(rng, PAIR_MIX)
            a, b = make_completion(rng, topic, first), make_completion(rng, topic, second)
            gap = gold_score(prompt, a) - gold_score(prompt, b)
            if abs(gap) >= MIN_GOLD_GAP:
                break
        chosen, rejected = (a, b) if gap > 0 else (b, a)
        records.append(
            PreferenceRecord(prompt=prompt, chosen=chosen, rejected=rejected, id=f"pref-{i:06d}", topic=topic)
        )
    n_noisy = round(cfg.label_noise * cfg.n_preferences)
    for i in rng.sample(range(cfg.n_preferences), n_noisy):
        r = records[i]
        records[i] = r.model_copy(update={"chosen": r.rejected, "rejected": r.chosen})
    return records


def make_prompts(cfg: DemoTaskConfig, held_out: bool = False) -> list[PromptRecord]:
    """RL prompts (training phrasings), or held-out eval prompts (phrasings no training prompt uses)."""
    n = cfg.n_eval_prompts if held_out else cfg.n_prompts
    rng = random.Random(f"{cfg.seed}/{'eval_prompts' if held_out else 'prompts'}")
    prefix = "eval" if held_out else "prompt"
    records = []
    for i in range(n):
        topic = rng.choice(list(TOPICS))
        records.append(
            PromptRecord(prompt=make_prompt(rng, topic, held_out), id=f"{prefix}-{i:06d}", topic=topic)
        )
    return records


def generate_demo_task(cfg: DemoTaskConfig, out_dir: str | Path) -> dict[str, Path]:
    """Write sft.jsonl, preferences.jsonl, prompts.jsonl and eval_prompts.jsonl; same cfg -> same bytes."""
    out_dir = Path(out_dir)
    return {
        "sft": write_jsonl(make_sft(cfg), out_dir / "sft.jsonl"),
        "preferences": write_jsonl(make_preferences(cfg), out_dir / "preferences.jsonl"),
        "prompts": write_jsonl(make_prompts(cfg), out_dir / "prompts.jsonl"),
        "eval_prompts": write_jsonl(make_prompts(cfg, held_out=True), out_dir / "eval_prompts.jsonl"),
    }


def demo_corpus(cfg: DemoTaskConfig, n_texts: int = 2000) -> list[str]:
    """Texts to train the tokenizer on: every prompt phrasing of every topic, then prompt + answer samples.

    About 1 in 10 samples is rendered in the fallback chat format ("User:\\n...\\nAssistant:\\n...")
    so chat-form data tokenizes compactly too.
    """
    rng = random.Random(f"{cfg.seed}/corpus")
    texts = [
        p.format(t=said) + s + PROMPT_END
        for _, (said, _) in TOPICS.items()
        for p, s in [
            *((p, s) for p in TRAIN_PHRASINGS for s in TRAIN_SUFFIXES),
            *((p, s) for p in EVAL_PHRASINGS for s in EVAL_SUFFIXES),
        ]
    ]
    qualities = [q for q, _ in SFT_MIX] + ["garbage"]
    for _ in range(n_texts):
        topic = rng.choice(list(TOPICS))
        prompt = make_prompt(rng, topic, held_out=rng.random() < 0.2)
        completion = make_completion(rng, topic, rng.choice(qualities))
        if rng.random() < 0.1:
            texts.append(
                render_messages_fallback([Message(role="user", content=prompt.strip())]) + completion
            )
        else:
            texts.append(prompt + completion)
    return texts
