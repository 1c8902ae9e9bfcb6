"""The stage processes' host allocator: freed memory kept for reuse rather than handed back to the OS.

Why: a CPU training step allocates and frees hundreds of megabytes per step (autocast's bf16 copy of every
weight, each gradient's fp32 cast). glibc returns big freed blocks to the OS (trimming the heap, unmapping
mmapped chunks), so the next step takes every page again as a fresh page fault: on the 114.8M-parameter
benchmark model the casts ran ~10x slower than on warm memory and the RL step spent a third of its time in
them (benchmarks/rl_ladder.py --model llama-115m; docs/performance.md#host-memory). Kept, the process's
resident memory stays at its peak instead, as a GPU caching allocator's does.

glibc only (Linux); elsewhere, or where the user set glibc's malloc tunables or MALLOC_*_ variables, or
with ALIGNFLOW_KEEP_FREED_MEMORY=0, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

# mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): blocks above it are always mmapped.
MMAP_THRESHOLD_BYTES = 32 * 2**20
# mallopt takes a C int: the heap's free top is kept up to 2 GiB.
TRIM_THRESHOLD_BYTES = 2**31 - 1
OPT_OUT_VAR = "ALIGNFLOW_KEEP_FREED_MEMORY"
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory() -> str:
    """Set glibc's thresholds so that freed blocks up to 32 MiB stay in the heap and the heap is not trimmed.
    Returns what was done, for the log: 'kept', or why not."""
    if os.environ.get(OPT_OUT_VAR, "1") == "0":
        return f"off ({OPT_OUT_VAR}=0)"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(v in os.environ for v in USER_SETTINGS):
        return "the user's malloc settings"
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None or not hasattr(libc, "gnu_get_libc_version"):  # not glibc (musl, macOS)
        return "not glibc"
    kept = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    if not kept:  # mallopt answers 0 for a value out of its range
        return "refused by glibc"
    return "kept"
