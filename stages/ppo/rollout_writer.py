"""Writes each RL iteration's rollouts Parquet (and its upload), on a background thread where that is free.

Why: validating, compressing, fsyncing and (on S3) uploading the iteration's ~30 KB file took 8-11 ms of
the demo's ~230 ms iteration on the loop's thread, with nothing after it in the iteration needing the
file. The rows are built by the caller (they read the iteration's tensors, which the loop goes on to
change); only the write moves. At most one write is in flight: a second waits for the first, so a slow
store slows the loop instead of piling up iterations in memory, and an error in a write is raised by
the next submit, wait or close, never lost.

But a thread is not free where the torch threads already take every core: the write then takes its CPU
time from the loop, and its Python takes the GIL from the loop's many short operator calls. On the demo
(2 cores, 2 torch threads, Intel Xeon with AMX, 30 iterations, medians) the 5 ms write took 11 ms in the
background and made the refit and generation that ran beside it 3.7 and 3 ms slower: the iteration took
104.6 / 111.5 ms with it in the background against 99.1 / 109.9 ms written in line. So a local file is
written in line unless a core is left over (writes_in_background); an upload, waiting on the network with
the GIL released, always goes to the thread.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from alignflow.stages.common.rollouts import write_rollouts
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
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-writer") if self.background else None
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
