"""Ending an alignflow program's process without the interpreter's garbage collections at exit.

Why: torch, transformers, MLflow and Prefect leave hundreds of thousands of tracked objects, and tearing the
interpreter down collects them several times over: ~0.9 s of a stage process's ~1.1 s exit and ~1.2 s of
the `alignflow` command's ~1.45 s on a 2-core EPYC, paid by every process of a run. By the time a program
ends its output is printed and its files are closed, so every object is frozen (gc.freeze: no collection
looks at it again) before the exit: atexit handlers still run and every object is still freed by its
reference count; the exit's collections just have nothing to walk.

For a program's entry point only: a process that goes on running (a test calling main) must keep collecting.
"""

from __future__ import annotations

import gc
import sys
from typing import NoReturn


def end_process(code: int | None) -> NoReturn:
    """Flush stdout and stderr, freeze every object, exit with `code`."""
    sys.stdout.flush()
    sys.stderr.flush()
    gc.freeze()
    raise SystemExit(code)
