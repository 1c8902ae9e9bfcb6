"""Prefect's API server for an `alignflow run` without PREFECT_API_URL: its own process, started at once.

Why not Prefect's own ephemeral start (SubprocessASGIServer): before it spawns the server's process it imports
the server's code into this one (the API, its ORM models, docket: ~3.7 s on a 2-core EPYC), under the
interpreter lock, against the flow's own imports on the main thread, and the process it spawns imports it all
again. Here a thread spawns the same command (uvicorn on Prefect's app factory, the UI off, Prefect's
ephemeral flags and this process's settings), waits for its health check and records its URL; the flow runs
with Prefect's settings pointed at it (`api_settings`, as prefect_test_harness does). The server's seconds
of start-up overlap the CLI's imports (docs/performance.md#start-up).

What it is not: a server for anything but this run. It stops when the CLI exits. A failure here is kept, not
raised: the flow then starts Prefect's own ephemeral server and reports its error.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

# What Prefect's SubprocessASGIServer sets for its server process: no UI, an ephemeral server.
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
# uvicorn's exit code when the port is taken (another process bound it first): try another one.
PORT_IN_USE = 3


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(port: int) -> list[str]:
    """uvicorn serving Prefect's API on 127.0.0.1:port (SubprocessASGIServer's command)."""
    package = importlib.util.find_spec("prefect")
    assert package is not None and package.submodule_search_locations
    app_dir = Path(next(iter(package.submodule_search_locations))).parent
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
            "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]


def healthy(api_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


class PrefectServer:
    """`start()` spawns the server on a thread where Prefect would start an ephemeral one; `wait()` returns
    once it answers (or failed: `error`); `api_settings()` points Prefect at it for the flow; it stops at
    exit."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.process: subprocess.Popen | None = None
        self.api_url: str | None = None
        self.error: str | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prefect-server-start", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        try:
            from prefect.settings import (
                PREFECT_API_URL,
                PREFECT_SERVER_EPHEMERAL_ENABLED,
                PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
                get_current_settings,
            )

            if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
                return  # a configured server, or none allowed: Prefect's own behaviour
            env = {**os.environ, **get_current_settings().to_environment_variables(exclude_unset=True),
                   **SERVER_ENV}
            deadline = time.monotonic() + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
            atexit.register(self.stop)
            while time.monotonic() < deadline:
                port = free_port()
                self.process = subprocess.Popen(server_command(port), env=env)
                api_url = f"http://127.0.0.1:{port}/api"
                while self.process.poll() is None and time.monotonic() < deadline:
                    if healthy(api_url):
                        self.api_url = api_url
                        return
                    time.sleep(0.05)
                if self.process.poll() != PORT_IN_USE:
                    break
            code = self.process.poll() if self.process is not None else None
            self.stop()
            self.error = f"Prefect's server did not answer (exit code {code})"
        except Exception as exc:  # noqa: BLE001 - the flow starts Prefect's own server and reports its error
            self.stop()
            self.error = f"{type(exc).__name__}: {exc}"

    def api_settings(self) -> contextlib.AbstractContextManager:
        """Prefect's settings pointed at this server while the flow runs, in this thread and as the
        process-wide settings its worker threads read (prefect_test_harness does both); nothing when Prefect
        starts or has its own server."""
        if self.api_url is None:
            return contextlib.nullcontext()
        import prefect.context
        from prefect.settings import PREFECT_API_URL, temporary_settings

        stack = contextlib.ExitStack()
        stack.enter_context(temporary_settings(updates={PREFECT_API_URL: self.api_url}))
        stack.enter_context(
            prefect.context._temporary_global_settings_context(prefect.context.get_settings_context())
        )
        return stack

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
