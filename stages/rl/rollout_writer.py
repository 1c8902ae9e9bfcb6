"""Writes each RL iteration's rollouts Parquet (and its upload) on a background thread, one file at a time.

Why: validating, compressing, fsyncing and (on S3) uploading the iteration's ~30 KB file took 8-11 ms of
the demo's ~230 ms iteration on the loop's thread, with nothing after it in the iteration needing the
file. The rows are built by the caller (they read the iteration's tensors, which the loop goes on to
change); only the write moves. At most one write is in flight: a second waits for the first, so a slow
store slows the loop instead of piling up iterations in memory, and an error in a write is raised by
the next submit, wait or close, never lost.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from alignflow.stages.rollouts import write_rollouts
from alignflow.storage import join_uri


class RolloutWriter:
    """write_rollouts(rows, path) behind a one-thread queue; then the file goes to `output_uri` when that is
    not a local folder (the store's put_file)."""

    def __init__(self, store: Any, output_uri: str):
        self._store, self._output_uri = store, output_uri
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rollout-writer")
        self._pending: Future | None = None

    def submit(self, rows: list[dict[str, Any]], path: Path) -> None:
        """Queue one file; first waits for (and raises the error of) the one before."""
        self.wait()
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
            self._executor.shutdown()
