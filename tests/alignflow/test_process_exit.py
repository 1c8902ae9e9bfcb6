"""alignflow/process_exit.py: a program ends with its exit code, its atexit handlers run and its output
flushed, without waiting forever on an idle thread pool."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from alignflow.process_exit import end_process

atexit.register(lambda: print("atexit ran", end=""))
pool = ThreadPoolExecutor(1)
pool.submit(lambda: None).result()  # an idle worker: a plain join of non-daemon threads never returns
worker = threading.Thread(target=lambda: (time.sleep(0.3), print("worker done ", end="")))
worker.start()  # a working non-daemon thread: the exit waits for it, as the interpreter's does
sys.stdout.write("unflushed ")
end_process(3)
"""


def test_the_exit_code_atexit_handlers_threads_and_buffered_output_all_come_through():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3, out.stderr[-2000:]
    assert out.stdout == "unflushed worker done atexit ran"
