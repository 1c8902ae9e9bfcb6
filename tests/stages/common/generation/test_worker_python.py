"""engine.worker_python: interpreters that cannot host the engine are refused in one line naming the key and
the fix; a child under another interpreter keeps that interpreter's sys.path, skips the stage's __main__, and
hands back its result or its exception. (Rollout workers under one:
tests/stages/ppo/test_rollout_workers.py.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from alignflow.stages.common.generation.worker_python import WorkerPythonError, call_in, resolve


def same_venv_other_path() -> str:
    """This venv's interpreter under another name (bin/python3 next to bin/python): the same packages, but not
    sys.executable, so resolve() checks it and children start through the foreign-interpreter path."""
    here = Path(sys.executable)
    for name in ("python3", "python", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        other = here.with_name(name)
        if other.exists() and os.path.abspath(other) != os.path.abspath(here):
            return str(other)
    pytest.skip(f"no second name for {here} in its bin/ folder")


def bare_venv(path: Path, *site_lines: str) -> str:
    """A venv without pip (~1 s) whose site-packages holds a .pth with `site_lines`
    (extra sys.path entries)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    site = next(path.glob("lib/python*/site-packages"))
    if site_lines:
        (site / "extra.pth").write_text("\n".join(site_lines) + "\n")
    return str(path / "bin" / "python")


# What a child sees, as an expression for the builtin eval: a child unpickles its target by reference, and
# under another interpreter only that interpreter's own sys.path is searched (this test module is not on it).
CHILD_VIEW = (
    "(__import__('os').getpid(), list(__import__('sys').path), __import__('sys').executable, "
    "__import__('sys').modules['__main__'].__name__, 'alignflow.offline' in __import__('sys').modules)"
)


def test_unset_or_this_interpreter_means_in_process():
    assert resolve(None, "vllm") is None
    assert resolve(sys.executable, "vllm") is None


def test_a_path_with_no_interpreter_names_the_key_and_the_fix(tmp_path):
    with pytest.raises(
        WorkerPythonError,
        match=rf"^engine.worker_python={tmp_path}/nope/python: no executable there; "
        r"set it to the python of a venv with this checkout installed",
    ):
        resolve(str(tmp_path / "nope" / "python"), "vllm")


def test_an_interpreter_without_this_torch_is_refused(tmp_path, monkeypatch):
    # the probe runs in the stage's folder; the checkout's must not be on its path
    monkeypatch.chdir(tmp_path)
    python = bare_venv(tmp_path / "venv")
    with pytest.raises(
        WorkerPythonError,
        match=r"engine.worker_python=.*/venv/bin/python has torch None, this stage "
        r"torch 2\.\S+: .*install torch==2",
    ):
        resolve(python, "vllm")


def test_an_interpreter_with_alignflow_from_another_checkout_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    other = tmp_path / "other-clone"
    (other / "alignflow").mkdir(parents=True)
    (other / "alignflow" / "__init__.py").write_text('"""another checkout"""\n')
    site = next(p for p in sys.path if p.endswith("site-packages") and Path(p, "torch").is_dir())
    # torch (this one) is there; alignflow is another's
    python = bare_venv(tmp_path / "venv", str(other), site)
    with pytest.raises(
        WorkerPythonError,
        match=rf"imports alignflow from {other}/alignflow, not this checkout "
        rf".*run `{python} -m pip install --no-deps -e ",
    ):
        resolve(python, "hf")


def test_an_interpreter_without_the_backends_package_names_it():
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is importable in this venv")
    with pytest.raises(
        WorkerPythonError,
        match=r"engine.worker_python=.* cannot find the 'vllm' package the engine "
        r"needs; install it in that venv \(scripts/vllm_tests.sh",
    ):
        resolve(same_venv_other_path(), "vllm")


def test_a_worker_python_error_is_a_configuration_error_of_the_stage():
    from alignflow.stages.common.runtime import BAD_INPUT_ERRORS

    assert issubclass(WorkerPythonError, BAD_INPUT_ERRORS)  # stage_main exits 2: not retried


def test_a_child_under_another_interpreter_keeps_its_sys_path_and_returns_or_raises(monkeypatch):
    interpreter = resolve(same_venv_other_path(), "hf")
    assert interpreter is not None
    # As if this process were `python -m alignflow.offline` (a stage runs as `python -m
    # alignflow.stages.ppo.stage`): spawn would re-run that module as __mp_main__ in the child, which under a
    # vLLM venv fails (the RL stage's module imports DeepSpeed).
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.util.find_spec("alignflow.offline")
    monkeypatch.setitem(sys.modules, "__main__", main)
    pid, path, executable, child_main, offline_loaded = call_in(
        interpreter, eval, CHILD_VIEW, what="a probe child"
    )
    assert pid != os.getpid()
    assert executable == interpreter.python
    assert tuple(path) == interpreter.sys_path  # its own, not this process's
    assert child_main == "__main__" and offline_loaded is False  # not re-run as __mp_main__
    # A function of that __main__ (engine.py's build_and_check when the stage runs as `python -m ...`) is sent
    # as the same function of the module imported under its own name.
    from alignflow import offline

    as_main = types.FunctionType(offline.set_offline_defaults.__code__, vars(offline), "set_offline_defaults")
    as_main.__module__ = "__main__"
    main.set_offline_defaults = as_main
    assert call_in(interpreter, as_main, what="a function of __main__") is None
    # The child's own exception comes back as itself (a WorkerPythonError raised there), traceback as a note.
    with pytest.raises(WorkerPythonError, match=r"engine.worker_python=/nope/python: no executable") as err:
        call_in(interpreter, resolve, "/nope/python", "vllm", what="a failing child")
    assert any("ran under" in note and "Traceback" in note for note in err.value.__notes__)
    assert call_in(None, eval, CHILD_VIEW, what="in process")[0] == os.getpid()
