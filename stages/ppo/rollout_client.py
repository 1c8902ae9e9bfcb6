"""The RL trainer's side of generation: rollout requests to the engine, in line or overlapped with training.

What it is: the seam between the trainer and the generation engine. The trainer submits a request
(prompt ids and sampling settings of one iteration), later takes its result, and refits the engine
through it, which waits for any generation still running on the old weights. Every result carries
the version of the weights that generated it (the number of refits before it started), so the loop
knows whether a batch is on-policy.

With `overlap=True` one background thread runs the engine, so iteration k+1 is generated while
the trainer trains on iteration k (one-step off-policy, as verl's and OpenRLHF's async modes are);
torch releases the GIL inside its ops. It pays where generation and training do not compete for the
same cores (a GPU engine beside CPU-side work, or spare cores); on a small CPU box they do: torch's
intra-op thread count is one setting per process, so both phases run OpenMP teams as wide as the
cores at once and each slows by more than the overlap gains (docs/performance.md#the-rl-iteration-against-trl,
`async` against `fast_step`). Engines in their own processes,
fed by a work queue and refit over a torch.distributed group, are `rollout_workers.RolloutWorkers`,
which takes the same calls (engine.rollout_workers >= 1 picks it).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from alignflow.stages.common.generation.interface import SamplingParams, UnloadStats


@dataclass(frozen=True)
class RolloutRequest:
    """One iteration's generation: B = len(prompt_ids) sequences (prompt indices repeated group_size
    times)."""

    iteration: int
    prompt_indices: list[int]        # (B,) index into the prompt source, group-contiguous
    chosen: list[int]                # the distinct prompts of the iteration, in draw order
    prompt_ids: list[list[int]]      # (B,) token ids of each sequence's prompt
    sampling: SamplingParams


@dataclass
class Rollout:
    """A finished request: the engine's Generation, its wall time, and the weights version that produced
    it."""

    request: RolloutRequest
    generation: Any
    seconds: float
    weights_version: int


class RolloutClient:
    """Requests to one engine: `submit` -> `result`, and `refit` between them."""

    def __init__(self, engine: Any, overlap: bool = False, weights_version: int = 0,
                 unload_during_training: bool = False):
        self.engine = engine
        self.overlap = overlap
        self.weights_version = weights_version
        # engine.unload_during_training: the loop calls unload() after each rollout and reload() before the
        # refit.
        self.unload_during_training = unload_during_training
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
            raise RuntimeError(
                "a rollout is still being generated; take its result before submitting another"
            )
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

    def unload(self, keep_weights: bool = True) -> dict[str, float]:
        """Free the engine's memory while the trainer trains: its KV cache, and on a GPU its weights (to host
        memory: the next refit may be partial, LoRA's); keep_weights=False discards them on any device.
        Returns 'timing/engine_unload', what the engine says it freed ('perf/engine_freed_weight_bytes',
        'perf/engine_freed_kv_bytes', where it knows) and, where the allocator can be read,
        'perf/engine_freed_bytes'."""
        self.wait_idle()
        return timed_memory_change("unload", lambda: self.engine.unload(keep_weights=keep_weights))

    def reload(self) -> dict[str, float]:
        """Undo `unload` before the next rollout; returns 'timing/engine_reload' and, where the allocator can
        be read, 'perf/engine_reloaded_bytes'."""
        return timed_memory_change("reload", self.engine.reload)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def heap_bytes() -> int | None:
    """Bytes the process's allocator holds now: CUDA's once CUDA is in use, else glibc malloc's (torch's CPU
    allocator uses malloc); None where neither can be read."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.memory_allocated()
    try:
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [
                (n, ctypes.c_size_t)
                for n in (
                    "arena",
                    "ordblks",
                    "smblks",
                    "hblks",
                    "hblkhd",
                    "usmblks",
                    "fsmblks",
                    "uordblks",
                    "fordblks",
                    "keepcost",
                )
            ]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
        return int(info.uordblks + info.hblkhd)
    except (OSError, AttributeError):
        return None


def timed_memory_change(what: str, call) -> dict[str, float]:
    """Run `call` (an engine's unload or reload): 'timing/engine_{what}' seconds; where the allocator can be
    read, 'perf/engine_freed_bytes' (unload: the allocator's bytes before minus after) or
    'perf/engine_reloaded_bytes' (reload: after minus before); and the UnloadStats an unload returns, as
    'perf/engine_freed_weight_bytes' (weights that left the device: offloaded to host memory or discarded; 0
    where they stayed, as on a CPU) and 'perf/engine_freed_kv_bytes', each where the engine knows it.

    On a GPU the allocator's figure includes the weights; on a CPU an offload moves them within the same heap,
    so the engine's own figures are the ones that say what left the device."""
    before, started = heap_bytes(), time.perf_counter()
    stats = call()
    out = {f"timing/engine_{what}": time.perf_counter() - started}
    after = heap_bytes()
    if before is not None and after is not None:
        if what == "unload":
            out["perf/engine_freed_bytes"] = float(before - after)
        else:
            out["perf/engine_reloaded_bytes"] = float(after - before)
    if isinstance(stats, UnloadStats):
        if stats.weight_bytes is not None:
            out["perf/engine_freed_weight_bytes"] = float(stats.weight_bytes)
        if stats.kv_cache_bytes is not None:
            out["perf/engine_freed_kv_bytes"] = float(stats.kv_cache_bytes)
    return out


class RanksRollouts:
    """The rollout client as each of N trainer ranks sees it: rank 0 holds the real one (`inner`) and every
    rank gets rank 0's rollouts.

    `result` is a collective: rank 0 takes its rollout and broadcasts it (token ids, log-probs and finish
    reasons of B sequences: a few hundred KB pickled for the demo's 32 x 32 tokens), so every rank builds
    the same experience. `refit` runs on every rank because the weight stream may be a collective (ZeRO-3
    gathers one parameter at a time on all ranks): rank 0 sends it to the engine, the others drain it.
    """

    def __init__(self, inner: RolloutClient | Any | None, is_main: bool, share):
        if is_main != (inner is not None):
            raise ValueError("rank 0, and only rank 0, holds the rollout client")
        self.inner = inner
        self._share = share  # ranks.from_main: rank 0's value on every rank
        self._version = 0  # the other ranks' count of refits
        self.unload_during_training = bool(inner is not None and inner.unload_during_training)

    @property
    def weights_version(self) -> int:
        return self.inner.weights_version if self.inner is not None else self._version

    @weights_version.setter
    def weights_version(self, value: int) -> None:
        if self.inner is not None:
            self.inner.weights_version = value
        self._version = value

    def submit(self, request: RolloutRequest) -> Any:
        return self.inner.submit(request) if self.inner is not None else request

    def result(self, handle: Any) -> Rollout:
        return self._share(self.inner.result(handle) if self.inner is not None else None)

    def wait_idle(self) -> None:
        if self.inner is not None:
            self.inner.wait_idle()

    def refit(self, named_tensors, partial: bool = False) -> Any:
        if self.inner is not None:
            report = self.inner.refit(named_tensors, partial=partial)
        else:
            from alignflow.stages.common.generation.interface import RefitStats

            started, count = time.perf_counter(), 0
            for _ in named_tensors:  # take part in the gathers; rank 0 sends
                count += 1
            report = RefitStats(tensors=count, bytes=0, seconds=time.perf_counter() - started)
            self._version += 1
        return report

    def unload(self, keep_weights: bool = True) -> dict[str, float]:
        return self.inner.unload(keep_weights) if self.inner is not None else {}

    def reload(self) -> dict[str, float]:
        return self.inner.reload() if self.inner is not None else {}

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()
