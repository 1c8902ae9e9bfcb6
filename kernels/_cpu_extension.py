"""Builds and loads the C++ CPU kernels of kernels/csrc/ as torch extensions (the choice of path is the caller's).

Compiled on first use with torch.utils.cpp_extension (g++, ninja; 54-66 s on the 2-core CI box),
then cached in TORCH_EXTENSIONS_DIR and loaded from there. The kernels use AVX-512: on a CPU without it, or where the
build fails, `extension()` is None and `unavailable_reason()` says why; the build failure also warns
once, because the callers then fall back to slower torch paths.

The sampler and skinny_linear also have an AVX2 build (csrc/avx2/, its own extension, which alone has the
training step's log-prob and entropy kernels, `logprob_kernels()`): `sampler()` and
`linear_kernels()` are the AVX-512 extension where it runs, else that one on CPUs with AVX2 and FMA. On the
AVX2 EPYC the demo's sampling ([32, 512] logits) took ~430 us of each ~1.6 ms decode step through the chunked
torch path (Gumbel windows and ~20 operator calls); skinny_linear's figures are in kernels/skinny_linear.py.
"""

from __future__ import annotations

import functools
import os
import time
import warnings
from pathlib import Path
from unittest import mock

import torch

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
NAME = "alignflow_cpu_kernels"
_FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]


# The decode loop (csrc/decode_loop.cpp) is written over both builds' pieces and compiled into each.
AVX2_SOURCES = [Path(__file__).parent / "csrc" / "decode_loop.cpp",
                *sorted((Path(__file__).parent / "csrc" / "avx2").glob("*.cpp"))]
AVX2_NAME = "alignflow_cpu_kernels_avx2"
_AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]

# A build holds <build dir>/lock while it compiles, and torch's `load` waits, without a time limit, for
# that file to go. A process killed mid-build leaves it behind, and every later load then hangs (seen
# here: a whole test run stuck at collection). The longest build measured is ~110 s (all three
# extensions at once on 2 cores), so a lock 15 minutes old is taken to be a leftover and removed.
STALE_LOCK_SECONDS = 15 * 60


def clear_stale_lock(name: str) -> Path | None:
    """Remove `name`'s build lock if it is older than STALE_LOCK_SECONDS (warning); returns the path removed."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(_get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age < STALE_LOCK_SECONDS:
        return None  # another process may be compiling now: torch's load waits for it
    warnings.warn(f"removing the build lock {lock}, left {age / 60:.0f} minutes ago by a build that did not "
                  f"finish (a killed process); the extension {name} is built again", RuntimeWarning, stacklevel=3)
    lock.unlink(missing_ok=True)
    return lock


def _compile(name: str = NAME, sources: list[Path] = SOURCES, flags: list[str] = _FLAGS):
    from torch.utils.cpp_extension import load

    clear_stale_lock(name)
    return load(name, sources=[str(s) for s in sources], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                verbose=False)


def _library_path(module_name: str, build_directory: str, is_python_module: bool) -> str:
    from torch.utils.cpp_extension import LIB_EXT

    return os.path.join(build_directory, f"{module_name}{LIB_EXT}")


def build_ahead() -> Path:
    """Compile the extension into TORCH_EXTENSIONS_DIR now, on any x86-64 CPU; returns the .so's path.

    For container images: a stage container starts from the image's file system every run, so a
    kernel compiled at run time is compiled again by every engine and PPO stage (54-66 s on 2 cores).
    The build host need not have AVX-512 (the flags, not the host, decide the instructions); at run
    time `extension()` finds this build, up to date, and only loads it. Raises if compiling fails.

    It compiles without loading: loading runs the module's initialisers, which -O3 -mavx512f may
    vectorise with AVX-512, so an AVX2-only build host died with SIGILL (exit 132) here. torch 2.13's
    `load` has no build-only mode (is_python_module=False still dlopens via torch.ops.load_library), so
    its last step, the import, is replaced by returning the library's path; everything before it (the
    same name, flags and build directory as `extension()`, ninja's up-to-date check, the lock) is
    torch's own, so the run-time `load` finds this build and only imports it. mock.patch.object fails
    loudly if a torch release renames that step.
    """
    from torch.utils import cpp_extension

    with mock.patch.object(cpp_extension, "_import_module_from_library", _library_path):
        _compile(AVX2_NAME, AVX2_SOURCES, _AVX2_FLAGS)  # the sampler and skinny_linear of AVX2-only hosts
        return Path(_compile())


@functools.cache
def _load() -> tuple[object | None, str | None]:
    if not torch.cpu._is_avx512_supported():
        return None, "this CPU has no AVX-512"
    return _build(NAME, SOURCES, _FLAGS)


def _build(name: str, sources: list[Path], flags: list[str]) -> tuple[object | None, str | None]:
    try:
        module = _compile(name, sources, flags)
    except Exception as exc:  # no compiler, no ninja, no headers: the callers keep their torch paths
        why = f"building {', '.join(s.name for s in sources)} failed: {type(exc).__name__}: {str(exc).strip()[-500:]}"
        warnings.warn(f"{why}; CPU kernels fall back to torch (slower decoding). Install g++ and ninja, and make "
                      "TORCH_EXTENSIONS_DIR writable, to use them", RuntimeWarning, stacklevel=4)
        return None, why
    return module, None


@functools.cache
def _load_sampler() -> tuple[object | None, str | None]:
    module, why = _load()
    if module is not None:
        return module, None
    # Its noise equals the reference's where torch's own log kernels are the AVX2 ones (the same SLEEF function).
    capability = torch.backends.cpu.get_cpu_capability()
    if capability != "AVX2":
        return None, f"{why}, and torch's CPU kernels are {capability}, not AVX2"
    return _load_avx2()


@functools.cache
def _load_avx2() -> tuple[object | None, str | None]:
    if not torch.cpu._is_avx2_supported():
        return None, "this CPU has neither AVX-512 nor AVX2"
    return _build(AVX2_NAME, AVX2_SOURCES, _AVX2_FLAGS)


@functools.cache
def _load_linear() -> tuple[object | None, str | None]:
    # On an AVX-512 CPU the AVX-512 build or its failure: the AVX2 build would fail the same way.
    if torch.cpu._is_avx512_supported():
        return _load()
    return _load_avx2()


def extension():
    """The compiled module (functions skinny_linear, decode_attention), or None where it cannot run."""
    return _load()[0]


def unavailable_reason() -> str | None:
    """Why extension() is None (no AVX-512, or the compiler's error), else None."""
    return _load()[1]


def linear_kernels():
    """A compiled module with skinny_linear: the AVX-512 extension, else the AVX2 one's; None where neither runs."""
    return _load_linear()[0]


def linear_kernels_unavailable_reason() -> str | None:
    """Why linear_kernels() is None, else None."""
    return _load_linear()[1]


def logprob_kernels():
    """The AVX2 extension (logprobs_entropy, rms_norm) on any CPU with AVX2 and FMA, AVX-512 ones included; else None.

    Only the AVX2 build has these kernels; AVX-512 CPUs run it too. An AVX-512 build was not written: the
    ones with bf16 arithmetic train in autocast, and bf16 logits keep the torch reference (kernels/logprobs.py)."""
    return _load_avx2()[0]


def logprob_kernels_unavailable_reason() -> str | None:
    """Why logprob_kernels() is None, else None."""
    return _load_avx2()[1]


def sampler():
    """A compiled module with sample_tokens: the AVX-512 extension, else the AVX2 sampler's; None where neither runs."""
    return _load_sampler()[0]


def sampler_unavailable_reason() -> str | None:
    """Why sampler() is None, else None."""
    return _load_sampler()[1]


def reset() -> None:
    """Forget the loaded modules or the failures (tests); the next call loads or builds again."""
    _load.cache_clear()
    _load_sampler.cache_clear()
    _load_avx2.cache_clear()
    _load_linear.cache_clear()
