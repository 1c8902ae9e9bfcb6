"""Launch one stage as a local process with its spec, stream its output, and read back its StageResult."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from alignflow.contract import LAUNCHED_AT_VAR, StageResult, StageSpec


class WarmStages:
    """At most one spare stage process (`python -m alignflow.stages.warm`) that is importing the ML stack.

    `start(workdir)` spawns it (a no-op when one is there); `take(workdir, env)` hands it to a launch when it
    was started in the same folder with the same environment (else None: the launch starts a cold process,
    since variables such as OMP_NUM_THREADS are read at import); `close()` lets a spare one exit. On the
    2-core box, taking the RL stage from a warm process moved its first iteration ~4 s earlier: the imports
    ran while the CLI imported Prefect and started Prefect's server.
    """

    def __init__(self) -> None:
        self._spare: tuple[subprocess.Popen, Path, dict[str, str]] | None = None

    def start(self, workdir: Path) -> None:
        if os.environ.get("ALIGNFLOW_WARM_STAGES", "1") == "0" or self._spare is not None:
            return
        env = stage_env()
        proc = subprocess.Popen([sys.executable, "-m", "alignflow.stages.warm"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir, env=env)
        self._spare = (proc, Path(workdir).resolve(), env)

    def take(self, workdir: Path, env: dict[str, str]) -> subprocess.Popen | None:
        if self._spare is None:
            return None
        proc, where, spawned_env = self._spare
        self._spare = None
        if proc.poll() is not None or where != Path(workdir).resolve() or spawned_env != env:
            _dismiss(proc)
            return None
        return proc

    def close(self) -> None:
        if self._spare is not None:
            _dismiss(self._spare[0])
            self._spare = None


def _dismiss(proc: subprocess.Popen) -> None:
    """Stop an unused warm process: it has only imported modules, so killing it loses nothing (waiting
    for it to finish importing and exit would hold the flow up to ~5 s)."""
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            stream.close()


WARM = WarmStages()


def stage_env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def launch_local(spec: StageSpec, key: str, workdir: Path, echo: bool = True) -> tuple[StageResult, int]:
    """Run `python -m alignflow.stages.<stage> --spec <file>`; stdout is echoed and logged, stderr passes through.

    The child inherits the environment (AWS credentials stay in the AWS chain, never in the spec).
    Returns the StageResult and the exit code (2 means bad input: not worth retrying).
    """
    state = workdir / ".alignflow"
    (state / "specs").mkdir(parents=True, exist_ok=True)
    (state / "logs").mkdir(parents=True, exist_ok=True)
    spec_path = spec.dump(state / "specs" / f"{key}.json")
    log_path = state / "logs" / f"{key}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    argv = ["--spec", str(spec_path)]
    started = time.perf_counter()
    lines: list[str] = []
    env = stage_env()
    proc = WARM.take(workdir, env)
    launched_at = f"{time.time():.6f}"  # the stage times its own start-up from here (profile.md: process_start)
    if proc is not None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"stage": spec.stage, "argv": argv, "launched_at": launched_at}) + "\n")
        proc.stdin.close()
    else:
        proc = subprocess.Popen([sys.executable, "-m", f"alignflow.stages.{spec.stage}", *argv],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir,
                                env={**env, LAUNCHED_AT_VAR: launched_at})
    with open(log_path, "w") as log, proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            if echo and not line.startswith('{"stage"'):
                sys.stderr.write(f"[{key}] {line}")
        code = proc.wait()
    try:
        result = StageResult.from_output("".join(lines))
    except ValueError as exc:
        tail = "".join(lines[-15:])
        result = StageResult(stage=spec.stage, status="failed",
                             message=f"exit code {code}; {exc}; see {log_path}\n{tail}")
    if code != 0 and result.status != "failed":
        result = result.model_copy(update={"status": "failed", "message": f"exit code {code}; see {log_path}"})
    if result.duration_s == 0.0:
        result = result.model_copy(update={"duration_s": round(time.perf_counter() - started, 3)})
    return result, code
