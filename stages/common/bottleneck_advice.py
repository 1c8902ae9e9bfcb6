"""What to try when one phase dominates a stage's time: advice chosen by the phase's name and the run's facts.

What it is: the sentence after "train is 66% of each iteration:" in a stage's summary and profile report
(stages/common/profiler.py finds the dominant phase, this module says what to try about it). A stage records
what it runs with in `RunFacts` (the trainer's minibatches, ZeRO stage and precision, the engine and how
many calls a rollout batch takes), and the advice names only the knobs that are still open: a CPU without bf16
arithmetic is not told to try bf16, a one-rank run without ZeRO is not told to lower its ZeRO stage. Where
every knob is in place, it says so and points inside the phase. A fact left None is unknown, and the
suggestion that hangs on it is kept, so a stage that records nothing gets the general advice.

What it is not: a measurement. Which op dominates inside a phase is torch.profiler's or py-spy's to say.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class RunFacts:
    """What a stage runs with, as far as the advice needs it; None: not recorded."""

    train_device: str | None = None  # "cpu" | "cuda"
    train_dtype: str | None = None  # the training forward's compute dtype: "float32", "bfloat16" (autocast)
    bf16_arithmetic: bool | None = None  # the training device computes in bf16 natively (precision.py)
    zero_stage: int | None = None  # DeepSpeed ZeRO stage; 0 also for the plain torch trainer
    minibatches: int | None = None  # per epoch: the optimizer steps that a larger minibatch size would merge
    engine_backend: str | None = None  # engine.backend: "native" | "hf" | "vllm" | "tensorrt-llm"
    generate_device: str | None = None
    cuda_graphs: bool | None = None  # engine.cuda_graphs (the native engine on a GPU)
    generate_calls: int | None = None  # engine calls one iteration's rollouts take (engine.max_batch_size)


GENERIC_ADVICE = "profile inside it (torch.profiler) to see which op dominates"


def _either(options: list[str]) -> str:
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


def _training(facts: RunFacts) -> str:
    options = []
    if facts.minibatches is None or facts.minibatches > 1:
        now = f"; {facts.minibatches} an epoch now" if facts.minibatches else ""
        options.append(f"larger minibatches (fewer optimizer steps{now})")
    if facts.zero_stage is None or facts.zero_stage >= 2:
        options.append("a lower ZeRO stage (less gather/scatter traffic)")
    if facts.train_dtype in (None, "float32") and facts.bf16_arithmetic is not False:
        options.append("bf16")
    if options:
        return "try " + _either(options)
    in_place = [
        "one minibatch an epoch",
        f"ZeRO stage {facts.zero_stage}" if facts.zero_stage else "no ZeRO sharding",
        f"float32 on a {facts.train_device or 'device'} without bf16 arithmetic"
        if facts.train_dtype == "float32" else str(facts.train_dtype),
    ]
    return f"the usual knobs are in place ({', '.join(in_place)}): {GENERIC_ADVICE}"


def _generation(facts: RunFacts) -> str:
    options = []
    if facts.engine_backend in (None, "hf"):
        options.append("the native engine")
    if facts.generate_calls is None or facts.generate_calls > 1:
        calls = f"; {facts.generate_calls} engine calls an iteration now" if facts.generate_calls else ""
        options.append(f"larger rollout batches (engine.max_batch_size{calls})")
    if facts.generate_device is None:
        options.append("CUDA graphs on GPU")
    elif facts.generate_device == "cuda" and facts.engine_backend == "native" and not facts.cuda_graphs:
        options.append("CUDA graphs (engine.cuda_graphs)")
    if options:
        return "try " + _either(options)
    return (f"the {facts.engine_backend} engine already takes every rollout in one call: profile the engine "
            "(benchmarks/engine_throughput.py, torch.profiler or py-spy) to see where a decode step goes")


def _fixed(text: str) -> Callable[[RunFacts], str]:
    return lambda facts: text


# Phase-name keywords -> what to try. A keyword matches the start of a word of the name ("write_rollouts"
# has the words "write" and "rollouts"); the first matching entry wins, so "refit" comes before "ref",
# "logprob" before "log", and I/O before generation ("write_rollouts" is I/O, not generation).
PHASE_ADVICE: tuple[tuple[tuple[str, ...], Callable[[RunFacts], str]], ...] = (
    (("refit", "sync", "weights", "broadcast"), _fixed(
        "refit should copy weights in place: check the engine is not rebuilt each iteration, and on several "
        "GPUs broadcast in large buckets")),
    (("logprob", "ref", "value", "old"), _fixed(
        "run these no-grad forward passes in larger batches and in bf16, or share one pass for reference and "
        "old-policy log-probs")),
    (("io", "write", "save", "checkpoint", "upload", "download", "publish", "log", "data"), _fixed(
        "I/O: write rollouts and checkpoints less often or from a background thread, and keep the object "
        "store close to the compute")),
    (("generat", "rollout", "sampl"), _generation),
    (("train", "update", "actor", "critic", "backward", "optim", "step"), _training),
    (("scor", "reward"), _fixed("score in larger batches, or use fewer or smaller reward models")),
    (("kl",), _fixed(
        "the KL estimate is two full forward passes: evaluate it on fewer prompts or in larger batches")),
    (("load", "build", "init", "setup"), _fixed(
        "start-up cost: it is paid once, so it only matters for short runs; cache built engines and "
        "downloaded checkpoints")),
)


def advice_for(phase: str, facts: RunFacts | None = None) -> str:
    """What to try when `phase` dominates, chosen by keywords in its name (GENERIC_ADVICE otherwise) and
    narrowed to what `facts` leave open."""
    words = [w for w in re.split(r"[^a-z0-9]+", phase.lower()) if w]
    for keywords, advice in PHASE_ADVICE:
        if any(w.startswith(k) for w in words for k in keywords):
            return advice(facts or RunFacts())
    return GENERIC_ADVICE
