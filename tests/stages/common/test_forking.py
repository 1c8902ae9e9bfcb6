"""stages/common/forking.py: a process marked clean may fork torch workers until a native thread pool starts;
a forked child of a clean process computes with several threads (no inherited pool to wait for)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from alignflow.stages.common import forking


def run_python(code: str) -> str:
    """`code` in a new interpreter (this test process has run torch on several threads: never clean)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_process_never_marked_spawns(monkeypatch):
    monkeypatch.setattr(forking, "_clean_native_threads", None)
    assert not forking.can_fork()
    assert forking.start_method() == "spawn"


@pytest.mark.skipif(sys.platform != "linux", reason="fork is only taken on Linux")
def test_a_clean_process_may_fork_until_torch_starts_its_thread_pool():
    out = run_python("""
        import torch
        from alignflow.stages.common import forking
        forking.mark_clean()
        print(forking.start_method())
        torch.set_num_threads(1)
        x = torch.randn(512, 512)
        x @ x  # one thread: no pool
        print(forking.start_method())
        torch.set_num_threads(2)
        x @ x  # the OpenMP pool starts
        print(forking.start_method())
    """)
    assert out.split() == ["fork", "fork", "spawn"]


@pytest.mark.skipif(sys.platform != "linux", reason="fork is only taken on Linux")
def test_a_forked_child_of_a_clean_process_computes_on_two_threads_what_the_parent_does():
    """The child runs a 2-thread matmul and an elementwise pass (each a parallel region) where the parent's
    imports (torch, transformers, the stages' modules) left their own threads: it finishes, with the parent's
    bits. A child of a process whose pool had started would hang here (the timeout)."""
    out = run_python("""
        import multiprocessing as mp
        import torch
        from alignflow.stages.common import warm, forking
        warm.warm_up()
        forking.mark_clean()
        assert forking.can_fork()

        def work():
            torch.manual_seed(0)
            x = torch.randn(512, 512)
            return float(torch.sigmoid(x @ x).sum())

        def child(queue):
            torch.set_num_threads(2)
            queue.put(work())

        context = mp.get_context(forking.start_method())
        queue = context.Queue()
        process = context.Process(target=child, args=(queue,))
        process.start()
        in_child = queue.get(timeout=60)
        process.join(60)
        torch.set_num_threads(2)
        print(in_child == work(), process.exitcode)
    """)
    assert out.split() == ["True", "0"]
