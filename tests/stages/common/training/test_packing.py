"""Sequence packing: every real token lands once, in its own segment, at its own position; every response
token's prediction is read from the position before it; the row width is chosen by the cost model."""

from __future__ import annotations

import pytest
import torch

from alignflow.stages.common.training.packing import (
    choose_capacity,
    first_fit_decreasing,
    pack,
    pack_sequences,
)
from alignflow.stages.ppo.experience import Experience


def batch(prompt_lengths: list[int], response_lengths: list[int], seed: int = 0) -> Experience:
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in prompt_lengths]
    responses = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in response_lengths]
    return Experience.of_sequences(prompts, responses, 0)


def test_first_fit_decreasing_fills_bins_without_overflow_or_overlap():
    lengths = [5, 9, 3, 7, 1, 4, 6]
    placed = first_fit_decreasing(lengths, 10)
    spans: dict[int, list[tuple[int, int]]] = {}
    for (slot, offset), n in zip(placed, lengths, strict=True):
        assert offset + n <= 10
        spans.setdefault(slot, []).append((offset, offset + n))
    for parts in spans.values():
        parts.sort()
        assert all(a[1] <= b[0] for a, b in zip(parts, parts[1:], strict=False))
    assert len(spans) == 4  # 35 tokens in bins of 10: FFD packs 9+1, 7+3, 6+4, 5
    with pytest.raises(ValueError, match="does not fit rows of 4"):
        first_fit_decreasing([5], 4)


def test_every_token_lands_once_in_its_segment_at_its_position():
    exp = batch([3, 1, 5, 2, 4], [4, 0, 2, 6, 1])
    packed = pack(exp.input_ids, exp.attention_mask, exp.response_mask, exp.prompt_width, capacity=12)
    assert packed.input_ids.shape[1] == 12
    assert packed.input_ids.shape[0] < exp.input_ids.shape[0]
    for row in range(5):
        where = packed.segment_ids == row + 1
        real = exp.input_ids[row][exp.attention_mask[row].bool()]
        assert torch.equal(packed.input_ids[where], real)  # row-major: the sequence's order is kept
        assert torch.equal(packed.position_ids[where], torch.arange(len(real)))
    assert int((packed.segment_ids > 0).sum()) == int(exp.attention_mask.sum())


def test_each_response_token_is_predicted_by_the_position_before_it():
    exp = batch([3, 1, 5, 2], [4, 3, 2, 6], seed=1)
    packed = exp.packed
    flat_ids, flat_segments = packed.input_ids.reshape(-1), packed.segment_ids.reshape(-1)
    rows, columns = packed.targets // exp.response_ids.shape[1], packed.targets % exp.response_ids.shape[1]
    assert torch.equal(flat_ids[packed.predicts + 1], exp.response_ids[rows, columns])
    assert torch.equal(flat_segments[packed.predicts], rows + 1)
    assert len(packed.targets) == int(exp.response_mask.sum())
    scattered = packed.scatter(torch.ones(len(packed.targets)))
    assert torch.equal(scattered, exp.response_mask)


def test_capacity_and_prompt_checks():
    exp = batch([3, 4], [2, 5])
    with pytest.raises(ValueError, match="less than the longest sequence"):
        pack(exp.input_ids, exp.attention_mask, exp.response_mask, exp.prompt_width, capacity=5)
    no_prompt = batch([3, 4], [2, 5])
    no_prompt.attention_mask[1, : no_prompt.prompt_width] = 0
    with pytest.raises(ValueError, match="row 1 has no prompt token"):
        _ = no_prompt.packed


def test_choose_capacity_widens_rows_only_while_it_pays():
    # Equal lengths pair up exactly at twice the length, but attention cost makes that dearer than one per row
    # (in rows of 64: the widths are multiples of 16, where CPU flash attention is fastest).
    assert choose_capacity([60] * 16) == 64
    # The demo's shape (lengths 15-49): wider rows hold the short sequences of two rows.
    lengths = [26, 40, 30, 32, 34, 38, 30, 15, 26, 34, 36, 18, 32, 44, 38, 39]
    width = choose_capacity(lengths)
    rows = 1 + max(b for b, _ in first_fit_decreasing(lengths, width))
    assert rows * width < len(lengths) * max(lengths)


@pytest.mark.parametrize("compact_from", [None, 1 / 16])
def test_choose_capacity_picks_the_width_a_full_search_picks(compact_from):
    """choose_capacity counts bins without placing items and skips widths whose fewest possible rows cannot
    win: on random minibatches it returns the width that costing every width with first_fit_decreasing does:
    the multiples of 16 from the longest sequence to twice it, in steps of an eighth of it (whole blocks).
    compact_from: rows with that share of padding or more cost their tokens in the linear layers, not their
    slots (the forward compacts them)."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(300):
        count = int(torch.randint(1, 40, (1,), generator=generator))
        lengths = torch.randint(1, 160, (count,), generator=generator).tolist()
        attention = (64, 128, 512)[trial % 3]
        longest = max(lengths)
        best = None
        first = (longest + 15) // 16 * 16
        for width in range(first, max(first, 2 * longest) + 1, max(16, longest // 8 // 16 * 16)):
            slots = (1 + max(b for b, _ in first_fit_decreasing(lengths, width))) * width
            compacted = compact_from is not None and slots - sum(lengths) >= slots * compact_from
            cost = (sum(lengths) if compacted else slots) + slots * width / attention
            if best is None or cost < best[0]:
                best = (cost, width)
        assert choose_capacity(lengths, attention, compact_from) == best[1], (lengths, attention)


def test_rows_the_forward_compacts_cost_their_tokens_so_narrower_rows_win():
    """The demo's lengths costed for the 256-wide model (attention width 1,024): counting every slot, wider
    rows of several sequences win; where the forward compacts the padding away, narrower rows do (less
    attention), as benchmarks/compaction.py measures."""
    lengths = [26, 40, 30, 32, 34, 38, 30, 15, 26, 34, 36, 18, 32, 44, 38, 39]
    every_slot = choose_capacity(lengths, 1024)
    compacted = choose_capacity(lengths, 1024, compact_from=1 / 16)
    assert compacted < every_slot
    rows = 1 + max(b for b, _ in first_fit_decreasing(lengths, compacted))
    assert 1 - sum(lengths) / (rows * compacted) >= 1 / 16  # the layout it picked is one the forward compacts


def test_rows_are_a_whole_number_of_attention_blocks_wide_unless_the_width_is_given():
    generator = torch.Generator().manual_seed(1)
    for count in (1, 5, 16):
        lengths = torch.randint(1, 90, (count,), generator=generator).tolist()
        assert choose_capacity(lengths) % 16 == 0 and choose_capacity(lengths) >= max(lengths)
        packed = pack_sequences([[3] * n for n in lengths])
        assert packed.input_ids.shape[1] % 16 == 0
    exp = batch([3, 1, 5, 2, 4], [4, 1, 2, 6, 1])
    assert exp.packing().input_ids.shape[1] == 16
    assert pack(exp.input_ids, exp.attention_mask, exp.response_mask, exp.prompt_width, capacity=13
                ).input_ids.shape[1] == 13


def test_pack_sequences_puts_each_token_list_in_its_segment_from_its_start():
    sequences = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    packed = pack_sequences(sequences, capacity=6)
    assert packed.input_ids.shape == (2, 6)
    flat_ids, flat_pos, flat_seg = (
        t.reshape(-1) for t in (packed.input_ids, packed.position_ids, packed.segment_ids)
    )
    for index, tokens in enumerate(sequences):
        span = slice(int(packed.starts[index]), int(packed.starts[index]) + len(tokens))
        assert flat_ids[span].tolist() == tokens
        assert flat_pos[span].tolist() == list(range(len(tokens)))
        assert (flat_seg[span] == index + 1).all()
    assert int((flat_seg > 0).sum()) == sum(map(len, sequences))  # nothing else is marked as a sequence
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack_sequences([[1], []])


def grouped_batch(seed: int = 0) -> Experience:
    """Three prompts with 3, 1 and 4 completions (rows interleaved, one response empty): GRPO's layout."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (5, 2, 7)]
    owners = [0, 1, 0, 2, 2, 0, 2, 2]
    responses = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (4, 6, 3, 5, 0, 2, 6, 1)]
    return Experience.of_sequences([prompts[o] for o in owners], responses, 0)


def real_sequence(exp: Experience, row: int) -> torch.Tensor:
    return exp.input_ids[row][exp.attention_mask[row].bool()]


def test_rows_with_one_prompt_share_one_copy_and_every_prediction_reads_the_token_before_it():
    exp = grouped_batch()
    shared = exp.packed
    separate = exp.packing(share_prompts=False)
    assert separate.prefix_ids is None
    assert shared.prefix_ids is not None
    real = int((shared.segment_ids > 0).sum())
    # Prompts of 5 (x3), 2 (x1), 7 (x4) tokens: every prompt once instead of once per row.
    assert real == int(exp.attention_mask.sum()) - 2 * 5 - 3 * 7
    assert int((separate.segment_ids > 0).sum()) == int(exp.attention_mask.sum())
    flat_ids, flat_positions = shared.input_ids.reshape(-1), shared.position_ids.reshape(-1)
    flat_segments, flat_prefix = shared.segment_ids.reshape(-1), shared.prefix_ids.reshape(-1)
    width_r = exp.response_ids.shape[1]
    rows, t = shared.targets // width_r, shared.targets % width_r
    prompt_lengths = exp.attention_mask[:, : exp.prompt_width].sum(-1)
    for row, step, at in zip(rows.tolist(), t.tolist(), shared.predicts.tolist(), strict=True):
        sequence = real_sequence(exp, row)
        position = int(prompt_lengths[row]) - 1 + step
        assert int(flat_ids[at]) == int(sequence[position])  # the token before the predicted one
        assert int(flat_positions[at]) == position  # at the position it has padded
        # The response's own tokens, or its prompt's (the segment its prefix names).
        assert int(flat_segments[at]) == (row + 1 if step > 0 else int(flat_prefix[at]))
    assert torch.equal(shared.scatter(torch.ones(len(shared.targets))), exp.response_mask)
    # Every response's tokens sit in its own segment, in order, after its prompt's positions; the row whose
    # prompt nobody shares (row 1) keeps its prompt in its own segment.
    for row in range(len(exp.input_ids)):
        where = shared.segment_ids == row + 1
        sequence = real_sequence(exp, row)
        own = len(sequence) if row == 1 else len(sequence) - int(prompt_lengths[row])
        assert torch.equal(shared.input_ids[where], sequence[len(sequence) - own :])
        assert torch.equal(shared.position_ids[where], torch.arange(len(sequence) - own, len(sequence)))


def test_a_shared_unit_stays_within_the_width_asked_for():
    exp = grouped_batch(seed=1)
    packed = pack(exp.input_ids, exp.attention_mask, exp.response_mask, exp.prompt_width, capacity=14)
    assert packed.input_ids.shape[1] == 14
    assert torch.equal(packed.scatter(torch.ones(len(packed.targets))), exp.response_mask)
    # The 7-token prompt's 4 responses (5, 0, 6, 1 tokens) cannot share one row of 14: two copies of it.
    assert int((packed.segment_ids > 0).sum()) == int(exp.attention_mask.sum()) - 2 * 5 - 2 * 7


def rl_ladder_grpo_batch() -> Experience:
    """The RL benchmark's GRPO minibatch: 4 prompts of 7-12 tokens x 4 completions of 32 tokens, rows
    shuffled. A group (7 + 4 x 32 = 135 tokens or more) is longer than 3 x the longest sequence (44)."""
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (7, 9, 10, 12)]
    owners = [2, 0, 3, 1, 0, 2, 1, 3, 3, 0, 1, 2, 1, 3, 0, 2]
    responses = [torch.randint(3, 100, (32,), generator=generator).tolist() for _ in owners]
    return Experience.of_sequences([prompts[o] for o in owners], responses, 0)


def test_a_whole_group_shares_one_prompt_copy_when_the_models_attention_width_prefers_it():
    """For the 256-wide benchmark model (attention width 1,024) the minibatch packs as 4 rows, one whole group
    each: every prompt once, fewer slots for more attention pairs, the faster layout there
    (packing.attention_width). The demo's 64-wide model keeps its attention width (128) and narrower rows."""
    from alignflow.stages.common.training.packing import attention_width

    assert attention_width(64) == 128 and attention_width(256) == 1024
    exp = rl_ladder_grpo_batch()
    packed = exp.packing(width_of_attention=attention_width(256))
    assert packed.input_ids.shape[0] == 4
    assert int((packed.segment_ids > 0).sum()) == 7 + 9 + 10 + 12 + 16 * 32  # each prompt once
    assert torch.equal(packed.scatter(torch.ones(len(packed.targets))), exp.response_mask)
    narrow = exp.packing(width_of_attention=attention_width(64))
    assert narrow.input_ids.shape[1] < packed.input_ids.shape[1]


def test_slots_of_finds_every_position_of_every_sequence_shared_or_not():
    exp = grouped_batch(seed=2)  # with an empty response, whose positions all lie in its prompt
    prompt_lengths = exp.attention_mask[:, : exp.prompt_width].sum(-1)
    sequences = [real_sequence(exp, row) for row in range(len(exp.input_ids))]
    for packed in (exp.packed, exp.packing(share_prompts=False)):
        flat_ids, flat_positions = packed.input_ids.reshape(-1), packed.position_ids.reshape(-1)
        flat_segments = packed.segment_ids.reshape(-1)
        for row, sequence in enumerate(sequences):
            for position in range(len(sequence)):
                positions = torch.zeros(len(sequences), dtype=torch.long)
                positions[row] = position
                at = int(packed.slots_of(positions, prompt_lengths)[row])
                assert int(flat_ids[at]) == int(sequence[position])
                assert int(flat_positions[at]) == position
                if packed.prefix_ids is None:  # not shared: every token in the row's own segment
                    assert int(flat_segments[at]) == row + 1
    assert exp.packed.prefix_ids is not None  # the first layout did share
