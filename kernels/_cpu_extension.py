"""Builds and loads the C++ CPU kernels of kernels/csrc/ as torch extensions (callers choose the path).

Compiled on first use with torch.utils.cpp_extension (g++, ninja; about a minute on 2 cores,
docs/engines.md#the-native-generation-engine-on-a-cpu), then cached in TORCH_EXTENSIONS_DIR and loaded from
there. The kernels use AVX-512: on a CPU without it, or where the build fails, `extension()` is None and
`unavailable_reason()` says why; the build failure also warns once, because the callers then fall back to
slower torch paths.

The sampler and skinny_linear also have an AVX2 build (csrc/avx2/, its own extension, which alone has the
training step's log-prob and entropy kernels, `logprob_kernels()`): `sampler()` and
`linear_kernels()` are the AVX-512 extension where it runs, else that one on CPUs with AVX2 and FMA: there
the chunked torch sampler (Gumbel windows and ~20 operator calls) is a large share of a small model's decode
step (docs/performance.md#cpu-kernels).

Each build lives in a directory named by a digest of what goes into it (`build_key`): <name>_<digest12> under
TORCH_EXTENSIONS_DIR, holding a copy of its sources (src/) and a key.json saying what the digest covers. Every
checkout, clone or installed copy with the same sources, flags, Python and torch install therefore finds one
build, and a change to any of them makes a new one instead of recompiling over another checkout's. Builds
for other digests are left in place, never pruned: another checkout (a CI clone at another commit) or a
running process may be using one, and nothing records which; with nothing running, removing
TORCH_EXTENSIONS_DIR/alignflow_cpu_kernels_* is safe (the next load builds again).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sysconfig
import tempfile
import time
import warnings
from pathlib import Path
from unittest import mock

import torch

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.cpp"))
NAME = "alignflow_cpu_kernels"
_FLAGS = ["-O3", "-mavx512f", "-mfma", "-fopenmp"]
# A tuple: torch's load appends its own -L/-l flags to the extra_ldflags list it is given, so it gets a copy
# (a shared list grew at each load, and with it this build's digest).
_LDFLAGS = ("-fopenmp",)


# The decode loop (csrc/decode_loop.cpp) is written over both builds' pieces and compiled into each.
AVX2_SOURCES = [CSRC / "decode_loop.cpp", *sorted((CSRC / "avx2").glob("*.cpp"))]
AVX2_NAME = "alignflow_cpu_kernels_avx2"
_AVX2_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp"]

# A build holds <build dir>/lock while it compiles, and torch's `load` waits, without a time limit, for
# that file to go. A process killed mid-build leaves it behind, and every later load then hangs (a whole
# test run stuck at collection). A build takes a few minutes at most, all three extensions at once on 2
# cores included, so a lock 15 minutes old is taken to be a leftover and removed.
STALE_LOCK_SECONDS = 15 * 60

# The sources copied into a build directory all carry this modification time (1980-01-01, zip's epoch). Their
# digest, not their mtime, says they are current: two processes staging the same digest at once write the same
# bytes, and a copy written while the other compiles must not look newer than its objects to ninja.
_STAGED_MTIME = 315532800


def clear_stale_lock(name: str, build_directory: Path | None = None) -> Path | None:
    """Remove a build lock older than STALE_LOCK_SECONDS (warning); returns the path removed.

    The lock is build_directory's, else torch's default directory for `name`."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = Path(build_directory or _get_build_directory(name, verbose=False)) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return None
    if age < STALE_LOCK_SECONDS:
        return None  # another process may be compiling now: torch's load waits for it
    warnings.warn(
        f"removing the build lock {lock}, left {age / 60:.0f} minutes ago by a build that did not "
        f"finish (a killed process); the extension {name} is built again",
        RuntimeWarning,
        stacklevel=3,
    )
    lock.unlink(missing_ok=True)
    return lock


def build_inputs(sources: list[Path], root: Path = CSRC) -> dict[str, bytes]:
    """The files a build compiles: each source, and every header under `root` (what the sources may include).

    Keyed by their paths relative to `root`, which holds them all: a source's relative includes
    ("../kernels.h", "avx2/rows_avx2.h") find the same files in the copy staged in the build directory."""
    headers = [path for path in root.rglob("*.h") if path.is_file()]
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted({*sources, *headers})}


def build_key(files: dict[str, bytes], flags: list[str]) -> dict:
    """Everything a build's result depends on: its files' sha256, the compiler flags, Python's ABI and torch.

    torch's install directory and Python's include directory are in it although they do not change the
    binary: torch writes them into build.ninja, and ninja recompiles everything when a command line
    changes, so two venvs sharing one directory would rebuild each other's build at every alternate load."""
    return {
        "files": {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()},
        "cflags": list(flags),
        "ldflags": list(_LDFLAGS),
        "compiler": os.environ.get("CXX", "c++"),  # torch's choice, written into build.ninja
        "python_abi": sysconfig.get_config_var("EXT_SUFFIX"),
        "python_include": sysconfig.get_paths()["include"],
        "torch": torch.__version__,
        "torch_dir": os.path.dirname(os.path.realpath(torch.__file__)),
    }


def build_digest(key: dict) -> str:
    """The first 12 hex digits of the key's sha256 (its JSON, keys sorted)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]


def keyed_build_directory(name: str, key: dict) -> Path:
    """<TORCH_EXTENSIONS_DIR>/<name>_<digest12> (created), or torch's default root in its place."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(f"{name}_{build_digest(key)}", verbose=False))


def _write_once(path: Path, data: bytes) -> None:
    # Whole or not at all (a temporary file renamed over the path), so a file found there is complete.
    if path.is_file():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.utime(tmp, (_STAGED_MTIME, _STAGED_MTIME))
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the sources from the build's other users
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def compile_keyed(name: str, sources: list[Path], flags: list[str], root: Path = CSRC):
    """Build (or find built) and load `sources` in the build directory of their digest; returns the module.

    The sources are compiled from a copy in that directory (src/), not from the checkout: build.ninja then
    names the same paths from every checkout, so ninja finds another checkout's build up to date. The
    copy is of the bytes the digest was taken over, so a checkout edited mid-build cannot put other
    bytes under this digest. The module keeps its name (`name`); only its directory carries the digest."""
    files = build_inputs(sources, root)
    key = build_key(files, flags)
    build_directory = keyed_build_directory(name, key)
    staged = build_directory / "src"
    for rel, data in files.items():
        _write_once(staged / rel, data)
    _write_once(
        build_directory / "key.json",
        json.dumps({"name": name, "digest": build_digest(key), **key}, indent=1, sort_keys=True).encode(),
    )
    return _compile(name, [staged / source.relative_to(root) for source in sources], flags, build_directory)


def _compile(name: str, sources: list[Path], flags: list[str], build_directory: Path | None = None):
    from torch.utils.cpp_extension import load

    clear_stale_lock(name, build_directory)
    # torch's load holds build_directory/lock (a file created with O_EXCL) while it compiles, so two
    # processes building one digest at once compile it once: the second waits, then imports.
    return load(
        name,
        sources=[str(s) for s in sources],
        extra_cflags=list(flags),
        extra_ldflags=list(_LDFLAGS),
        build_directory=None if build_directory is None else str(build_directory),
        verbose=False,
    )


def _library_path(module_name: str, build_directory: str, is_python_module: bool) -> str:
    from torch.utils.cpp_extension import LIB_EXT

    return os.path.join(build_directory, f"{module_name}{LIB_EXT}")


def build_ahead() -> Path:
    """Compile the extension into TORCH_EXTENSIONS_DIR now, on any x86-64 CPU; returns the .so's path.

    For container images: a stage container starts from the image's file system every run, so a
    kernel compiled at run time is compiled again by every engine and PPO stage (about a minute on 2
    cores each time).
    The build host need not have AVX-512 (the flags, not the host, decide the instructions); at run
    time `extension()` finds this build, up to date, and only loads it. Raises if compiling fails.

    It compiles without loading: loading runs the module's initialisers, which -O3 -mavx512f may
    vectorise with AVX-512, so an AVX2-only build host would die with SIGILL (exit 132). torch 2.13's
    `load` has no build-only mode (is_python_module=False still dlopens via torch.ops.load_library), so
    its last step, the import, is replaced by returning the library's path; everything before it (the
    same keyed build directory as `extension()`, ninja's up-to-date check, the lock) is torch's own or
    `compile_keyed`'s, so the run-time `load` finds this build and only imports it. mock.patch.object
    fails loudly if a torch release renames that step.
    """
    from torch.utils import cpp_extension

    with mock.patch.object(cpp_extension, "_import_module_from_library", _library_path):
        # the sampler and skinny_linear of AVX2-only hosts
        compile_keyed(AVX2_NAME, AVX2_SOURCES, _AVX2_FLAGS)
        return Path(compile_keyed(NAME, SOURCES, _FLAGS))


@functools.cache
def _load() -> tuple[object | None, str | None]:
    if not torch.cpu._is_avx512_supported():
        return None, "this CPU has no AVX-512"
    return _build(NAME, SOURCES, _FLAGS)


def _build(name: str, sources: list[Path], flags: list[str]) -> tuple[object | None, str | None]:
    try:
        module = compile_keyed(name, sources, flags)
    except Exception as exc:  # no compiler, no ninja, no headers: the callers keep their torch paths
        names = ", ".join(s.name for s in sources)
        why = f"building {names} failed: {type(exc).__name__}: {str(exc).strip()[-500:]}"
        warnings.warn(
            f"{why}; CPU kernels fall back to torch (slower decoding). Install g++ and ninja, and make "
            "TORCH_EXTENSIONS_DIR writable, to use them",
            RuntimeWarning,
            stacklevel=4,
        )
        return None, why
    return module, None


@functools.cache
def _load_sampler() -> tuple[object | None, str | None]:
    module, why = _load()
    if module is not None:
        return module, None
    # Its noise equals the reference's where torch's own log kernels are the AVX2 ones (the same SLEEF
    # function).
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
    """A compiled module with skinny_linear: the AVX-512 extension, else the AVX2 one's;
    None where neither runs."""
    return _load_linear()[0]


def linear_kernels_unavailable_reason() -> str | None:
    """Why linear_kernels() is None, else None."""
    return _load_linear()[1]


def logprob_kernels():
    """The AVX2 extension (logprobs_entropy, rms_norm, silu_mul, rope) on any CPU with AVX2 and FMA,
    AVX-512 ones included; else None.

    Only the AVX2 build has these kernels; AVX-512 CPUs run it too. An AVX-512 build was not written: the
    ones with bf16 arithmetic train in autocast, and bf16 logits keep the torch reference
    (kernels/logprobs.py)."""
    return _load_avx2()[0]


def node_kernels(op: str, impl: str, *tensors: torch.Tensor):
    """The AVX2 extension for one of its float32 CPU autograd nodes (rms_norm, silu_mul, rope), or None for
    the caller's torch reference. impl "auto": the extension where every tensor is float32 on CPU, it
    builds, and torch.compile is not tracing (a pybind call would break its graph); "cpp": the extension,
    or an error saying why not; "torch": None."""
    if impl not in ("auto", "cpp", "torch"):
        raise ValueError(f"{op}: impl must be 'auto', 'cpp' or 'torch', got {impl!r}")
    fits = all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)
    if impl == "torch" or (impl == "auto" and (not fits or torch.compiler.is_compiling())):
        return None
    kernels = logprob_kernels()
    if impl == "cpp":
        if kernels is None:
            raise RuntimeError(f"{op} impl='cpp': {logprob_kernels_unavailable_reason()}")
        if not fits:
            got = ", ".join(f"{t.dtype} on {t.device}" for t in tensors)
            raise ValueError(f"{op} impl='cpp' takes float32 CPU tensors, got {got}; use impl='auto'")
    return kernels


def logprob_kernels_unavailable_reason() -> str | None:
    """Why logprob_kernels() is None, else None."""
    return _load_avx2()[1]


def sampler():
    """A compiled module with sample_tokens: the AVX-512 extension, else the AVX2 sampler's;
    None where neither runs."""
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
