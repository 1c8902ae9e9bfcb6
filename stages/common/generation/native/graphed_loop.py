"""The CUDA-graph decode loop: the decode step, the sampler and the bookkeeping as one replay per token.

Why: with the decode step alone captured (engine._decode_graphed), every token still costs the host ~20 small
operator launches around the replay: the inputs copied into the step's buffers and its masks cut for the slot,
the sampler, the token and log-prob written out, the finished rows marked. On one H200 the 110M model's
step took 1.27 ms at batch 1 for 0.05 ms of weights to read, and the 1B model's 2.19 ms against a 0.52 ms
HBM limit (docs/performance.md#gpu): the fixed cost per token, not the bytes, set the pace. Here the graph
does all of it: it decodes the last token, samples the next from the logits (sampling.sample_tokens, whose
randomness is a pure function of seed, step and token, rng.py, so nothing of it lives on the host), writes
token and log-prob to column t of the outputs, marks the rows that hit an end token, and advances its own
inputs: the token, the position, the cache slot, the step and the masks (the new slot seen; under a sliding
window the slot that leaves it hidden). The host replays once per token and checks every
GPU_STOP_CHECK_EVERY tokens whether every row has finished, as the per-step loop does.

Exactness: the same step, the same sampler, the same arithmetic as the per-step loop, which is its
reference (tests/stages/common/generation/test_graphed_loop.py: equal tokens and log-probs). Off a GPU the
"replay" runs the same function eagerly, so CPU tests exercise every buffer and update; only the capture
needs a GPU.

Not covered (the engine decodes per step there): returned logits (a [B, new, V] buffer per graph), and
the compiled sampler's eagerly computed top-k/top-p thresholds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from alignflow.kernels.sampling import BatchFlags, SampleOutput


@dataclass
class GraphedLoop:
    """The static buffers of one batch-size bucket's in-graph loop, and how to replay it."""

    tokens: torch.Tensor       # [bucket, 1] long: the token the next replay decodes
    positions: torch.Tensor    # [bucket, 1] long: its position
    slot: torch.Tensor         # [1] long: the cache slot it goes to
    masks: dict[int | None, torch.Tensor]  # window -> additive [bucket, 1, 1, S_max]
    real_rows: torch.Tensor    # [bucket, 1, 1, 1] bool: rows of the batch (the rest pad the bucket)
    temperature: torch.Tensor  # [bucket] fp32
    top_k: torch.Tensor        # [bucket] long
    top_p: torch.Tensor        # [bucket] fp32
    seeds: torch.Tensor        # [bucket] long
    step: torch.Tensor         # [bucket] long: the sampling step of the next replay (the same in every row)
    column: torch.Tensor       # [1] long: that step, as the outputs' column
    ends: torch.Tensor         # [V] bool: tokens that end a row
    out_tokens: torch.Tensor   # [bucket, S_max] long
    out_logprobs: torch.Tensor  # [bucket, S_max] fp32
    lengths: torch.Tensor      # [bucket] long
    finished: torch.Tensor     # [bucket] bool
    epoch: int = 0  # the engine's storage epoch at capture (as _GraphedStep's)
    graph: Any = None
    replay: Callable[[], None] = field(default=lambda: None)

    @classmethod
    def empty(
        cls, bucket: int, max_seq_len: int, vocab: int, windows: set[int | None], dtype: torch.dtype,
        device: torch.device, epoch: int,
    ) -> GraphedLoop:
        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            tokens=zeros(bucket, 1),
            positions=zeros(bucket, 1),
            # Warm-up writes the keys of slots near the end of the cache, which a running generation has not
            # reached (and overwrites before it reads them).
            slot=torch.full((1,), max_seq_len - 4, dtype=torch.long, device=device),
            masks={w: zeros(bucket, 1, 1, max_seq_len, dtype=dtype) for w in windows},
            real_rows=zeros(bucket, 1, 1, 1, dtype=torch.bool),
            temperature=torch.ones(bucket, dtype=torch.float32, device=device),
            top_k=zeros(bucket),
            top_p=torch.ones(bucket, dtype=torch.float32, device=device),
            seeds=zeros(bucket),
            step=zeros(bucket),
            column=zeros(1),
            ends=zeros(vocab, dtype=torch.bool),
            out_tokens=zeros(bucket, max_seq_len),
            out_logprobs=zeros(bucket, max_seq_len, dtype=torch.float32),
            lengths=zeros(bucket),
            finished=zeros(bucket, dtype=torch.bool),
            epoch=epoch,
        )

    def body(
        self,
        step: Callable[..., torch.Tensor],
        sample: Callable[..., SampleOutput],
        cache: Any,
        flags: BatchFlags,
        impl: str,
    ) -> None:
        """One token: decode, sample, write out, mark finished rows, advance the inputs (what is captured)."""
        logits = step(cache, self.tokens, self.positions, self.slot, self.masks)
        drawn = sample(
            logits, self.temperature, self.top_k, self.top_p, self.seeds, self.step, impl,
            validate=False, flags=flags,
        )
        self.out_tokens.index_copy_(1, self.column, drawn.tokens[:, None])
        self.out_logprobs.index_copy_(1, self.column, drawn.logprobs[:, None])
        hit = self.ends[drawn.tokens] & ~self.finished
        self.lengths.copy_(torch.where(hit, self.column + 1, self.lengths))
        self.finished.logical_or_(hit)
        self.tokens.copy_(drawn.tokens[:, None])
        for buffer in (self.positions, self.slot, self.step, self.column):
            buffer.add_(1)
        for window, mask in self.masks.items():
            mask.index_fill_(3, self.slot, 0.0)  # the new token's slot (padding rows' masks are all 0 anyway)
            if window is not None:  # DecodeMasks.at: slots j <= slot - window are out of the window
                gone = self.slot - window
                column = gone.clamp(min=0)
                kept = mask.index_select(3, column)
                mask.index_copy_(3, column, torch.where((gone >= 0) & self.real_rows, float("-inf"), kept))

    def start(
        self,
        first: SampleOutput,
        lens: torch.Tensor,
        width: int,
        masks: dict[int | None, torch.Tensor],
        sampling: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        ends: torch.Tensor,
        new: int,
    ) -> None:
        """Fill the buffers for a batch whose token 0 is `first` (sampled from the prefill's logits): the next
        replay decodes it at position lens, slot `width`, and samples token 1. `masks`: DecodeMasks.at(width,
        S_max). Rows past the batch repeat its first row's sampling values and attend to every slot (finite,
        never read), and count as finished."""
        batch = lens.shape[0]
        bucket = self.tokens.shape[0]
        source = torch.arange(bucket, device=lens.device).clamp_(max=batch - 1)
        per_row = (self.temperature, self.top_k, self.top_p, self.seeds)
        for buffer, values in zip(per_row, sampling, strict=True):
            buffer.copy_(values[source])
        self.ends.copy_(ends)
        self.real_rows.copy_((torch.arange(bucket, device=lens.device) < batch)[:, None, None, None])
        self.out_tokens.zero_()
        self.out_logprobs.zero_()
        self.out_tokens[:batch, 0] = first.tokens
        self.out_logprobs[:batch, 0] = first.logprobs
        hit = ends[first.tokens]
        self.lengths.fill_(new)
        self.lengths[:batch] = torch.where(hit, 1, new)
        self.finished.fill_(True)
        self.finished[:batch] = hit
        self.tokens.zero_()
        self.tokens[:batch, 0] = first.tokens
        self.positions.zero_()
        self.positions[:batch, 0] = lens
        self.slot.fill_(width)
        self.step.fill_(1)
        self.column.fill_(1)
        for window, mask in masks.items():
            self.masks[window].zero_()
            self.masks[window][:batch].copy_(mask)


def capture_graph(run: Callable[[], None], device: torch.device, pool: Any) -> torch.cuda.CUDAGraph:
    """`run` captured as a CUDA graph in `pool`, after two warm-up runs on a side stream (they compile the
    Triton kernels and let the allocator settle, which a capture cannot): the engine's step and the in-graph
    loop.
    A loop's warm-ups advance its buffers; GraphedLoop.start fills them all again before the first replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph
