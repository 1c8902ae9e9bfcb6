"""The C++ CPU kernels' extension: built ahead of time on any x86-64 host, then only loaded."""

from __future__ import annotations

import pytest
import torch
import torch.utils.cpp_extension

from alignflow.kernels import _cpu_extension

pytestmark = pytest.mark.cpu_only("the build of the C++ CPU kernels")


def test_build_ahead_compiles_without_avx512_and_extension_then_loads_that_build(monkeypatch):
    if not _cpu_extension.extension():
        pytest.skip(f"the extension does not build here: {_cpu_extension.unavailable_reason()}")
    built = _cpu_extension.extension().__file__
    # An image build host without AVX-512 still compiles (the flags choose the instructions) ...
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: False)
    path = _cpu_extension.build_ahead()
    assert str(path) == built and path.is_file()
    # ... while running on such a host keeps the torch paths, saying why.
    _cpu_extension.reset()
    try:
        assert _cpu_extension.extension() is None
        assert _cpu_extension.unavailable_reason() == "this CPU has no AVX-512"
    finally:
        monkeypatch.undo()
        _cpu_extension.reset()
    # On an AVX-512 host the ahead-of-time build is loaded, not compiled again.
    calls = []
    real_load = torch.utils.cpp_extension.load
    monkeypatch.setattr(
        torch.utils.cpp_extension, "load", lambda *a, **k: calls.append(k) or real_load(*a, **k)
    )
    assert _cpu_extension.extension().__file__ == built and len(calls) == 1


def test_build_ahead_raises_when_compiling_fails(monkeypatch):
    def no_compiler(*args, **kwargs):
        raise RuntimeError("error: command 'c++' failed: No such file or directory")

    monkeypatch.setattr(torch.utils.cpp_extension, "load", no_compiler)
    with pytest.raises(RuntimeError, match="command 'c\\+\\+' failed"):
        _cpu_extension.build_ahead()


_BUILD_IN_A_FRESH_PROCESS = """
import json, sys, torch
torch.cpu._is_avx512_supported = lambda: False  # an AVX2-only build host, whatever this one is
from alignflow.kernels import _cpu_extension
path = _cpu_extension.build_ahead()
print(json.dumps({"path": str(path), "mtime": path.stat().st_mtime_ns,
                  "mapped": str(path) in open("/proc/self/maps").read(),
                  "extension": _cpu_extension.extension(), "reason": _cpu_extension.unavailable_reason()}))
"""


@pytest.mark.slow
@pytest.mark.heavy
def test_build_ahead_compiles_without_loading_and_a_new_process_finds_that_build_up_to_date():
    # A fresh process each time: the build host (and /proc/self/maps) has never seen the extension.
    # Loading the AVX-512 library on an AVX2-only host is what died with SIGILL in the image build.
    import json
    import subprocess
    import sys

    if not torch.utils.cpp_extension.is_ninja_available():
        pytest.skip("ninja is not installed: torch's cpp_extension cannot build")
    runs = []
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, "-c", _BUILD_IN_A_FRESH_PROCESS], capture_output=True, text=True, timeout=480
        )
        assert done.returncode == 0, done.stderr[-2000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["path"].endswith(f"{_cpu_extension.NAME}.so") and not first["mapped"]
    assert first["extension"] is None and first["reason"] == "this CPU has no AVX-512"
    # The second process compiles nothing (ninja finds the build up to date): what `extension()` relies
    # on in a container, whose first `load` must only import the image's build.
    assert second == first


def test_a_build_lock_left_by_a_killed_build_is_removed_and_a_recent_one_kept(monkeypatch, tmp_path):
    import os
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "some_extension" / "lock"
    lock.parent.mkdir()
    lock.touch()
    # Another process may be compiling right now: torch's load waits for its lock.
    assert _cpu_extension.clear_stale_lock("some_extension") is None and lock.exists()
    old = time.time() - _cpu_extension.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    with pytest.warns(
        RuntimeWarning, match=r"removing the build lock .*some_extension/lock, left 16 minutes ago"
    ):
        assert _cpu_extension.clear_stale_lock("some_extension") == lock
    assert not lock.exists()
    assert _cpu_extension.clear_stale_lock("some_extension") is None  # nothing to remove


def test_compiling_clears_a_stale_lock_before_torch_waits_on_it(monkeypatch, tmp_path):
    import os

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "some_extension" / "lock"
    lock.parent.mkdir()
    lock.touch()
    os.utime(lock, (0, 0))
    seen = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load", lambda name, **kwargs: seen.append(lock.exists()))
    with pytest.warns(RuntimeWarning, match="removing the build lock"):
        _cpu_extension._compile("some_extension", [], [])
    assert seen == [False]  # torch's load, which would wait on the lock forever, no longer sees it
