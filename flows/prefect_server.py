"""Prefect's API server for an `alignflow run` without PREFECT_API_URL: its own process, started at once.

Why not Prefect's own ephemeral start (SubprocessASGIServer): before it spawns the server's process it imports
the server's code into this one (the API, its ORM models, docket: ~3.7 s on a 2-core EPYC), under the
interpreter lock, against the flow's own imports on the main thread, and the process it spawns imports it all
again. Here a thread spawns the same server (uvicorn on Prefect's app factory, the UI off, Prefect's ephemeral
flags, this process's environment; `serve`, this module as a program) before it has imported anything of
Prefect, then reads Prefect's settings (an API configured in a profile stops it again), waits for its health
check and records its URL; the flow runs with Prefect's settings pointed at it (`api_settings`, as
prefect_test_harness does). The server's seconds of start-up overlap the CLI's imports
(docs/performance.md#start-up).

What it is not: a server for anything but this run. It stops when the CLI exits. A failure here is kept, not
raised: the flow then starts Prefect's own ephemeral server and reports its error.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request

from alignflow.import_gc import imports_without_gc

# What Prefect's SubprocessASGIServer sets for its server process: no UI, an ephemeral server.
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
# uvicorn's exit code when the port is taken (another process bound it first): try another one.
PORT_IN_USE = 3


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(port: int) -> list[str]:
    """This module as a program: Prefect's API on 127.0.0.1:port (`serve`)."""
    return [sys.executable, "-m", "alignflow.flows.prefect_server", str(port)]


def serve(port: int) -> None:
    """The server's process: Prefect's app (its factory, as SubprocessASGIServer's uvicorn command calls it)
    made with the collector off (alignflow/import_gc.py), under uvicorn on 127.0.0.1:port; exits 3
    (PORT_IN_USE) when the port is taken."""
    with imports_without_gc():
        import uvicorn
        from prefect.server.api.server import create_app

        app = create_app()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")


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
            if os.environ.get("PREFECT_API_URL"):
                return  # a configured server: Prefect's own behaviour
            # Spawned before Prefect's settings are imported here (~1 s on a 2-core EPYC): with no temporary
            # settings in this process, the server reads the same ones from the same environment, profile and
            # prefect.toml. What they say is checked after.
            env = {**os.environ, **SERVER_ENV}
            started = time.monotonic()
            atexit.register(self.stop)
            port = self._spawn(env)
            from prefect.settings import (
                PREFECT_API_URL,
                PREFECT_SERVER_EPHEMERAL_ENABLED,
                PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
            )

            if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
                self.stop()  # a server configured in a profile or prefect.toml, or none allowed
                return
            deadline = started + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
            while True:
                assert self.process is not None
                api_url = f"http://127.0.0.1:{port}/api"
                while self.process.poll() is None and time.monotonic() < deadline:
                    if healthy(api_url):
                        self.api_url = api_url
                        return
                    time.sleep(0.05)
                if self.process.poll() != PORT_IN_USE or time.monotonic() >= deadline:
                    break
                port = self._spawn(env)
            code = self.process.poll()
            self.stop()
            self.error = f"Prefect's server did not answer (exit code {code})"
        except Exception as exc:  # noqa: BLE001 - the flow starts Prefect's own server and reports its error
            self.stop()
            self.error = f"{type(exc).__name__}: {exc}"

    def _spawn(self, env: dict[str, str]) -> int:
        """Start the server on a free port; returns the port."""
        port = free_port()
        self.process = subprocess.Popen(server_command(port), env=env)
        return port

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


if __name__ == "__main__":
    serve(int(sys.argv[1]))
