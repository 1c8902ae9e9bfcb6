"""host_memory: glibc keeps the stage's freed memory, unless the user chose otherwise or this is not glibc."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from alignflow.stages.common import host_memory


class FakeGlibc:
    """Records mallopt's calls; answers as glibc does (1: accepted)."""

    def __init__(self, answer: int = 1):
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return self.answer

    def gnu_get_libc_version(self) -> bytes:
        return b"2.36"


@pytest.fixture
def clean_env(monkeypatch):
    for name in (host_memory.OPT_OUT_VAR, "GLIBC_TUNABLES", *host_memory.USER_SETTINGS):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_sets_the_mmap_and_trim_thresholds(clean_env):
    libc = FakeGlibc()
    clean_env.setattr(host_memory.ctypes, "CDLL", lambda name: libc)
    assert host_memory.keep_freed_memory() == "kept"
    assert libc.calls == [(-3, 32 * 2**20), (-1, 2**31 - 1)]


def test_a_refusal_is_reported(clean_env):
    clean_env.setattr(host_memory.ctypes, "CDLL", lambda name: FakeGlibc(answer=0))
    assert host_memory.keep_freed_memory() == "refused by glibc"


@pytest.mark.parametrize(
    ("name", "value", "expected"),
    [
        ("ALIGNFLOW_KEEP_FREED_MEMORY", "0", "off (ALIGNFLOW_KEEP_FREED_MEMORY=0)"),
        ("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=1000", "the user's malloc settings"),
        ("MALLOC_MMAP_THRESHOLD_", "65536", "the user's malloc settings"),
    ],
)
def test_the_users_choice_wins(clean_env, name, value, expected):
    libc = FakeGlibc()
    clean_env.setattr(host_memory.ctypes, "CDLL", lambda _: libc)
    clean_env.setenv(name, value)
    assert host_memory.keep_freed_memory() == expected
    assert libc.calls == []


def test_not_glibc_is_left_alone(clean_env):
    class Musl:
        def mallopt(self, parameter, value):
            raise AssertionError("called mallopt of a libc that is not glibc")

    clean_env.setattr(host_memory.ctypes, "CDLL", lambda _: Musl())
    assert host_memory.keep_freed_memory() == "not glibc"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_this_machines_glibc_accepts_the_values():
    # In a fresh process: glibc answers 0 to a value out of its range, which would say "refused by glibc".
    code = "from alignflow.stages.common.host_memory import keep_freed_memory; print(keep_freed_memory())"
    env = {k: v for k, v in os.environ.items()
           if k not in ("GLIBC_TUNABLES", "ALIGNFLOW_KEEP_FREED_MEMORY", *host_memory.USER_SETTINGS)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == "kept"
