"""Frozen reward models as the RL and evaluation stages use them: loaded from `reward_<name>` inputs, combined
as a weighted sum of z-scored scores.

What this is: the one definition of "the reward-model score" of a response, so PPO optimises exactly
the number evaluation reports. What it is not: reward-model training (stages/reward.py) or reward
shaping (KL penalty, clipping, normalisation: stages/ppo/).

The combination: reward model k scores sequence i as s_ki (its scalar head on the last token of
prompt + response, the same read-out as in training); its sidecar holds the mean m_k and std d_k of its
scores on held-out responses, so z_ki = (s_ki - m_k) / d_k puts every model on the same scale, and

    total_i = sum_k  weight_k * z_ki.

Where the caller gives each sequence's prompt length, sequences with the same prompt (GRPO's group
of completions) are scored with one copy of it (packing.pack's shared prompts): the prompt's tokens
go through each reward model once per group, not once per completion.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch

from alignflow.stages.common.runtime import StageContext, StageInputError
from alignflow.stages.common.tokenization import pad_right
from alignflow.stages.common.training import llama_forward
from alignflow.stages.common.training.packing import attention_width, pack, pack_sequences

REWARD_INPUT_PREFIX = "reward_"
SIDECAR = "alignflow_checkpoint.json"
# A score std below this means the model gives (almost) every response the same score: z-scoring would
# multiply noise by > 1e6, so such a checkpoint is refused rather than silently dominating the sum.
MIN_SCORE_STD = 1e-6


@dataclass
class RewardModel:
    """One frozen reward model and how its score enters the total."""

    name: str
    weight: float
    mean: float  # score mean on held-out responses (from the reward stage)
    std: float  # score std on held-out responses
    model: Any  # a Hugging Face sequence classifier with num_labels=1, in eval mode, no grad


class RewardScores(NamedTuple):
    """Per-model z-scored scores (name -> [N] float32) and their weighted sum [N];
    unpacks as (per_model, total)."""

    per_model: dict[str, torch.Tensor]
    total: torch.Tensor


def reward_input_names(inputs: dict[str, str]) -> list[str]:
    """The spec's reward-model input names (`reward_<name>`),
    sorted so the order never depends on the spec."""
    return sorted(k for k in inputs if k.startswith(REWARD_INPUT_PREFIX))


def read_sidecar(folder: Path, input_name: str) -> tuple[str, float, float, float]:
    """(name, weight, score_mean, score_std) from a reward checkpoint's sidecar; errors say what is wrong."""
    path = Path(folder) / SIDECAR
    if not path.is_file():
        raise StageInputError(
            f"input '{input_name}' ({folder}) has no {SIDECAR}; it must be a reward stage output"
        )
    meta = json.loads(path.read_text())
    missing = [k for k in ("score_mean", "score_std") if k not in meta]
    if missing:
        raise StageInputError(
            f"{path} lacks {', '.join(missing)}; re-run the reward stage, which writes them"
        )
    name = str(meta.get("name") or input_name.removeprefix(REWARD_INPUT_PREFIX))
    weight, mean, std = float(meta.get("weight", 1.0)), float(meta["score_mean"]), float(meta["score_std"])
    if not (math.isfinite(mean) and math.isfinite(std)) or std < MIN_SCORE_STD:
        raise StageInputError(
            f"{path}: score_mean={mean}, score_std={std}; a usable reward model has a finite "
            f"mean and a std >= {MIN_SCORE_STD} (its scores must differ between responses): "
            "retrain it (more steps, another reward.lr)"
        )
    return name, weight, mean, std


def load_reward_models(
    ctx: StageContext,
    *,
    dtype: str | None = None,
    device: str | torch.device | None = None,
    tokenizer: Any = None,
) -> list[RewardModel]:
    """Every `reward_<name>` input of the stage, frozen, in input-name order.

    dtype: None reads the spec's `model.dtype` (float32 when absent). device: None picks CUDA when
    available. tokenizer: when given, each reward model's saved vocabulary must equal it, since token
    ids are fed to the reward models unchanged.
    """
    from alignflow.stages.common.models.loading import load_sequence_classifier, load_tokenizer

    names = reward_input_names(ctx.spec.inputs)
    if not names:
        raise StageInputError(
            f"stage '{ctx.spec.stage}' needs at least one '{REWARD_INPUT_PREFIX}<name>' input "
            f"(a reward stage output); spec inputs: {sorted(ctx.spec.inputs) or 'none'}"
        )
    if dtype is None:
        dtype = (ctx.spec.config.get("model") or {}).get("dtype", "float32")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    models, seen = [], set()
    for input_name in names:
        folder = ctx.input(input_name)
        name, weight, mean, std = read_sidecar(folder, input_name)
        if name in seen:
            raise StageInputError(
                f"two reward inputs are both named '{name}'; give each reward model a unique name"
            )
        seen.add(name)
        if tokenizer is not None and load_tokenizer(folder).get_vocab() != tokenizer.get_vocab():
            raise StageInputError(
                f"reward model '{name}' ({folder}) has a different tokenizer than the policy; "
                "train reward models from the same SFT checkpoint as the policy"
            )
        model = load_sequence_classifier(folder, dtype=dtype).to(device).eval().requires_grad_(False)
        models.append(RewardModel(name=name, weight=weight, mean=mean, std=std, model=model))
    return models


def _read_out_positions(sequences: list[list[int]], pad_id: int) -> list[int]:
    """transformers' sequence-classifier read-out: the index of each sequence's last token that is not
    `pad_id` (0 when every token is), as it finds it in right-padded rows (a trailing pad-id token, e.g. an
    EOS that doubles as the pad token, is skipped)."""
    return [next((i for i in range(len(s) - 1, -1, -1) if s[i] != pad_id), 0) for s in sequences]


def _prompt_response_rows(
    sequences: list[list[int]], prompt_lengths: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, response_mask, prompt_width): the sequences split at their prompt
    lengths into packing.pack's `[left-padded prompt | right-padded response]` layout."""
    width_p = max(prompt_lengths)
    width_r = max(1, max(len(s) - p for s, p in zip(sequences, prompt_lengths, strict=True)))
    input_ids = torch.zeros((len(sequences), width_p + width_r), dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (sequence, prompt) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        first = width_p - prompt
        input_ids[row, first : first + len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        attention_mask[row, first : first + len(sequence)] = 1
    return input_ids, attention_mask, attention_mask[:, width_p:], width_p


def _packed_scores(
    model: Any,
    sequences: list[list[int]],
    pad_id: int,
    device: torch.device,
    prompt_lengths: list[int] | None = None,
) -> torch.Tensor:
    """[N] scores through llama_forward on packed rows (stages/common/training/packing.py), the score head on
    the read-out positions only: transformers' forward pads every sequence to the longest and runs the head on
    every position.

    prompt_lengths: sequences with the same prompt share one copy of it (packing.pack); a read-out
    that falls in the prompt (an empty or all-pad response) is read from that copy, whose hidden
    states are every sharing sequence's, attention being causal.
    """
    read = torch.tensor(_read_out_positions(sequences, pad_id), dtype=torch.long)
    if prompt_lengths is None:
        packed = pack_sequences(sequences)
        at, prefix_ids = packed.starts + read, None
    else:
        packed = pack(
            *_prompt_response_rows(sequences, prompt_lengths),
            share_prompts=True,
            width_of_attention=attention_width(model.config.hidden_size),
            compact_from=llama_forward.compact_min_padding(model.config.hidden_size),
        )
        at = packed.slots_of(read, torch.tensor(prompt_lengths, dtype=torch.long))
        prefix_ids = None if packed.prefix_ids is None else packed.prefix_ids.to(device)
    hidden = llama_forward.llama_hidden_states(
        model.model,
        packed.input_ids.to(device),
        packed.segment_ids.to(device),
        packed.position_ids.to(device),
        keep=at.to(device),
        prefix_ids=prefix_ids,
    )
    return model.score(hidden).squeeze(-1).float().cpu()


def _group_chunks(
    sequences: list[list[int]], prompt_lengths: list[int], batch_size: int
) -> list[list[int]]:
    """Indices of the sequences in chunks of at most `batch_size`, each group of sequences with the
    same prompt whole in one chunk (a group larger than batch_size in as few chunks as it needs): a
    group split across chunks needs a prompt copy in each. Groups in order of first appearance, a
    chunk taking groups while they fit."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index, (sequence, prompt) in enumerate(zip(sequences, prompt_lengths, strict=True)):
        groups.setdefault(tuple(sequence[:prompt]), []).append(index)
    chunks: list[list[int]] = []
    chunk: list[int] = []
    for members in groups.values():
        for first in range(0, len(members), batch_size):
            part = members[first : first + batch_size]
            if chunk and len(chunk) + len(part) > batch_size:
                chunks.append(chunk)
                chunk = []
            chunk.extend(part)
    if chunk:
        chunks.append(chunk)
    return chunks


def runs_packed(model: Any, pad_id: int) -> bool:
    """Whether raw_scores takes the packed llama_forward path for this model: a transformers Llama-family
    classifier llama_forward supports, whose config pads with `pad_id` (the read-out transformers would
    make)."""
    backbone = getattr(model, "model", None)
    return (
        backbone is not None
        and hasattr(model, "score")
        and getattr(model.config, "pad_token_id", None) == pad_id
        and llama_forward.supports(backbone) is None
    )


@torch.no_grad()
def raw_scores(
    model: Any,
    sequences: list[list[int]],
    pad_id: int,
    batch_size: int = 64,
    packed: bool | None = None,
    prompt_lengths: list[int] | None = None,
) -> torch.Tensor:
    """[N] float32 scalar scores of token sequences, read out as in reward training (stages/reward.score: the
    last non-pad token of right-padded rows).

    packed: None runs llama_forward on packed rows where `runs_packed` says it reads out what transformers'
    forward would (faster: fewer operator calls, no padding); False forces transformers' forward
    on the padded rows (the reference). Equal up to float summation order. Every sequence must be non-empty.
    prompt_lengths: [N] how many of each sequence's first tokens are its prompt (at least 1); on the
    packed path, sequences with the same prompt then share one copy of it (_packed_scores), in
    chunks of _group_chunks. The padded path reads no prompt lengths.
    batch_size: the most sequences in one forward, which bounds its activations' memory.
    """
    if any(len(s) == 0 for s in sequences):
        raise ValueError("cannot score an empty sequence; every sequence needs at least the prompt's tokens")
    if prompt_lengths is not None:
        if len(prompt_lengths) != len(sequences):
            raise ValueError(
                f"{len(prompt_lengths)} prompt lengths for {len(sequences)} sequences; "
                "give one per sequence"
            )
        pairs = zip(sequences, prompt_lengths, strict=True)
        wrong = next((i for i, (s, p) in enumerate(pairs) if not 1 <= p <= len(s)), None)
        if wrong is not None:
            raise ValueError(
                f"sequence {wrong} ({len(sequences[wrong])} tokens) has prompt length "
                f"{prompt_lengths[wrong]}; a prompt length is between 1 and the sequence's length"
            )
    if packed is None:
        packed = runs_packed(model, pad_id)
    device = next(model.parameters()).device
    if packed and prompt_lengths is not None:
        scores = torch.zeros(len(sequences))
        for chunk in _group_chunks(sequences, prompt_lengths, batch_size):
            part, lengths = [sequences[i] for i in chunk], [prompt_lengths[i] for i in chunk]
            scores[chunk] = _packed_scores(model, part, pad_id, device, lengths)
        return scores
    out = []
    for start in range(0, len(sequences), batch_size):
        part = sequences[start : start + batch_size]
        if packed:
            out.append(_packed_scores(model, part, pad_id, device))
            continue
        input_ids = pad_right(part, pad_id).to(device)
        attention_mask = pad_right([[1] * len(s) for s in part], 0).to(device)
        out.append(model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float().cpu())
    return torch.cat(out) if out else torch.zeros(0)


def combine(models: list[RewardModel], raw: dict[str, torch.Tensor]) -> RewardScores:
    """z-score each model's raw scores with its held-out mean/std and sum them with the models' weights."""
    per_model = {m.name: (raw[m.name] - m.mean) / m.std for m in models}
    total = torch.zeros_like(next(iter(per_model.values())))
    for m in models:
        total = total + m.weight * per_model[m.name]
    return RewardScores(per_model, total)


def score_with_reward_models(
    models: list[RewardModel],
    sequences: list[list[int]],
    pad_id: int,
    batch_size: int = 64,
    prompt_lengths: list[int] | None = None,
) -> RewardScores:
    """Score prompt+response token sequences ([N] lists) with every model: (per-model z-scores, weighted
    total). prompt_lengths: [N] each sequence's prompt length, so that sequences with one prompt
    share it (raw_scores).

    Returns float32 CPU tensors of shape [N]; the dict is a fresh one the caller may extend.
    """
    if not models:
        raise ValueError("score_with_reward_models needs at least one reward model")
    raw = {
        m.name: raw_scores(m.model, sequences, pad_id, batch_size, prompt_lengths=prompt_lengths)
        for m in models
    }
    return combine(models, raw)
