"""Sequence packing for the RL forwards: an Experience's rows end to end in fewer rows, no padding between.

Why: the `[left-padded prompt | right-padded response]` layout pads every row to the longest prompt plus
the longest response; on the demo config a minibatch of 16 rows is 28-37% padding (real 493-551 of
720-784 token slots), and every linear layer computes on it. Packed, the same tokens take
ceil-ish(real / W) rows of W = the longest real sequence (first-fit decreasing), and the LM head or value
head sees only the positions that predict a response token. The padding the rows still hold (a PPO
minibatch of benchmarks/rl_ladder.py: 625 tokens in 720 slots) reaches attention only: llama_forward's
`compact` runs the linear layers on the real tokens.

Exactness: each sequence keeps its own positions (0..n-1, as the padded layout's position ids) and sees
only its own earlier tokens (`segment_ids`: llama_forward's attention masks keys of other sequences), so
every real position computes what it computes padded, up to float summation order.

Shared prompts: rows with the same prompt (GRPO samples a group of completions per prompt) can share one
copy of it, each response attending to the prompt and to itself at the positions it has padded (pack's
share_prompts). Causal attention makes a prompt's hidden states independent of what follows, so the
result is the same; the gradient through the prompt's positions sums the group's, as the padded layout's
copies do. benchmarks/packing_layouts.py's GRPO minibatch (4 prompts of 24-36 tokens x 4 completions of 32)
holds 635 tokens instead of 1,004. The reward models score a group in the same layout
(stages/common/reward_scoring.py), reading each sequence's last token where `slots_of` finds it.
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
    predicts: Tensor       # (N,) long: flat (rows * W) index of the position predicting each response token
    targets: Tensor        # (N,) long: flat index into (B * R) of that response token
    shape: tuple[int, int]  # (B, R)
    # (B,) long: flat slot of each row's first prompt token (its unit's copy, where rows share one)
    # and of its first response token (where it would be, for an empty response): a position of the
    # row's sequence is then at `slots_of` (a classifier's read-out)
    prompt_starts: Tensor
    response_starts: Tensor
    # (rows, W) long, where rows share a prompt (pack's share_prompts): the segment each position may also
    # attend to, its shared prompt's (a shared prompt's own segment is 1 + B + its unit); None: none shared
    prefix_ids: Tensor | None = None

    def scatter(self, per_token: Tensor) -> Tensor:
        """(N,) values in `predicts` order -> (B, R), zero on response padding (differentiable)."""
        out = per_token.new_zeros(self.shape[0] * self.shape[1])
        return out.index_put((self.targets,), per_token).view(self.shape)

    def slots_of(self, positions: Tensor, prompt_lengths: Tensor) -> Tensor:
        """(B,) flat slot of position positions[b] of each row's sequence (its prompt's tokens, then
        its response's, no padding), given the rows' (B,) prompt lengths: in the prompt's copy for a
        position in the prompt, in the row's own response for a later one."""
        return torch.where(
            positions < prompt_lengths,
            self.prompt_starts + positions,
            self.response_starts + positions - prompt_lengths,
        )


def first_fit_decreasing(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """(bin, offset) per item: items longest first into the first bin with room (ties keep input order)."""
    placed: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    used: list[int] = []
    for item in sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True):  # stable: ties in order
        n = lengths[item]
        if n > capacity:
            raise ValueError(f"a sequence of {n} tokens does not fit rows of {capacity}")
        slot = 0
        while slot < len(used) and used[slot] + n > capacity:
            slot += 1
        if slot == len(used):
            used.append(0)
        placed[item] = (slot, used[slot])
        used[slot] += n
    return placed


def _bins(longest_first: list[int], capacity: int) -> int:
    """How many bins first_fit_decreasing fills with these lengths (sorted longest first) and capacity."""
    used: list[int] = []
    for n in longest_first:
        slot = 0
        while slot < len(used) and used[slot] + n > capacity:
            slot += 1
        if slot == len(used):
            used.append(0)
        used[slot] += n
    return len(used)


# Row width at which a position's attention costs about as much as its linear layers, in the cost model
# rows * W * (1 + W / ATTENTION_WIDTH) that picks W: wider rows mean fewer half-empty rows but every
# query attends to more keys (CPU SDPA computes the masked-out pairs too). This constant makes the model
# pick the width whose actor step is fastest on the demo's minibatches (W 64: timed against padded rows
# and narrower and wider widths; benchmarks/packing_layouts.py, docs/performance.md#the-training-step).
ATTENTION_WIDTH = 128


def attention_width(hidden_size: int) -> int:
    """The cost model's attention width for a model `hidden_size` wide. Per position the linear layers' work
    grows with hidden^2 and attention's with W x hidden, and CPU attention kernels grow more efficient with
    the head size: hidden^2 / 64, at least ATTENTION_WIDTH, fits the two models it was calibrated on.

    - The demo's 64-wide model: 128 (above).
    - The ladder's 256-wide model: 1,024. Timing one fwd+bwd+AdamW step on layouts of the same minibatch
      that trade slots against attention pairs (more, narrower rows against fewer, wider ones; a GRPO
      group's prompt copied or shared) brackets the width where the two cost the same around that value.

    benchmarks/packing_layouts.py times such layouts (docs/performance.md#the-training-step).
    """
    return max(ATTENTION_WIDTH, hidden_size * hidden_size // 64)


def _cost(
    lengths: list[int],
    capacity: int,
    width_of_attention: int = ATTENTION_WIDTH,
    compact_from: float | None = None,
) -> float:
    """The cost model above for these lengths in rows of `capacity`."""
    rows = _bins(sorted(lengths, reverse=True), capacity)
    return _rows_cost(sum(lengths), rows, capacity, width_of_attention, compact_from)


def _rows_cost(
    tokens: int, rows: int, capacity: int, width_of_attention: int, compact_from: float | None
) -> float:
    """The cost model for `tokens` in `rows` of `capacity`: the linear layers' rows, every slot or, where the
    forward compacts the rows (`compact_from`: the share of padding from which it does,
    llama_forward.compact_min_padding; None: never), the tokens alone; plus attention's rows * capacity^2 /
    width_of_attention."""
    slots = rows * capacity
    linear = tokens if compacts(tokens, slots, compact_from) else slots
    return linear + slots * capacity / width_of_attention


def compacts(tokens: int, slots: int, compact_from: float | None) -> bool:
    """Whether a forward that compacts from `compact_from` padding (None: never) runs `tokens` real tokens in
    `slots` slots on the tokens alone: the one rule of the cost model and llama_forward.compact_slots."""
    return compact_from is not None and slots > tokens and slots - tokens >= slots * compact_from


# Row widths are multiples of this. torch's CPU flash attention (SDPA, fp32) is much faster on a key length
# that is a multiple of 16 (its time climbs with T mod 16, forward and backward), which saves more than the
# up to 15 more (zero) slots a row then costs its linear layers.
ATTENTION_BLOCK = 16


def candidate_widths(longest: int) -> range:
    """The row widths choose_capacity costs: multiples of ATTENTION_BLOCK from the longest sequence to twice
    it, in steps of about an eighth of it (every multiple while that is under a block)."""
    block = ATTENTION_BLOCK
    first = -(-longest // block) * block
    step = max(block, longest // 8 // block * block)
    return range(first, max(first, 2 * longest) + 1, step)


def choose_capacity(
    lengths: list[int], width_of_attention: int = ATTENTION_WIDTH, compact_from: float | None = None
) -> int:
    """The row width among candidate_widths that minimises the cost model above (compact_from: _rows_cost's).

    Called for every minibatch, so it sorts once, counts bins without placing items, and skips a width whose
    fewest possible rows (ceil(tokens / width)) already cost no less than the best so far, which spares
    several of the widths of the 16-row minibatches of benchmarks/training_forward.py's batch."""
    longest_first = sorted(lengths, reverse=True)
    total = sum(longest_first)
    best: tuple[float, int] | None = None
    for width in candidate_widths(longest_first[0]):
        fewest = -(-total // width)
        linear = total if compact_from is not None else fewest * width
        if best is not None and linear + fewest * width * width / width_of_attention >= best[0]:
            continue  # even rows filled to the brim would not be cheaper
        cost = _rows_cost(total, _bins(longest_first, width), width, width_of_attention, compact_from)
        if best is None or cost < best[0]:
            best = (cost, width)
    assert best is not None
    return best[1]


def _ragged(lengths: Tensor) -> tuple[Tensor, Tensor]:
    """(row, index within the row) of every item of rows with these lengths, in row-major order."""
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return rows, torch.arange(int(lengths.sum())) - (lengths.cumsum(0) - lengths)[rows]


def _layout(lengths: Tensor, capacity: int | None) -> tuple[int, int, Tensor, Tensor, Tensor]:
    """Sequences of these lengths placed in rows: (capacity, rows, start, owner, within), where start[b] is
    the flat slot (row * capacity + column) of sequence b's first token and owner/within (_ragged) name every
    token."""
    capacity = capacity or choose_capacity(lengths.tolist())
    if capacity < int(lengths.max()):
        raise ValueError(
            f"capacity {capacity} is less than the longest sequence ({int(lengths.max())} tokens)"
        )
    placed = torch.tensor(first_fit_decreasing(lengths.tolist(), capacity), dtype=torch.long).view(-1, 2)
    owner, within = _ragged(lengths)
    return capacity, int(placed[:, 0].max()) + 1, placed[:, 0] * capacity + placed[:, 1], owner, within


def _rows(values: Tensor, slot: Tensor, rows: int, capacity: int) -> Tensor:
    """(rows, capacity) long: `values` at the flat `slot`s, 0 elsewhere."""
    return torch.zeros(rows * capacity, dtype=torch.long).index_put_((slot,), values).view(rows, capacity)


def _prompt_units(
    prompts: list[tuple[int, ...]], prompt_lengths: list[int], response_lengths: list[int], limit: int
) -> list[list[int]]:
    """Rows grouped into units that share one copy of their prompt: rows with equal `prompts` keys in order of
    first appearance, a unit growing while prompt + its responses stay within `limit` tokens (a unit always
    takes at least one row)."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for row, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(row)
    units: list[list[int]] = []
    for rows in groups.values():
        unit: list[int] = []
        used = prompt_lengths[rows[0]]
        for row in rows:
            if unit and used + response_lengths[row] > limit:
                units.append(unit)
                unit, used = [], prompt_lengths[rows[0]]
            unit.append(row)
            used += response_lengths[row]
        units.append(unit)
    return units


# Unit limits tried, in multiples of the longest sequence; None: a whole group per unit. A GRPO group of 4 x
# 32-token responses to a 30-token prompt is 158 tokens against 62 for one sequence (2.5x); to a 10-token
# prompt, 138 against 42 (3.3x: the RL ladder's, whose 4 rows of a whole group each beat 8 of half a group).
SHARING_LIMITS = (1, 2, 3, None)


def pack(
    input_ids: Tensor,
    attention_mask: Tensor,
    response_mask: Tensor,
    prompt_width: int,
    capacity: int | None = None,
    share_prompts: bool = True,
    width_of_attention: int = ATTENTION_WIDTH,
    compact_from: float | None = None,
) -> PackedRows:
    """Pack the `[left-padded prompt | right-padded response]` rows (experience.assemble's layout).

    Every row needs at least one prompt token (the position that predicts its first response token).
    capacity: the packed rows' width (default: choose_capacity).
    share_prompts: rows with the same prompt (GRPO's group, n samples per prompt) share one copy of it: the
    prompt's tokens, then each row's response, every response attending to the prompt and to itself
    (`prefix_ids`) at the positions it has alone, so every real position computes what it computes
    padded; the last prompt position predicts each row's first response token. A unit of shared rows grows
    to at most SHARING_LIMITS x the longest sequence, or to the whole group, whichever (and whatever width)
    the cost model prefers; on a tie, the smaller units.
    width_of_attention: the cost model's (attention_width of the model that runs the rows).
    compact_from: the share of padding from which that model's forward runs its linear layers on the real
    tokens only (llama_forward.compact_min_padding), where the cost model then counts tokens, not slots;
    None: never.
    """
    device = input_ids.device
    input_ids, attention_mask, response_mask = input_ids.cpu(), attention_mask.cpu(), response_mask.cpu()
    batch, width = input_ids.shape
    response_width = response_mask.shape[1]
    prompt_lengths = attention_mask[:, :prompt_width].sum(-1).long()
    response_lengths = response_mask.sum(-1).long()
    if bool((prompt_lengths == 0).any()):
        row = int((prompt_lengths == 0).nonzero()[0])
        raise ValueError(f"row {row} has no prompt token: nothing predicts its first response token")
    plens, rlens = prompt_lengths.tolist(), response_lengths.tolist()
    # Rows share a unit only under equal keys: the prompt's tokens, or the row itself when nothing is shared.
    # one call, not one per row
    prompt_tokens = input_ids[:, :prompt_width].tolist() if share_prompts else None
    prompts = [
        tuple(prompt_tokens[row][prompt_width - plens[row] :]) if share_prompts else (row,)
        for row in range(batch)
    ]
    longest = max(p + r for p, r in zip(plens, rlens, strict=True))
    only_distinct = len(set(prompts)) == batch  # no two rows share a prompt: every limit gives the same units
    candidates = []
    for preference, multiple in enumerate((1,) if only_distinct else SHARING_LIMITS):
        limit = multiple * longest if multiple else sum(plens) + sum(rlens)  # None: a whole group per unit
        limit = limit if capacity is None else min(limit, capacity)
        units = _prompt_units(prompts, plens, rlens, limit)
        if candidates and units == candidates[-1][2]:
            # the same units as the smaller limit (a group within it): costed already, and it wins ties
            continue
        lengths = [plens[unit[0]] + sum(rlens[row] for row in unit) for unit in units]
        width_of_rows = capacity or choose_capacity(lengths, width_of_attention, compact_from)
        # fixed width: fewest tokens
        cost = (_cost(lengths, width_of_rows, width_of_attention, compact_from) if capacity is None
                else sum(lengths))
        candidates.append((cost, preference, units, lengths, width_of_rows))  # ties: the smaller units
    _, _, units, lengths, capacity = min(candidates, key=lambda c: c[:2])
    capacity, rows, start, _, _ = _layout(torch.tensor(lengths, dtype=torch.long), capacity)
    # Pieces, in slot order: a unit's prompt (read from its first row), then each row's response. Per piece:
    # source flat index, first slot, length, first position, segment, prefix segment, row (-1: the prompt),
    # and the slot predicting the piece's first token (its prompt's last position).
    pieces = []
    prompt_starts, response_starts = [0] * batch, [0] * batch
    for index, unit in enumerate(units):
        head, offset = unit[0], int(start[index])
        unit_start = offset
        prompt_segment = 1 + head if len(unit) == 1 else 1 + batch + index
        last_prompt_slot = offset + plens[head] - 1
        pieces.append(
            (
                head * width + prompt_width - plens[head],
                offset,
                plens[head],
                0,
                prompt_segment,
                prompt_segment,
                -1,
                last_prompt_slot,
            )
        )
        offset += plens[head]
        for row in unit:
            prompt_starts[row], response_starts[row] = unit_start, offset
            pieces.append(
                (
                    row * width + prompt_width,
                    offset,
                    rlens[row],
                    plens[head],
                    1 + row,
                    prompt_segment,
                    row,
                    last_prompt_slot,
                )
            )
            offset += rlens[row]
    source, first_slot, length, first_position, segment, prefix, member, first_predict = torch.tensor(
        pieces, dtype=torch.long
    ).T
    piece, within = _ragged(length)
    token_slot = first_slot[piece] + within
    response = member[piece] >= 0
    speaker, t, at = member[piece][response], within[response], token_slot[response]
    # Response token t is predicted by the position before it; the first by its prompt's last position.
    predicts = torch.where(t == 0, first_predict[piece][response], at - 1)
    shared = any(len(unit) > 1 for unit in units)
    return PackedRows(
        input_ids=_rows(input_ids.reshape(-1)[source[piece] + within], token_slot, rows, capacity).to(device),
        position_ids=_rows(first_position[piece] + within, token_slot, rows, capacity).to(device),
        segment_ids=_rows(segment[piece], token_slot, rows, capacity).to(device),
        prefix_ids=_rows(prefix[piece], token_slot, rows, capacity).to(device) if shared else None,
        predicts=predicts.to(device),
        targets=(speaker * response_width + t).to(device),
        shape=(batch, response_width),
        prompt_starts=torch.tensor(prompt_starts, dtype=torch.long).to(device),
        response_starts=torch.tensor(response_starts, dtype=torch.long).to(device),
    )


@dataclass(frozen=True)
class PackedSequences:
    """Whole token sequences packed end to end (no prompt/response split): what a reward model reads."""

    input_ids: Tensor  # (rows, W) long; 0 where no sequence is
    position_ids: Tensor  # (rows, W) long: 0..n-1 within each sequence
    segment_ids: Tensor  # (rows, W) long: 1 + the sequence's index; 0 where no sequence is
    starts: Tensor  # (B,) long: flat index into (rows * W) of each sequence's first token


def pack_sequences(sequences: list[list[int]], capacity: int | None = None) -> PackedSequences:
    """Pack non-empty token lists into rows of `capacity` (default: choose_capacity), on the CPU."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    if bool((lengths == 0).any()):
        raise ValueError(f"sequence {int((lengths == 0).nonzero()[0])} is empty: there is nothing to pack")
    capacity, rows, start, owner, within = _layout(lengths, capacity)
    slot = start[owner] + within
    tokens = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    return PackedSequences(
        input_ids=_rows(tokens, slot, rows, capacity),
        position_ids=_rows(within, slot, rows, capacity),
        segment_ids=_rows(owner + 1, slot, rows, capacity),
        starts=start,
    )
