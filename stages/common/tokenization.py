"""How text becomes token ids, the same way in every stage: prompt = BOS + rendered prompt, completion + EOS.

SFT, reward training, the engine and the RL stage all encode through these functions, so a
prompt seen in training is tokenised exactly as it is when the policy generates for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100  # label value that cross-entropy skips (prompt and padding positions)


def encode_prompt(tokenizer, prompt_text: str) -> list[int]:
    """BOS (when the tokenizer has one) followed by the prompt's tokens, no special tokens added."""
    ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    bos = tokenizer.bos_token_id
    return ([bos] if bos is not None else []) + list(ids)


def encode_completion(tokenizer, completion: str, add_eos: bool = True) -> list[int]:
    ids = list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("tokenizer has no eos_token; set one so completions can end")
        ids.append(tokenizer.eos_token_id)
    return ids


@dataclass
class Encoded:
    """One prompt+completion example: token ids and per-token labels (IGNORE_INDEX on the prompt)."""

    input_ids: list[int]
    labels: list[int]
    truncated: bool


def encode_example(tokenizer, prompt_text: str, completion: str, max_length: int) -> Encoded:
    """Encode for training with the loss on completion tokens only;
    over-long examples are cut on the right."""
    prompt_ids = encode_prompt(tokenizer, prompt_text)
    completion_ids = encode_completion(tokenizer, completion)
    ids = prompt_ids + completion_ids
    labels = [IGNORE_INDEX] * len(prompt_ids) + completion_ids
    truncated = len(ids) > max_length
    return Encoded(ids[:max_length], labels[:max_length], truncated)


def pad_right(sequences: list[list[int]], pad_value: int) -> torch.Tensor:
    """[B, T_max] long tensor, right-padded with `pad_value`."""
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    for row, seq in enumerate(sequences):
        out[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
    return out


def collate_lm(batch: list[Encoded], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask and labels, each [B, T_max], right-padded."""
    input_ids = pad_right([e.input_ids for e in batch], pad_id)
    labels = pad_right([e.labels for e in batch], IGNORE_INDEX)
    attention_mask = pad_right([[1] * len(e.input_ids) for e in batch], 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def pad_token_id(tokenizer) -> int:
    """The pad id; falls back to EOS for tokenizers that have no pad token (attention masks hide it)."""
    if tokenizer.pad_token_id is not None:
        return int(tokenizer.pad_token_id)
    if tokenizer.eos_token_id is not None:
        return int(tokenizer.eos_token_id)
    raise ValueError("tokenizer has neither pad_token nor eos_token; set one")
