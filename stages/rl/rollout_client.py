"""The RL trainer's side of generation: rollout requests to the engine, in line or overlapped with training.

What it is: the seam between the trainer and the generation engine. The trainer submits a request
(prompt ids and sampling settings of one iteration), later takes its result, and refits the engine
through it, which waits for any generation still running on the old weights. Every result carries
the version of the weights that generated it (the number of refits before it started), so the loop
knows whether a batch is on-policy.

With `overlap=True` one background thread runs the engine, so iteration k+1 is generated while
the trainer trains on iteration k (one-step off-policy, as verl's and OpenRLHF's async modes are);
torch releases the GIL inside its ops. It pays where generation and training do not compete for the
same cores (a GPU engine beside CPU-side work, or spare cores); on 2 CPU cores they do: torch's
intra-op thread count is one setting per process, so both phases run 2-thread OpenMP teams on 2
cores and the GRPO benchmark's generation went from 0.10 to 0.39 s and its training step from 0.16
to 0.41 s when overlapped (benchmarks/rl_ladder.py measures it). What it is not (yet): rollout
workers in their own processes or on other devices; those take the same three calls.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from alignflow.stages.generation.base import SamplingParams


@dataclass(frozen=True)
class RolloutRequest:
    """One iteration's generation: B = len(prompt_ids) sequences (prompt indices repeated group_size times)."""

    iteration: int
    prompt_indices: list[int]        # (B,) index into the prompt source, group-contiguous
    chosen: list[int]                # the distinct prompts of the iteration, in draw order
    prompt_ids: list[list[int]]      # (B,) token ids of each sequence's prompt
    sampling: SamplingParams


@dataclass
class Rollout:
    """A finished request: the engine's Generation, its wall time, and the weights version that produced it."""

    request: RolloutRequest
    generation: Any
    seconds: float
    weights_version: int


class RolloutClient:
    """Requests to one engine: `submit` -> `result`, and `refit` between them."""

    def __init__(self, engine: Any, overlap: bool = False, weights_version: int = 0):
        self.engine = engine
        self.overlap = overlap
        self.weights_version = weights_version
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout") if overlap else None
        self._in_flight: Future | None = None

    def _generate(self, request: RolloutRequest, version: int) -> Rollout:
        started = time.perf_counter()
        generation = self.engine.generate(request.prompt_ids, request.sampling)
        return Rollout(request, generation, time.perf_counter() - started, version)

    def submit(self, request: RolloutRequest) -> Future | Rollout:
        """Start generating `request` with the engine's current weights: in the background with overlap,
        else now (the returned Rollout is then already finished)."""
        if self._pool is None:
            return self._generate(request, self.weights_version)
        if self._in_flight is not None and not self._in_flight.done():
            raise RuntimeError("a rollout is still being generated; take its result before submitting another")
        self._in_flight = self._pool.submit(self._generate, request, self.weights_version)
        return self._in_flight

    @staticmethod
    def result(handle: Future | Rollout) -> Rollout:
        """The finished rollout of `submit` (waits for a background one; re-raises its error)."""
        return handle.result() if isinstance(handle, Future) else handle

    def wait_idle(self) -> None:
        """Wait until no generation is running (errors surface at `result`)."""
        if self._in_flight is not None:
            self._in_flight.exception()

    def refit(self, named_tensors, partial: bool = False) -> Any:
        """Load new weights into the engine once it is idle (`partial`: only some parameters changed, e.g. the
        LoRA-adapted modules); bumps the weights version."""
        self.wait_idle()
        report = self.engine.refit(named_tensors, partial=partial)
        self.weights_version += 1
        return report

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
