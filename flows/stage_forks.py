"""The launcher's side of the kept fork server (stages/common/fork_server.py): find it or start it, and run a
stage as a process forked from it, with the ML stack already imported.

One fork server serves one workdir, one Python and one state of alignflow's code and libraries under one
import-time environment (every variable but those read at run time, RUNTIME_ENV_PREFIXES): that is its key
(flows/kept_server.py). A run holds a lease on it from `StageForks(...)` to `close()`; one that finds none
running starts it, detached, and its first launch waits for its imports as it would wait for the warm stage
process's. A launch whose environment differs at import time, or that the server refuses, returns None: the
launcher starts a process of its own.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from importlib import util
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from alignflow.flows.kept_server import KeptServer, alive

# Environment variables read when used, not at import: a warm or forked stage process given the launch's
# values of these behaves as a new one. Any other difference (OMP_NUM_THREADS, PYTHONPATH,
# CUDA_VISIBLE_DEVICES, ...) means a cold process.
RUNTIME_ENV_PREFIXES = ("MLFLOW_", "PREFECT_", "AWS_", "ALIGNFLOW_")
# The libraries the fork server has imported: another version installed means another server.
LIBRARIES = ("torch", "transformers", "mlflow", "safetensors", "tokenizers", "deepspeed", "peft")
READY_TIMEOUT_S = 180.0  # its imports; the warm stage process's take ~6 s on a 2-core machine


# What a shell sets per terminal or per command (and pytest per test), which no library reads when it is
# imported: another value of these is still the same fork server (each launch sets its whole environment in
# the stage process).
VOLATILE_VARS = frozenset({
    "_", "SHLVL", "PWD", "OLDPWD", "TERM", "COLORTERM", "COLUMNS", "LINES", "SHELL", "PS1", "PS2",
    "PROMPT_COMMAND", "HISTFILE", "LS_COLORS", "DISPLAY", "WINDOWID", "SSH_CLIENT", "SSH_CONNECTION",
    "SSH_TTY", "SSH_AUTH_SOCK", "TMUX", "TMUX_PANE", "STY", "MAIL", "XDG_SESSION_ID", "TERM_PROGRAM",
    "TERM_SESSION_ID", "PYTEST_CURRENT_TEST",
})


def import_time_env(env: dict[str, str]) -> dict[str, str]:
    """What a stage process may read while it imports: all but RUNTIME_ENV_PREFIXES and VOLATILE_VARS."""
    return {k: v for k, v in env.items() if not k.startswith(RUNTIME_ENV_PREFIXES) and k not in VOLATILE_VARS}


def sources_digest() -> str:
    """Every file of alignflow's packages by path, size and modification time: an edit means another key."""
    digest = hashlib.sha256()
    for package in ("alignflow", "alignflow.flows", "alignflow.stages", "alignflow.kernels"):
        spec = util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec else []:
            for path in sorted(Path(root).rglob("*")):
                if path.is_file() and "__pycache__" not in path.parts:
                    stat = path.stat()
                    digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def fork_server_key(workdir: Path, env: dict[str, str]) -> str:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = None
    described = {
        "env": sorted(import_time_env(env).items()),
        "python": sys.executable,
        "workdir": str(workdir),
        "sources": sources_digest(),
        "libraries": versions,
    }
    return hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]


def private_folder() -> Path | None:
    """<tmp>/alignflow-<uid>, made only its user's (a Unix socket's path must stay short); None when it is
    somebody else's or open to others."""
    folder = Path(tempfile.gettempdir()) / f"alignflow-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        stat = os.lstat(folder)
    except OSError:
        return None
    if stat.st_uid != os.getuid() or stat.st_mode & 0o077 or not os.path.isdir(folder) or folder.is_symlink():
        return None
    return folder


class ForkedStage:
    """A stage process the fork server forked, as launch_local uses a Popen: `stdout` (its stdout and
    stderr), `wait()` (its exit code: negative for a signal, -1 when the fork server went away), a context
    manager that closes both ends."""

    def __init__(self, conn: socket.socket, replies, read_fd: int, pid: int):
        self.pid = pid
        self.stdout = os.fdopen(read_fd, "r", encoding="utf-8", errors="replace")
        self.returncode: int | None = None
        self._conn = conn
        self._replies = replies

    def wait(self) -> int:
        if self.returncode is None:
            reply = _reply(self._replies)
            self.returncode = int(reply["exit"]) if "exit" in reply else -1
        return self.returncode

    def __enter__(self) -> ForkedStage:
        return self

    def __exit__(self, *exc) -> None:
        self.stdout.close()
        self._replies.close()
        self._conn.close()  # before the stage ended (the launcher failed): the child is stopped


def _reply(replies) -> dict:
    try:
        reply = json.loads(replies.readline() or b"{}")
    except (OSError, ValueError):
        return {}
    return reply if isinstance(reply, dict) else {}


class StageForks:
    """This run's use of the kept fork server of (workdir, env): its lease, and `fork` per launch."""

    def __init__(self, workdir: Path, env: dict[str, str], keep_s: float, folder: Path):
        self.workdir = Path(workdir).resolve()
        self.import_env = import_time_env(env)
        self.kept = KeptServer(folder, fork_server_key(self.workdir, env))
        self._lease: Path | None = self.kept.hold()
        self.process: subprocess.Popen | None = None
        state = self.kept.read_state()
        if state is None or not alive(state["pid"]):
            with open(self.kept.log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "alignflow.stages.common.fork_server", "--folder", str(folder),
                     "--key", self.kept.key, "--keep-s", str(keep_s)],
                    cwd=self.workdir,
                    env=self.import_env,  # not the run's credentials: each launch brings its environment
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )

    def fork(self, workdir: Path, stage: str, argv: list[str], env: dict[str, str]) -> ForkedStage | None:
        """Run the stage as a forked process; None when this server cannot (the launcher starts one)."""
        if Path(workdir).resolve() != self.workdir or import_time_env(env) != self.import_env:
            return None
        conn = self._connect()
        if conn is None:
            return None
        read_fd, write_fd = os.pipe()
        try:
            line = json.dumps({"stage": stage, "argv": argv, "env": env, "cwd": str(self.workdir)}) + "\n"
            socket.send_fds(conn, [line.encode()], [write_fd])
        except OSError:
            os.close(read_fd)
            conn.close()
            return None
        finally:
            os.close(write_fd)
        replies = conn.makefile("rb")
        forked = _reply(replies)
        if "pid" not in forked:  # refused (a native thread in the server) or the server went away
            replies.close()
            conn.close()
            os.close(read_fd)
            return None
        return ForkedStage(conn, replies, read_fd, int(forked["pid"]))

    def _connect(self) -> socket.socket | None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            state = self.kept.read_state()
            if state is not None and isinstance(state.get("socket"), str):
                conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    conn.connect(state["socket"])
                    return conn
                except OSError:
                    conn.close()
            starting = self.process is not None and self.process.poll() is None
            if not starting and (state is None or not alive(state["pid"])):
                return None  # none is running, nor starting
            time.sleep(0.02)
        return None

    def close(self) -> None:
        """Let go of the server (it stays for the next run until unused for its keep time)."""
        lease, self._lease = self._lease, None
        if lease is not None:
            lease.unlink(missing_ok=True)
