"""Whether this process may still fork a worker that computes with torch: no native thread pool has started
since its program marked it clean.

Why fork at all: a spawned worker is a new interpreter that imports torch, transformers and the stage's
modules again before it can take a request (~4 s of a PPO critic process's start on a 2-core EPYC, all of it
inside the first iteration); a forked one starts with them imported, in milliseconds.

Why not always: a forked child inherits only the forking thread, but the OpenMP runtime torch's CPU wheel
ships (libgomp) goes on believing the pool of threads it started in the parent is there; the child's first
parallel region then waits for threads that do not exist (measured: a 2-thread 512x512 matmul in the parent,
then one in a forked child, hangs). Such pools stay alive once started, so a process's native threads (OS
threads that are not Python threads) tell whether one has started: `mark_clean()` records them where the
program knows no torch computation has run yet (a stage program after its imports, runtime.run_program; the
warm stage process after its imports), and `can_fork()` is True only while no other has started since, on
Linux. A process never marked (a test, a library caller) spawns.
"""

from __future__ import annotations

import os
import sys
import threading

_clean_native_threads: frozenset[int] | None = None


def native_threads() -> frozenset[int] | None:
    """The ids of this process's OS threads that are not Python threads (None where /proc cannot list
    them)."""
    try:
        threads = {int(tid) for tid in os.listdir("/proc/self/task")}
    except OSError:
        return None
    return frozenset(threads - {thread.native_id for thread in threading.enumerate()})


def mark_clean() -> None:
    """Record that no torch computation has run in this process yet (call it right after the imports)."""
    global _clean_native_threads
    _clean_native_threads = native_threads()


def can_fork() -> bool:
    """True when a forked child can run torch: marked clean, and no native thread has started since."""
    if sys.platform != "linux" or _clean_native_threads is None:
        return False
    now = native_threads()
    return now is not None and now <= _clean_native_threads


def start_method() -> str:
    """'fork' where can_fork(), else 'spawn' (multiprocessing's start method for a torch worker)."""
    return "fork" if can_fork() else "spawn"
