"""Prefect's API server for an `alignflow run` without PREFECT_API_URL: its own process, started at once.

Why not Prefect's own ephemeral start (SubprocessASGIServer): before it spawns the server's process it imports
the server's code into this one (the API, its ORM models, docket: ~3.7 s on a 2-core EPYC), under the
interpreter lock, against the flow's own imports on the main thread, and the process it spawns imports it all
again. Here a thread spawns the same server (uvicorn on Prefect's app factory, the UI off, Prefect's ephemeral
flags; `serve`, this module as a program) before it has imported anything of Prefect, then reads Prefect's
settings (an API configured in a profile stops it again), waits for its health check and records its URL; the
flow runs with Prefect's settings pointed at it (`api_settings`, as prefect_test_harness does). The server's
seconds of start-up overlap the CLI's imports (docs/performance.md#start-up).

The server is kept for the next run (flows/kept_server.py: one per Prefect settings, a lease per run using it,
it exits ALIGNFLOW_KEEP_S seconds after the last run let go of it); a run that finds one
running uses it and starts nothing. With ALIGNFLOW_KEEP_S=0 the server is this run's and
stops when the CLI exits. A failure here is kept, not raised: the flow then starts Prefect's own ephemeral
server and reports its error.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from alignflow.flows.kept_server import KeptServer, exit_on_sigterm, healthy, keep_seconds, server_env
from alignflow.import_gc import imports_without_gc

# What Prefect's SubprocessASGIServer sets for its server process: no UI, an ephemeral server.
SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
# The server's auth string (Prefect's): a run that starts one sets a new random one, so that only runs of this
# user, which read it from the state file, can use its API (its health check stays open).
AUTH_VAR = "PREFECT_SERVER_API_AUTH_STRING"
# uvicorn's exit code when the port is taken (another process bound it first): try another one.
PORT_IN_USE = 3


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(port: int, kept: KeptServer | None = None, keep_s: float = 0.0) -> list[str]:
    """This module as a program: Prefect's API on 127.0.0.1:port (`serve`), kept as `kept` when given."""
    command = [sys.executable, "-m", "alignflow.flows.prefect_server", str(port)]
    if kept is not None:
        command += ["--kept-in", str(kept.folder), "--key", kept.key, "--keep-s", str(keep_s)]
    return command


def serve(port: int, kept: KeptServer | None = None, keep_s: float = 0.0) -> int:
    """The server's process: Prefect's app (its factory, as SubprocessASGIServer's uvicorn command calls it)
    made with the collector off (alignflow/import_gc.py), under uvicorn on 127.0.0.1:port. When `kept`, it
    publishes its state once it listens and stops once unused for keep_s seconds (flows/kept_server.py).
    Returns 3 (PORT_IN_USE) when the port is taken."""
    with imports_without_gc():
        import uvicorn
        from prefect.server.api.server import create_app

        app = create_app()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="on")
    server = uvicorn.Server(config)
    if kept is not None:
        threading.Thread(target=_keep, args=(server, kept, port, keep_s), name="kept", daemon=True).start()
        exit_on_sigterm()  # through the `finally` below
    try:
        server.run()
    finally:
        if kept is not None:
            kept.withdraw()
    return 0 if server.started else PORT_IN_USE


def _keep(server, kept: KeptServer, port: int, keep_s: float) -> None:
    """Publish the server's state once it listens; stop it once no run has used it for keep_s seconds."""
    while not server.started:
        if server.should_exit:
            return
        time.sleep(0.02)
    kept.publish(port=port, api_url=f"http://127.0.0.1:{port}/api", auth=os.environ.get(AUTH_VAR))
    kept.wait_until_unused(keep_s, lambda: server.should_exit)
    server.should_exit = True


class PrefectServer:
    """`start()` finds the kept server or spawns one on a thread where Prefect would start an ephemeral one;
    `wait()` returns once it answers (or failed: `error`); `api_settings()` points Prefect at it for the flow.
    At exit this run lets go of a kept server, or stops its own."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.process: subprocess.Popen | None = None
        self.api_url: str | None = None
        self.auth: str | None = None  # the API's auth string, when this module chose it
        self.error: str | None = None
        self.kept: KeptServer | None = None
        self.reused = False  # a kept server of an earlier run answered
        self._lease: Path | None = None

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
            env = {**server_env(os.environ), **SERVER_ENV}
            keep_s = keep_seconds()
            started = time.monotonic()
            atexit.register(self.stop)
            if keep_s > 0:
                self.kept = KeptServer.for_environment(env)
                self._lease = self.kept.hold()
                self.api_url = self.kept.running_url()
                self.reused = self.api_url is not None
                if self.reused:
                    self.auth = (self.kept.read_state() or {}).get("auth")
            port = None if self.reused else self._spawn(env, keep_s)
            from prefect.settings import (
                PREFECT_API_URL,
                PREFECT_SERVER_EPHEMERAL_ENABLED,
                PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
            )

            if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
                self.api_url = None
                # A server configured in a profile or prefect.toml, or none allowed.
                self.stop(started_here=True)
                return
            if self.reused:
                return
            deadline = started + PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value()
            while True:
                assert self.process is not None and port is not None
                api_url = f"http://127.0.0.1:{port}/api"
                while self.process.poll() is None and time.monotonic() < deadline:
                    if healthy(api_url):
                        self.api_url = api_url
                        return
                    time.sleep(0.05)
                if self.process.poll() != PORT_IN_USE or time.monotonic() >= deadline:
                    break
                port = self._spawn(env, keep_s)
            code = self.process.poll()
            self.stop(started_here=True)
            where = f"; its log: {self.kept.log_path}" if self.kept is not None else ""
            self.error = f"Prefect's server did not answer (exit code {code}){where}"
        except Exception as exc:  # noqa: BLE001 - the flow starts Prefect's own server and reports its error
            self.stop(started_here=True)
            self.error = f"{type(exc).__name__}: {exc}"

    def _spawn(self, env: dict[str, str], keep_s: float) -> int:
        """Start the server on a free port; returns the port. A kept one runs in its own session, its output
        in its log, so that it outlives this process and holds none of its pipes."""
        port = free_port()
        if AUTH_VAR not in env:  # else the user's own: they give their client its PREFECT_API_AUTH_STRING
            self.auth = secrets.token_urlsafe(32)
            env = {**env, AUTH_VAR: self.auth}
        if self.kept is None:
            self.process = subprocess.Popen(server_command(port), env=env)
            return port
        with open(self.kept.log_path, "ab") as log:
            self.process = subprocess.Popen(
                server_command(port, self.kept, keep_s),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return port

    def api_settings(self) -> contextlib.AbstractContextManager:
        """Prefect's settings pointed at this server while the flow runs, in this thread and as the
        process-wide settings its worker threads read (prefect_test_harness does both); nothing when Prefect
        starts or has its own server."""
        if self.api_url is None:
            return contextlib.nullcontext()
        import prefect.context
        from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings

        updates = {PREFECT_API_URL: self.api_url}
        if self.auth is not None:
            updates[PREFECT_API_AUTH_STRING] = self.auth
        stack = contextlib.ExitStack()
        stack.enter_context(temporary_settings(updates=updates))
        stack.enter_context(
            prefect.context._temporary_global_settings_context(prefect.context.get_settings_context())
        )
        return stack

    def stop(self, started_here: bool = False) -> None:
        """At exit: let go of a kept server (it stays for the next run), or stop this run's own. With
        `started_here`, a kept server this run spawned is stopped as well (it was not wanted)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.unlink(missing_ok=True)
        process, self.process = self.process, None
        if process is None or process.poll() is not None or (self.kept is not None and not started_here):
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m alignflow.flows.prefect_server")
    parser.add_argument("port", type=int)
    parser.add_argument("--kept-in", type=Path, help="the kept servers' folder (flows/kept_server.py)")
    parser.add_argument("--key", help="this server's key there")
    parser.add_argument("--keep-s", type=float, default=0.0, help="exit once unused this long")
    args = parser.parse_args(argv)
    kept = KeptServer(args.kept_in, args.key) if args.kept_in is not None and args.key else None
    return serve(args.port, kept, args.keep_s)


if __name__ == "__main__":
    sys.exit(main())
