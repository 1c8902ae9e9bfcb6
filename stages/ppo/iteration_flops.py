"""The model FLOPs of each phase of one RL iteration, and the rates and MFU they give (flops/*, perf/*).

An iteration's sequences are prompts (shared by a group's completions) and completions. What each phase must
compute, at the least, whatever the implementation:

    generate      the actor over each distinct prompt once (the prefill), then over every completion's
                  tokens but the last (each decode step feeds the token sampled before it); the LM head on
                  each distinct prompt's last position and on every fed completion token
    score         each reward model over each distinct prompt once and every completion whole
    reference     the reference (the actor's shape) over each distinct prompt once and every completion but
    old_logprobs  its last token (the last token is predicted, never fed), the LM head on every response
                  token; the same for the actor's old log-probs when they are recomputed
    values        the critic over the same positions (its scalar head left out)
    train         per epoch a training step (3 forwards) of the actor's pass and, for PPO, the critic's

A model whose architecture model_flops cannot describe (not the Llama family) gives no figure: its phase's
flops are left out rather than guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from alignflow.stages.common.generation.interface import UnsupportedArchitectureError
from alignflow.stages.common.generation.native.spec import LlamaFamilySpec, spec_from_hf_config
from alignflow.stages.common.model_flops import Span, gpu_peak_tflops, spans_flops, training_flops


def spec_of(config: Any) -> LlamaFamilySpec | None:
    """The architecture numbers of an HF config, or None where model_flops cannot count it."""
    try:
        return spec_from_hf_config(config, getattr(config, "max_position_embeddings", 0) or 1)
    except (UnsupportedArchitectureError, ValueError, TypeError, AttributeError):
        return None


@dataclass(frozen=True)
class IterationShape:
    """The sequences of one iteration: the distinct prompts' lengths and each completion's (prompt, response)
    lengths."""

    prompt_lengths: list[int]               # one per distinct prompt
    completions: list[tuple[int, int]]      # (prompt length, response length) per row

    @classmethod
    def of(cls, prompt_indices: list[int], prompt_ids: list[list[int]], response_lengths: list[int]
           ) -> IterationShape:
        distinct: dict[int, int] = {}
        for index, ids in zip(prompt_indices, prompt_ids, strict=True):
            distinct.setdefault(index, len(ids))
        return cls(list(distinct.values()),
                   [(len(ids), n) for ids, n in zip(prompt_ids, response_lengths, strict=True)])

    def prompt_spans(self) -> list[Span]:
        return [(0, p) for p in self.prompt_lengths]

    def fed_spans(self) -> list[Span]:
        """Every completion's positions but its last token's (fed to predict the next; the last never is)."""
        return [(p, p + r - 1) for p, r in self.completions if r > 1]

    @property
    def response_tokens(self) -> int:
        return sum(r for _, r in self.completions)


def generate_flops(actor: LlamaFamilySpec, shape: IterationShape) -> float:
    """The prefill of each distinct prompt and the decode steps of every completion."""
    head_rows = len(shape.prompt_lengths) + sum(max(r - 1, 0) for _, r in shape.completions)
    return spans_flops(actor, shape.prompt_spans() + shape.fed_spans(), head_rows)


def score_flops(reward_model: LlamaFamilySpec, shape: IterationShape) -> float:
    """A reward model reading every completion whole (its score is read at the last token)."""
    whole = [(p, p + r) for p, r in shape.completions]
    return spans_flops(reward_model, shape.prompt_spans() + whole, 0)


def pass_flops(model: LlamaFamilySpec, shape: IterationShape, lm_head: bool = True) -> float:
    """One forward that reads the log-prob (lm_head) or the value of every response token."""
    head_rows = shape.response_tokens if lm_head else 0
    return spans_flops(model, shape.prompt_spans() + shape.fed_spans(), head_rows)


@dataclass(frozen=True)
class IterationModels:
    """The architectures of the models an iteration runs (None: not countable)."""

    actor: LlamaFamilySpec | None
    critic: LlamaFamilySpec | None          # PPO; None for GRPO or where not countable
    reward_models: list[LlamaFamilySpec | None]
    has_critic: bool                        # PPO: False makes a missing critic spec mean "no critic"


def phase_flops(models: IterationModels, shape: IterationShape, epochs: int, ran: set[str],
                trained_twice: bool = False) -> dict[str, float]:
    """'flops/<phase>' for each phase in `ran` whose models are all countable. trained_twice: the epochs ran
    again after stale old log-probs were recomputed inside the train phase (_update_models)."""
    actor, critic = models.actor, models.critic
    out: dict[str, float] = {}
    if actor is not None:
        if "generate" in ran:
            out["flops/generate"] = generate_flops(actor, shape)
        for phase in ("reference", "old_logprobs"):
            if phase in ran:
                out[f"flops/{phase}"] = pass_flops(actor, shape)
    if critic is not None and "values" in ran:
        out["flops/values"] = pass_flops(critic, shape, lm_head=False)
    if "score" in ran and models.reward_models and None not in models.reward_models:
        out["flops/score"] = sum(score_flops(m, shape) for m in models.reward_models if m is not None)
    if "train" in ran and actor is not None and (critic is not None or not models.has_critic):
        step = training_flops(pass_flops(actor, shape))
        if critic is not None:
            step += training_flops(pass_flops(critic, shape, lm_head=False))
        train = epochs * step
        if trained_twice:  # the old log-probs' forward, then every epoch again
            train = 2 * train + pass_flops(actor, shape)
        out["flops/train"] = train
    return out


def rates(flops: dict[str, float], timings: dict[str, float], iteration_seconds: float) -> dict[str, float]:
    """'perf/tflops/<phase>' (model TFLOP/s over the phase's seconds) for each counted phase that took time,
    and 'perf/tflops/iteration' (all counted phases over the iteration's wall time)."""
    out = {}
    for key, value in flops.items():
        phase = key.removeprefix("flops/")
        seconds = timings.get(f"timing/{phase}", 0.0)
        if seconds > 0:
            out[f"perf/tflops/{phase}"] = value / seconds / 1e12
    if flops and iteration_seconds > 0:
        out["perf/tflops/iteration"] = sum(flops.values()) / iteration_seconds / 1e12
    return out


def train_peak_tflops(device: torch.device, compute_dtype: torch.dtype) -> float | None:
    """The peak TFLOP/s one training device reaches in `compute_dtype` (autocast's, else the weights'): a
    known GPU's data-sheet figure, fp32 matmuls at the TF32 rate where torch allows TF32; None on a CPU (its
    peak depends on the part and its clocks: benchmarks/rl_ladder.py measures it) or an unknown GPU."""
    if device.type != "cuda":
        return None
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(compute_dtype)
    if name is None:
        name = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32"
    return gpu_peak_tflops(torch.cuda.get_device_name(device), name)


def iteration_metrics(models: IterationModels, shape: IterationShape, epochs: int, ran: set[str],
                      timings: dict[str, float], iteration_seconds: float, train_peak: float | None,
                      ranks: int = 1, trained_twice: bool = False) -> dict[str, float]:
    """flops/<phase> (model FLOPs), perf/tflops/<phase> and perf/tflops/iteration, and perf/mfu/train (the
    train phase's rate over `ranks` devices of `train_peak` each) where the peak is known. timings: the
    iteration's timing/<phase> seconds; generation's rate is taken over the engine's own time
    (timing/generate_engine), since the generate phase is only the wait for it under async rollouts."""
    flops = phase_flops(models, shape, epochs, ran, trained_twice)
    seconds = {**timings, "timing/generate": timings.get("timing/generate_engine", 0.0)}
    out = {**flops, **rates(flops, seconds, iteration_seconds)}
    if train_peak and "perf/tflops/train" in out:
        out["perf/mfu/train"] = out["perf/tflops/train"] / (ranks * train_peak)
    return out
