"""Launch one stage as a local process with its spec, stream its output, and read back its StageResult."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from alignflow.contract import LAUNCHED_AT_VAR, StageResult, StageSpec
from alignflow.flows.kept_server import keep_seconds
from alignflow.flows.stage_forks import RUNTIME_ENV_PREFIXES, ForkedStage, StageForks, private_folder


class WarmStages:
    """Stage processes with the ML stack imported before they are launched: forked from the kept fork server
    (flows/stage_forks.py) where runs keep their servers (ALIGNFLOW_KEEP_S > 0, on Linux), else at most one
    spare stage process (`python -m alignflow.stages.common.warm`) that is importing the ML stack.

    `start(workdir)` finds or starts the fork server, or spawns the spare (a no-op when done already);
    `fork(...)` runs a stage through the fork server; `take(workdir, env)` hands the spare to a launch, with
    the environment changes to apply, when it was started in the same folder and its environment differs
    only in variables read at run time (RUNTIME_ENV_PREFIXES). Either returns None otherwise, and the launch
    starts a cold process. `close()` stops a spare one and lets go of the fork server. The point: the RL
    stage's imports (torch, transformers' loaders, MLflow) are done before it is launched, or run while the
    CLI imports Prefect (docs/performance.md#start-up).
    """

    def __init__(self) -> None:
        self._spare: tuple[subprocess.Popen, Path, dict[str, str]] | None = None
        self._forks: StageForks | None = None
        self._lock = threading.Lock()  # stages launch from several threads when they run in parallel

    def start(self, workdir: Path) -> None:
        if os.environ.get("ALIGNFLOW_WARM_STAGES", "1") == "0" or self._spare is not None or self._forks:
            return
        env = stage_env()
        keep_s = keep_seconds()
        folder = private_folder() if keep_s > 0 and sys.platform == "linux" else None
        if folder is not None:
            self._forks = StageForks(workdir, env, keep_s, folder)
            return
        proc = subprocess.Popen(
            [sys.executable, "-m", "alignflow.stages.common.warm"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=workdir,
            env=env,
        )
        self._spare = (proc, Path(workdir).resolve(), env)

    def fork(self, workdir: Path, stage: str, argv: list[str], env: dict[str, str]) -> ForkedStage | None:
        forks = self._forks
        return forks.fork(workdir, stage, argv, env) if forks is not None else None

    def take(
        self, workdir: Path, env: dict[str, str]
    ) -> tuple[subprocess.Popen, dict[str, str | None]] | None:
        """(process, {variable: new value, or None to unset}) or None."""
        with self._lock:
            if self._spare is None:
                return None
            proc, where, spawned_env = self._spare
            self._spare = None
        changes: dict[str, str | None] = {
            k: env.get(k) for k in spawned_env.keys() | env.keys() if spawned_env.get(k) != env.get(k)
        }
        import_time = [k for k in changes if not k.startswith(RUNTIME_ENV_PREFIXES)]
        if proc.poll() is not None or where != Path(workdir).resolve() or import_time:
            _dismiss(proc)
            return None
        return proc, changes

    def close(self) -> None:
        with self._lock:
            spare, self._spare = self._spare, None
            forks, self._forks = self._forks, None
        if spare is not None:
            _dismiss(spare[0])
        if forks is not None:
            forks.close()


def _dismiss(proc: subprocess.Popen) -> None:
    """Stop an unused warm process: it has only imported modules, so killing it loses nothing (waiting
    for it to finish importing and exit would hold the flow up for seconds)."""
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
    """Run the stage's program (`python -m alignflow.stages <stage> --spec <file>`, or a warm process); stdout
    is echoed and logged, stderr passes through.

    The child inherits the environment (AWS credentials stay in the AWS chain, never in the spec).
    Returns the StageResult and the exit code (2 means bad input: not worth retrying).
    """
    state = workdir / ".alignflow"
    (state / "specs").mkdir(parents=True, exist_ok=True)
    (state / "logs").mkdir(parents=True, exist_ok=True)
    # Named by the output's digest too: two runs in one workdir (two configs sharing a storage root) must not
    # overwrite each other's spec between writing it and the stage reading it.
    digest = spec.output_uri.rstrip("/").rsplit("/", 1)[-1]
    spec_path = spec.dump(state / "specs" / f"{key}-{digest}.json")
    log_path = state / "logs" / f"{key}-{digest}-{time.strftime('%Y%m%d-%H%M%S')}.log"
    argv = ["--spec", str(spec_path)]
    started = time.perf_counter()
    lines: list[str] = []
    env = stage_env()
    launched_at = f"{time.time():.6f}"
    forked = WARM.fork(workdir, spec.stage, argv, {**env, LAUNCHED_AT_VAR: launched_at})
    warm = WARM.take(workdir, env) if forked is None else None
    if forked is not None:
        proc = forked
    elif warm is not None:
        proc, changes = warm
        assert proc.stdin is not None
        proc.stdin.write(
            json.dumps({"stage": spec.stage, "argv": argv, "env": {**changes, LAUNCHED_AT_VAR: launched_at}})
            + "\n"
        )
        proc.stdin.close()
    else:
        proc = subprocess.Popen(
            [sys.executable, "-m", "alignflow.stages", spec.stage, *argv],  # imports faster than its program
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=workdir,
            env={**env, LAUNCHED_AT_VAR: launched_at},
        )
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
        result = StageResult(
            stage=spec.stage, status="failed", message=f"exit code {code}; {exc}; see {log_path}\n{tail}"
        )
    if code != 0 and result.status != "failed":
        result = result.model_copy(
            update={"status": "failed", "message": f"exit code {code}; see {log_path}"}
        )
    if result.duration_s == 0.0:
        result = result.model_copy(update={"duration_s": round(time.perf_counter() - started, 3)})
    return result, code
