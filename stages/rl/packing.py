"""Sequence packing for the RL forwards: the rows of an Experience laid end to end in fewer rows, no padding in between.

Why: the `[left-padded prompt | right-padded response]` layout pads every row to the longest prompt plus
the longest response; on the demo config a minibatch of 16 rows is 28-37% padding (real 493-551 of
720-784 token slots), and every linear layer computes on it. Packed, the same tokens take
ceil-ish(real / W) rows of W = the longest real sequence (first-fit decreasing), and the LM head or value
head sees only the positions that predict a response token.

Exactness: each sequence keeps its own positions (0..n-1, as the padded layout's position ids) and sees
only its own earlier tokens (`segment_ids`: llama_forward's attention masks keys of other sequences), so
every real position computes what it computes padded, up to float summation order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class PackedRows:
    """The packed layout of B sequences, and where each response token's prediction lands."""

    input_ids: Tensor      # (rows, W) long; 0 where no sequence is
    position_ids: Tensor   # (rows, W) long: 0..n-1 within each sequence
    segment_ids: Tensor    # (rows, W) long: 1 + the sequence's row in the Experience; 0 where no sequence is
    predicts: Tensor       # (N,) long: flat index into (rows * W) of the position predicting each response token
    targets: Tensor        # (N,) long: flat index into (B * R) of that response token
    shape: tuple[int, int]  # (B, R)

    def scatter(self, per_token: Tensor) -> Tensor:
        """(N,) values in `predicts` order -> (B, R), zero on response padding (differentiable)."""
        out = per_token.new_zeros(self.shape[0] * self.shape[1])
        return out.index_put((self.targets,), per_token).view(self.shape)


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """(bin, offset) per item: items longest first into the first bin with room (ties keep input order)."""
    placed: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    used: list[int] = []
    for item in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        n = lengths[item]
        if n > capacity:
            raise ValueError(f"a sequence of {n} tokens does not fit rows of {capacity}")
        slot = next((b for b, fill in enumerate(used) if fill + n <= capacity), len(used))
        if slot == len(used):
            used.append(0)
        placed[item] = (slot, used[slot])
        used[slot] += n
    return placed


# Row width at which a position's attention costs about as much as its linear layers, in the cost model
# rows * W * (1 + W / ATTENTION_WIDTH) that picks W: wider rows mean fewer half-empty rows but every
# query attends to more keys (CPU SDPA computes the masked-out pairs too). On the demo's minibatches
# (16 rows, 493-551 real tokens, longest 47-49) one actor step, fwd+bwd, 1 thread, median of 30:
# 22-26 ms padded (16 x 49), 18-26 ms at W 47 (15 rows), 16-17 ms at W 64 (10 rows), 24-26 ms at W 96
# (7 rows); this constant makes W 64 the cheapest there.
ATTENTION_WIDTH = 128


def choose_capacity(lengths: list[int]) -> int:
    """The row width, from the longest sequence to twice it, that minimises the cost model above."""
    longest = max(lengths)
    best: tuple[float, int] | None = None
    for width in range(longest, 2 * longest + 1, max(1, longest // 8)):
        rows = 1 + max(b for b, _ in first_fit_decreasing(lengths, width))
        cost = rows * width * (1 + width / ATTENTION_WIDTH)
        if best is None or cost < best[0]:
            best = (cost, width)
    assert best is not None
    return best[1]


def _ragged(lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(row, index within the row) of every item of rows with these lengths, in row-major order."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return rows, torch.arange(int(lengths.sum())) - (lengths.cumsum(0) - lengths)[rows]


def _layout(lengths: Tensor, capacity: int | None) -> tuple[int, int, Tensor, Tensor, Tensor]:
    """Sequences of these lengths placed in rows: (capacity, rows, start, owner, within), where start[b] is the
    flat slot (row * capacity + column) of sequence b's first token and owner/within (_ragged) name every token."""
    capacity = capacity or choose_capacity(lengths.tolist())
    if capacity < int(lengths.max()):
        raise ValueError(f"capacity {capacity} is less than the longest sequence ({int(lengths.max())} tokens)")
    placed = torch.tensor(first_fit_decreasing(lengths.tolist(), capacity), dtype=torch.long).view(-1, 2)
    owner, within = _ragged(lengths)
    return capacity, int(placed[:, 0].max()) + 1, placed[:, 0] * capacity + placed[:, 1], owner, within


def _rows(values: Tensor, slot: Tensor, rows: int, capacity: int) -> Tensor:
    """(rows, capacity) long: `values` at the flat `slot`s, 0 elsewhere."""
    return torch.zeros(rows * capacity, dtype=torch.long).index_put_((slot,), values).view(rows, capacity)


def pack(input_ids: Tensor, attention_mask: Tensor, response_mask: Tensor, prompt_width: int,
         capacity: int | None = None) -> PackedRows:
    """Pack the `[left-padded prompt | right-padded response]` rows (experience.assemble's layout).

    Every row needs at least one prompt token (the position that predicts its first response token).
    capacity: the packed rows' width (default: choose_capacity).
    """
    device = input_ids.device
    input_ids, attention_mask, response_mask = input_ids.cpu(), attention_mask.cpu(), response_mask.cpu()
    width = input_ids.shape[1]
    response_width = response_mask.shape[1]
    prompt_lengths = attention_mask[:, :prompt_width].sum(-1).long()
    response_lengths = response_mask.sum(-1).long()
    if bool((prompt_lengths == 0).any()):
        row = int((prompt_lengths == 0).nonzero()[0])
        raise ValueError(f"row {row} has no prompt token: nothing predicts its first response token")
    capacity, rows, start, owner, within = _layout(prompt_lengths + response_lengths, capacity)
    # Every real token: row r's are the contiguous columns [P - prompt_len, P + response_len) of the padded layout.
    source = owner * width + (prompt_width - prompt_lengths)[owner] + within
    slot = start[owner] + within
    # Response token t of row r is predicted by its sequence's position prompt_len - 1 + t.
    speaker, t = _ragged(response_lengths)
    predicts = start[speaker] + prompt_lengths[speaker] - 1 + t
    return PackedRows(input_ids=_rows(input_ids.reshape(-1)[source], slot, rows, capacity).to(device),
                      position_ids=_rows(within, slot, rows, capacity).to(device),
                      segment_ids=_rows(owner + 1, slot, rows, capacity).to(device), predicts=predicts.to(device),
                      targets=(speaker * response_width + t).to(device), shape=(input_ids.shape[0], response_width))


@dataclass(frozen=True)
class PackedSequences:
    """Whole token sequences packed end to end (no prompt/response split): what a reward model reads."""

    input_ids: Tensor      # (rows, W) long; 0 where no sequence is
    position_ids: Tensor   # (rows, W) long: 0..n-1 within each sequence
    segment_ids: Tensor    # (rows, W) long: 1 + the sequence's index; 0 where no sequence is
    starts: Tensor         # (B,) long: flat index into (rows * W) of each sequence's first token


def pack_sequences(sequences: list[list[int]], capacity: int | None = None) -> PackedSequences:
    """Pack non-empty token lists into rows of `capacity` (default: choose_capacity), on the CPU."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    if bool((lengths == 0).any()):
        raise ValueError(f"sequence {int((lengths == 0).nonzero()[0])} is empty: there is nothing to pack")
    capacity, rows, start, owner, within = _layout(lengths, capacity)
    slot = start[owner] + within
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    return PackedSequences(input_ids=_rows(tokens, slot, rows, capacity), position_ids=_rows(within, slot, rows, capacity),
                           segment_ids=_rows(owner + 1, slot, rows, capacity), starts=start)
