"""The C++ extensions' build directories are keyed by a digest of what goes in, so checkouts share one build.

Most tests here compile a stand-in extension (one small C++ file with a header, no torch headers: a second
or two) through the same `compile_keyed` as the kernels, each build in a fresh process as a stage would
load it; one checks, without compiling, that the kernels themselves go through it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.cpp_extension

from alignflow.kernels import _cpu_extension

pytestmark = pytest.mark.cpu_only("the CPU extensions' build (g++ on the host)")

_STAND_IN = r"""
// A stand-in extension for the build's tests: the plain C API, so it compiles in a second.
#include <Python.h>
#include "sub/value.h"

#define CONCAT2(a, b) a##b
#define CONCAT(a, b) CONCAT2(a, b)
#define STRING2(a) #a
#define STRING(a) STRING2(a)

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, STRING(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};

PyMODINIT_FUNC CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
    PyObject* module = PyModule_Create(&module_def);
    if (module != nullptr && PyModule_AddIntConstant(module, "VALUE", VALUE) != 0) Py_CLEAR(module);
    return module;
}
"""
_NAME = "alignflow_stand_in_extension"
_FLAGS = ["-O1"]

_BUILD_IN_A_FRESH_PROCESS = """
import json, sys
from pathlib import Path
from alignflow.kernels import _cpu_extension
root = Path(sys.argv[1])
module = _cpu_extension.compile_keyed(sys.argv[2], [root / "stand_in.cpp"], sys.argv[3:], root=root)
# Loaded again in the same process, as after reset(): the same build (torch's load once grew the flag list it
# was given, and with it the digest).
again = _cpu_extension.compile_keyed(sys.argv[2], [root / "stand_in.cpp"], sys.argv[3:], root=root)
print(json.dumps({"file": module.__file__, "value": module.VALUE, "again": again.__file__}))
"""


def _checkout(path: Path, value: int = 41) -> Path:
    """A kernels source tree as a checkout has it: a source, and a header in a subfolder."""
    (path / "sub").mkdir(parents=True)
    (path / "stand_in.cpp").write_text(_STAND_IN)
    (path / "sub" / "value.h").write_text(f"#pragma once\n#define VALUE {value}\n")
    return path


def _digest(root: Path, flags=_FLAGS) -> str:
    return _cpu_extension.build_digest(_cpu_extension.build_key(
        _cpu_extension.build_inputs([root / "stand_in.cpp"], root), flags))


def test_the_digest_follows_every_byte_and_flag_that_goes_in_and_nothing_else(tmp_path, monkeypatch):
    first = _digest(_checkout(tmp_path / "a"))
    assert len(first) == 12 and int(first, 16) >= 0
    other = shutil.copytree(tmp_path / "a", tmp_path / "b")  # a second checkout, other paths and mtimes
    assert _digest(other) == first
    os.utime(other / "stand_in.cpp", (0, 0))
    (other / "NOTES.md").write_text("not compiled")
    assert _digest(other) == first

    changed = {"a flag": _digest(other, ["-O2"]), "a flag added": _digest(other, [*_FLAGS, "-mavx2"])}
    source = (other / "stand_in.cpp").read_bytes()
    (other / "stand_in.cpp").write_bytes(source.replace(b"a second", b"a second."))  # one byte, in a comment
    changed["a source byte"] = _digest(other)
    (other / "stand_in.cpp").write_bytes(source)
    (other / "sub" / "value.h").write_text("#pragma once\n#define VALUE 42\n")
    changed["a header byte"] = _digest(other)
    (other / "sub" / "value.h").write_text("#pragma once\n#define VALUE 41\n")
    assert _digest(other) == first
    (other / "sub" / "more.h").write_text("#pragma once\n")  # any header may be included: it is in the digest
    changed["a header added"] = _digest(other)
    (other / "sub" / "more.h").unlink()
    monkeypatch.setenv("CXX", "clang++")
    changed["the compiler"] = _digest(other)
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(torch, "__version__", "2.99.0+cpu")
    changed["torch's version"] = _digest(other)
    monkeypatch.undo()
    assert _digest(other) == first
    assert {what: digest for what, digest in changed.items() if digest == first} == {}
    assert len(set(changed.values())) == len(changed)


def test_two_checkouts_of_the_kernels_share_one_build_directory_per_extension(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    clone = Path(shutil.copytree(_cpu_extension.CSRC, tmp_path / "clone" / "kernels" / "csrc"))
    directories = set()
    for name, sources, flags in [
        (_cpu_extension.NAME, _cpu_extension.SOURCES, _cpu_extension._FLAGS),
        (_cpu_extension.AVX2_NAME, _cpu_extension.AVX2_SOURCES, _cpu_extension._AVX2_FLAGS),
    ]:
        ours, theirs = (
            _cpu_extension.keyed_build_directory(
                name,
                _cpu_extension.build_key(
                    _cpu_extension.build_inputs(
                        [root / s.relative_to(_cpu_extension.CSRC) for s in sources], root
                    ),
                    flags,
                ),
            )
            for root in (_cpu_extension.CSRC, clone)
        )
        assert ours == theirs and ours.parent == tmp_path / "extensions"
        assert ours.name.startswith(f"{name}_") and len(ours.name) == len(name) + 13
        directories.add(ours)
    assert len(directories) == 2


def test_the_kernels_are_built_through_the_keyed_builder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: True)
    built = []

    def record(name, sources, flags, build_directory=None):
        built.append((name, sources, flags, build_directory))
        return str(build_directory / f"{name}.so")

    monkeypatch.setattr(_cpu_extension, "_compile", record)
    _cpu_extension.reset()
    try:
        _cpu_extension.extension()
        _cpu_extension.logprob_kernels()
        _cpu_extension.build_ahead()
    finally:
        _cpu_extension.reset()
    expected = {
        _cpu_extension.NAME: (_cpu_extension.SOURCES, _cpu_extension._FLAGS),
        _cpu_extension.AVX2_NAME: (_cpu_extension.AVX2_SOURCES, _cpu_extension._AVX2_FLAGS),
    }
    assert sorted(name for name, *_ in built) == sorted([*expected, *expected])
    for name, staged, flags, directory in built:
        sources, expected_flags = expected[name]
        key = _cpu_extension.build_key(_cpu_extension.build_inputs(sources), expected_flags)
        assert (
            flags == expected_flags and directory == tmp_path / f"{name}_{_cpu_extension.build_digest(key)}"
        )
        # Compiled from the copy in the build directory, the same bytes, headers beside them.
        assert staged == [directory / "src" / s.relative_to(_cpu_extension.CSRC) for s in sources]
        assert [s.read_bytes() for s in staged] == [s.read_bytes() for s in sources]
        assert all(s.stat().st_mode & 0o777 == 0o644 for s in staged)
        assert (directory / "src" / "kernels.h").read_bytes() == (
            _cpu_extension.CSRC / "kernels.h"
        ).read_bytes()
        assert json.loads((directory / "key.json").read_text())["files"] == key["files"]


def _needs_a_compiler():
    if not torch.utils.cpp_extension.is_ninja_available():
        pytest.skip("ninja is not installed: torch's cpp_extension cannot build")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler")


def _build_in_a_fresh_process(root: Path, extensions: Path, flags=_FLAGS) -> subprocess.Popen:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, "-c", _BUILD_IN_A_FRESH_PROCESS, str(root), _NAME, *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(process: subprocess.Popen) -> dict:
    out, err = process.communicate(timeout=240)
    assert process.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])


def _compiles(build_directory: Path) -> list[str]:
    """The outputs of the commands ninja ran in build_directory, from its log (one line a command)."""
    lines = (build_directory / ".ninja_log").read_text().splitlines()
    return [line.split("\t")[3] for line in lines if not line.startswith("#")]


def test_a_second_checkout_in_a_fresh_process_loads_the_first_ones_build_without_compiling(tmp_path):
    _needs_a_compiler()
    extensions = tmp_path / "extensions"
    first = _result(_build_in_a_fresh_process(_checkout(tmp_path / "a"), extensions))
    library = Path(first["file"])
    assert first["value"] == 41 and library.parent == extensions / f"{_NAME}_{_digest(tmp_path / 'a')}"
    assert first["again"] == first["file"]
    built = library.stat().st_mtime_ns, _compiles(library.parent)
    assert sorted(built[1]) == [f"{_NAME}.so", "stand_in.o"]

    # Another checkout of the same sources, whose files are newer than the build: found up to date.
    second = _result(_build_in_a_fresh_process(_checkout(tmp_path / "b"), extensions))
    assert second == first and (library.stat().st_mtime_ns, _compiles(library.parent)) == built

    # A changed header is another build, beside the first, which is left as it was.
    (tmp_path / "b" / "sub" / "value.h").write_text("#pragma once\n#define VALUE 42\n")
    third = _result(_build_in_a_fresh_process(tmp_path / "b", extensions))
    assert third["value"] == 42 and Path(third["file"]).parent.parent == extensions
    assert Path(third["file"]).parent != library.parent
    assert (library.stat().st_mtime_ns, _compiles(library.parent)) == built


def test_two_processes_building_one_digest_at_once_compile_it_once(tmp_path):
    _needs_a_compiler()
    extensions = tmp_path / "extensions"
    # Both stage the sources and reach torch's lock (build_directory/lock) at about the same time.
    processes = [_build_in_a_fresh_process(_checkout(tmp_path / checkout), extensions) for checkout in "ab"]
    first, second = (_result(process) for process in processes)
    assert first == second and first["value"] == 41
    build_directory = Path(first["file"]).parent
    assert sorted(_compiles(build_directory)) == [f"{_NAME}.so", "stand_in.o"]
    assert not (build_directory / "lock").exists()
    assert [path.name for path in extensions.iterdir()] == [build_directory.name]
