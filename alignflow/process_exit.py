"""Ending an alignflow program's process without the interpreter's tear-down.

Why: torch, transformers, MLflow and Prefect leave hundreds of thousands of objects behind, and tearing the
interpreter down (clearing every module, collecting garbage several times over) took ~0.9 s of a stage
process's ~1.1 s exit and ~1.2 s of the `alignflow` command's ~1.45 s on a 2-core EPYC, paid by every process
of a run. Freezing the objects instead (gc.freeze) skips the collections but leaves the cycles of Triton's
nanobind objects alive, and nanobind then prints ~30 lines of "leaked instances" at its tear-down. So the
process does what an exit does that matters, in the interpreter's order, and then ends at once (os._exit):
thread pools are stopped and non-daemon threads joined, atexit handlers run (MLflow's and Prefect's flushes,
logging's, temporary folders'), stdout and stderr are flushed. By then its output is printed and its files
are closed.

For a program's entry point only: a process that goes on running (a test calling main) must not end here.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def end_process(code: int | None) -> NoReturn:
    """Stop the thread pools and join the non-daemon threads, run the atexit handlers, flush stdout and
    stderr, and exit with `code` (None: 0) without tearing the interpreter down."""
    # The interpreter's own exit steps, in its order, then no tear-down: threading's shutdown (tells idle
    # thread pools to stop, then joins the non-daemon threads; joining them without it waits forever on an
    # idle ThreadPoolExecutor), then the atexit handlers.
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(0 if code is None else int(code))
