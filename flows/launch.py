"""Launch one stage as a local process with its spec, stream its output, and read back its StageResult."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from alignflow.contract import StageResult, StageSpec


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
    command = [sys.executable, "-m", f"alignflow.stages.{spec.stage}", "--spec", str(spec_path)]
    started = time.perf_counter()
    lines: list[str] = []
    with open(log_path, "w") as log, subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    ) as proc:
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
