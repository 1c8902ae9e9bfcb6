"""Each RL iteration's rollout rows and their Parquet file and upload; not the schema (common/rollouts.py).

rollout_rows builds the rows from the iteration's tensors, on the loop's thread (the loop goes on to change
them); RolloutWriter writes them and, where the output is not a local folder, uploads the file. Nothing later
in the iteration needs the file, so the write may run on a background thread: at most one is in flight (a
second waits for the first, so a slow store slows the loop instead of piling up iterations in memory), and an
error in a write is raised by the next submit, wait or close, never lost.

But a thread is not free where the torch threads already take every core: the write then takes its CPU time
from the loop, and its Python takes the interpreter lock from the loop's many short operator calls, which
slows the refit and generation beside it by more than the write costs in line. So a local file is written in
line unless a core is left over (writes_in_background); an upload, waiting on the network with the lock
released, always goes to the thread (docs/rl.md#speed-options).
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from alignflow.stages.common.rollouts import write_rollouts
from alignflow.stages.ppo.experience import Experience
from alignflow.stages.ppo.rollout_client import Rollout
from alignflow.storage import join_uri


def writes_in_background(store: Any, output_uri: str) -> bool:
    """Whether RolloutWriter should use its thread: for an upload (the output is not a local folder), or where
    this process may run on more cores than torch's threads take."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return store.local_path(output_uri) is None or cores > torch.get_num_threads()


class RolloutWriter:
    """write_rollouts(rows, path), then the file goes to `output_uri` when that is not a local folder (the
    store's put_file): behind a one-thread queue when `background` (default: writes_in_background), else in
    submit itself."""

    def __init__(self, store: Any, output_uri: str, background: bool | None = None):
        self._store, self._output_uri = store, output_uri
        self.background = writes_in_background(store, output_uri) if background is None else background
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="rollout-writer") if self.background
                          else None)
        self._pending: Future | None = None

    def submit(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Write one file, or queue it; first waits for (and raises the error of) the one before."""
        self.wait()
        if self._executor is None:
            self._write(rows, path)
        else:
            self._pending = self._executor.submit(self._write, rows, path)

    def _write(self, rows: list[dict[str, Any]], path: Path) -> None:
        write_rollouts(rows, path)
        if self._store.local_path(self._output_uri) is None:
            self._store.put_file(path, join_uri(self._output_uri, "rollouts", path.name))

    def wait(self) -> None:
        """Until every queued file is written (before a checkpoint or the publish)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown()


def rollout_rows(rollout: Rollout, prompts: list[Any], texts: list[str], completions: list[str],
                 exp: Experience, components: dict[str, torch.Tensor], seq_kl: torch.Tensor,
                 with_reference: bool) -> list[dict[str, Any]]:
    """One iteration's rows of the rollout schema (stages/common/rollouts.py), one per sequence: the rollout's
    prompt and response, each row's own slice of exp's per-token tensors, its reward components and total, its
    KL. prompts: the prompt records (by index); texts, completions: each row's rendered prompt and decoded
    response; components: name -> (B,) raw score; seq_kl: (B,) the sequence KL."""
    generation, rows = rollout.generation, rollout.request.prompt_indices

    # Each tensor to Python lists in one call, then sliced per row: a .tolist() of each row's slice would be
    # an operator call per row and tensor.
    def lists(tensor: torch.Tensor | None) -> list[list[float]] | None:
        return None if tensor is None else tensor.tolist()

    per_token = {"logprobs": lists(exp.rollout_logprobs),
                 "ref_logprobs": lists(exp.ref_logprobs) if with_reference else None,
                 "values": lists(exp.values), "token_rewards": lists(exp.token_rewards),
                 "advantages": lists(exp.advantages), "returns": lists(exp.returns)}
    rewards = {name: v.tolist() for name, v in components.items()}
    totals, kls = exp.scores.tolist(), seq_kl.tolist()
    out = []
    for b, prompt_index in enumerate(rows):
        n = len(generation.response_token_ids[b])
        record = prompts[prompt_index]
        out.append({
            "iteration": rollout.request.iteration, "policy_version": rollout.weights_version,
            "prompt_id": str(getattr(record, "id", None) or prompt_index), "prompt": texts[b],
            "response": completions[b], "prompt_token_ids": rollout.request.prompt_ids[b],
            "response_token_ids": generation.response_token_ids[b],
            **{column: None if values is None else values[b][:n] for column, values in per_token.items()},
            "rewards": {name: float(v[b]) for name, v in rewards.items()},
            "reward_total": float(totals[b]), "kl": float(kls[b]), "length": n,
            "finish_reason": generation.finish_reasons[b]})
    return out
