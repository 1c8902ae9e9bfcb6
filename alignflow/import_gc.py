"""Heavy imports with Python's garbage collector off, and their objects frozen out of later collections.

Why: importing torch, transformers, MLflow or Prefect's server makes ~650K objects, and the collector runs
full passes over them as they pile up: ~1.2 s of the ~6.5 s a warm stage process spends importing on a 2-core
EPYC (8 full collections; 5.5 s with the collector off). Every process of `alignflow run` starts with such
imports (the command itself, Prefect's server, the warm stage process), and on a small machine they share its
cores. Afterwards everything the imports made is frozen (gc.freeze: no later collection looks at it again, as
runtime.run_program does for stage programs) and the collector is on again. The price: cyclic garbage the
imports left (~13K objects after the stage imports) is frozen with them and never freed.

For a program's start-up only: a library import must not switch the collector off.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def imports_without_gc() -> Iterator[None]:
    """The collector off inside; after, every tracked object frozen and the collector back as it was."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if was_enabled:
            gc.enable()
