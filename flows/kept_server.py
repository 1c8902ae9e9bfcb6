"""The servers `alignflow run`s keep for the runs after them: their key, state file, leases, and exit once
unused. Two use it: Prefect's local API server (flows/prefect_server.py) and the stage fork server
(flows/stage_forks.py, stages/common/fork_server.py).

Why: Prefect's API server takes ~3.8 s of CPU to start (its imports, then the database's migrations), and a
stage process ~6 s to import torch, transformers and MLflow, which a 2-core machine spends beside the run's
own start (docs/performance.md#start-up). So a run keeps what it started, and the next run with the same key
uses it. What they are not: servers to point other clients at (that is `alignflow ui` or your own
`prefect server start`); they listen on 127.0.0.1 or on a Unix socket only their user reaches.

- Key: what the server's behaviour depends on. Prefect's: its environment (PREFECT_* and the interpreter's
  own variables, `server_env`), the Python executable, Prefect's version, the folder it starts in, and the
  files Prefect reads settings from there and in PREFECT_HOME (prefect.toml, pyproject.toml, .env,
  profiles.toml). The fork server's: stage_forks.fork_server_key. Another key, another server.
- State: `<folder>/<key>.json` ({pid, ...}; Prefect's folder is `<PREFECT_HOME>/alignflow-server`), written by
  the server once it serves, removed when it exits; its log beside it.
- Leases: a run holds `<key>.leases/<its pid>` while it uses the server. The server exits once no live
  process has held a lease (nor, for the fork server, a stage runs) for `ALIGNFLOW_KEEP_S` seconds
  (default 600; 0: nothing is kept). A run killed without removing its lease stops counting when its
  process is gone.
- Races: a server about to exit first renames its state file away, then looks at the leases once more
  (it stays, and restores the file, if one appeared); a run takes its lease before it reads the state file.
  So a run that finds the file finds a server that stays; one that finds none starts its own.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import time
import urllib.request
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

KEEP_VAR = "ALIGNFLOW_KEEP_S"
DEFAULT_KEEP_S = 600.0
# The variables a kept server inherits besides PREFECT_*: what the interpreter and its libraries read. Not the
# run's credentials (AWS_*, MLflow's): the server lives past the run and has no use for them.
INTERPRETER_VARS = (
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "TZ", "TMPDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
)
SETTINGS_FILES = ("prefect.toml", "pyproject.toml", ".env")  # read from the folder Prefect starts in
CHECK_EVERY_S = 1.0


def keep_seconds() -> float:
    """ALIGNFLOW_KEEP_S, in seconds (0: nothing kept); ValueError naming it when bad."""
    raw = os.environ.get(KEEP_VAR, "").strip()
    if not raw:
        return DEFAULT_KEEP_S
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(
            f"{KEEP_VAR}={raw!r}: expected the seconds (>= 0) a run's unused Prefect server and stage fork "
            "server are kept for later runs; 0 keeps nothing (a Prefect server per run, stopped with it)"
        )
    return value


def server_env(environ: dict[str, str] | os._Environ) -> dict[str, str]:
    """What a local Prefect server is started with: PREFECT_*, PYTHON*, LC_* and INTERPRETER_VARS."""
    return {
        name: value
        for name, value in environ.items()
        if name.startswith(("PREFECT_", "PYTHON", "LC_")) or name in INTERPRETER_VARS
    }


def prefect_home(env: dict[str, str]) -> Path:
    return Path(env.get("PREFECT_HOME") or "~/.prefect").expanduser()


def _digest_of_file(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def alive(pid: int) -> bool:
    """A running process (a zombie, exited but not yet reaped by its parent, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    return True


def stop_kept_servers(folder: Path, workdir: Path | None = None) -> int:
    """Stop every kept server whose state file is in `folder` (with `workdir`: those serving that workdir);
    for benchmarks and tests that must not leave one behind. Returns how many were running."""
    servers = [KeptServer(Path(folder), p.stem) for p in Path(folder).glob("*.json") if p.stem.isalnum()]
    if workdir is not None:
        where = str(Path(workdir).resolve())
        servers = [s for s in servers if (s.read_state() or {}).get("workdir") == where]
    return sum(server.stop() for server in servers)


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit, so that a kept server's `finally` withdraws its state file (uvicorn, for
    one, shuts down on SIGTERM and then raises it again with the handler it found)."""

    def _raise(signum, frame) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _raise)


def healthy(api_url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{api_url}/health", timeout=timeout_s) as response:  # noqa: S310 - loopback
            return response.status == 200
    except OSError:
        return False


@dataclass(frozen=True)
class KeptServer:
    """The kept server of one key: its files under `folder`, and what runs and the server do with them."""

    folder: Path
    key: str

    @classmethod
    def for_environment(cls, env: dict[str, str], cwd: Path | None = None) -> KeptServer:
        """The key of the server `env` (server_env's) would start in `cwd`."""
        cwd = (cwd or Path.cwd()).resolve()
        home = prefect_home(env)
        profiles = Path(env.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
        try:
            prefect_version = version("prefect")
        except PackageNotFoundError:
            prefect_version = "?"
        described = {
            "env": sorted(env.items()),
            "python": sys.executable,
            "prefect": prefect_version,
            "cwd": str(cwd),
            "files": {str(p): _digest_of_file(p) for p in (*(cwd / n for n in SETTINGS_FILES), profiles)},
        }
        key = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()[:16]
        return cls(home / "alignflow-server", key)

    @property
    def state_path(self) -> Path:
        return self.folder / f"{self.key}.json"

    @property
    def leases(self) -> Path:
        return self.folder / f"{self.key}.leases"

    @property
    def log_path(self) -> Path:
        return self.folder / f"{self.key}.log"

    # -- a run's side ---------------------------------------------------------------------------------------

    def hold(self) -> Path:
        """Take this process's lease (before `running_url`: see the module's races); returns its file."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.leases.mkdir(exist_ok=True, mode=0o700)
        lease = self.leases / str(os.getpid())
        lease.touch()
        return lease

    def running_url(self) -> str | None:
        """The API URL of this key's server when one is running and answers, else None."""
        state = self.read_state()
        if state is None or not alive(state["pid"]) or not isinstance(state.get("api_url"), str):
            return None
        return state["api_url"] if healthy(state["api_url"], timeout_s=1.0) else None

    def read_state(self) -> dict | None:
        """The state file's fields ({pid, ...} as `publish` wrote them), or None when there is none whole."""
        try:
            state = json.loads(self.state_path.read_text())
            return {**state, "pid": int(state["pid"])}
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def stop(self) -> bool:
        """Stop this key's server now, if one runs; True when one did."""
        state = self.read_state()
        if state is None or not alive(state["pid"]):
            return False
        os.kill(state["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 10
        while alive(state["pid"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return True

    # -- the server's side ----------------------------------------------------------------------------------

    def live_leases(self) -> int:
        """How many processes hold a lease; the leases of processes that are gone are removed."""
        live = 0
        with contextlib.suppress(FileNotFoundError):
            for lease in self.leases.iterdir():
                if lease.name.isdigit() and alive(int(lease.name)):
                    live += 1
                else:
                    lease.unlink(missing_ok=True)
        return live

    def publish(self, **fields) -> None:
        """The server is ready: write the state file, {pid, **fields} (whole, then renamed into place)."""
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        state = {"pid": os.getpid(), **fields}
        partial = self.state_path.with_name(f"{self.key}.{os.getpid()}.partial")
        # Its user's only: it may hold the server's auth string.
        with open(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(state, f)
        partial.replace(self.state_path)

    def retire(self) -> bool:
        """Try to stop being the key's server: True when it may exit (no run can find it any more); False
        when a lease appeared meanwhile (the state file is back)."""
        state = self.read_state()
        if state is None or state["pid"] != os.getpid():
            return True  # another server of this key was published over this one: runs find that one
        retired = self.state_path.with_name(f"{self.key}.{os.getpid()}.retired")
        try:
            self.state_path.replace(retired)
        except FileNotFoundError:
            return True
        if self.live_leases():
            retired.replace(self.state_path)
            return False
        retired.unlink(missing_ok=True)
        return True

    def withdraw(self) -> None:
        """The server is exiting (a signal, or an error): remove the state file when it is still its own."""
        state = self.read_state()
        if state is not None and state["pid"] == os.getpid():
            self.state_path.unlink(missing_ok=True)

    def wait_until_unused(self, keep_s: float, should_exit) -> None:
        """Return once no live lease has been held for keep_s seconds and `retire` agreed, or once
        `should_exit()` is true (the server is stopping for another reason)."""
        last_used = time.monotonic()
        while not should_exit():
            if self.live_leases():
                last_used = time.monotonic()
            elif time.monotonic() - last_used >= keep_s:
                if self.retire():
                    return
                last_used = time.monotonic()
            time.sleep(CHECK_EVERY_S)
