"""Start-up of `alignflow run`: seconds until the RL stage's first iteration, every earlier stage cached.

    .venv/bin/python benchmarks/startup.py [--config configs/tiny.yaml] [--runs 3]
        [--workdir /tmp/alignflow-startup] [--per-run] [--json]

The config runs in the workdir (its outputs under <workdir>/artifacts, its MLflow store there) once, which
caches every stage. Before each measured run the RL stage's and the evaluation's outputs are deleted, so they
run again while data, base, SFT, reward model and engine are reused, as when a person changes an RL setting
and runs again. From the RL stage's result line (its log in .alignflow/logs) and its metrics.jsonl, each row
has: when its first iteration began and ended, in seconds after the command started, and the parts before it
(orchestration: Prefect, planning, the cached stages' checks; the stage process's start and imports; the
stage's setup), and the run's wall time. A last row times a fully cached run. The runs use the local Prefect
server and the stage fork server the first run started and kept (flows/kept_server.py, as a person's second
run does); `--per-run` measures the same with ALIGNFLOW_KEEP_S=0, each run starting and stopping its own
Prefect server and importing the ML stack in its warm stage process. Prefect's home is
<workdir>/prefect-home, and the kept servers are stopped at the end. The goal of the speed issue (part
4): the first iteration begins within 5 s.
docs/performance.md#start-up has the figures of a 2-core EPYC.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from alignflow.contract import RUN_STARTED_AT_VAR
from alignflow.flows.kept_server import KEEP_VAR, stop_kept_servers
from alignflow.flows.stage_forks import private_folder

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_ladder import cpu_name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RERUN = ("ppo", "evaluate")  # the stages each measured run runs again (their output folders are deleted)


def alignflow_run(config: Path, workdir: Path, env: dict[str, str]) -> tuple[float, str]:
    """`alignflow run` of the config, its outputs and MLflow store in workdir; returns the wall seconds and
    what it printed on stderr."""
    sets = [f"workdir={workdir}", f"storage.root=file://{workdir}/artifacts"]
    argv = [sys.executable, "-m", "alignflow.cli", "run", str(config)]
    argv += [arg for setting in sets for arg in ("--set", setting)]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"alignflow run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return wall, done.stderr


def server_of(stderr: str, env: dict[str, str]) -> str:
    """Which Prefect server the run used: the kept one of an earlier run, or one it started."""
    if env.get(KEEP_VAR) == "0":
        return "started by the run"
    return "started, kept" if "Prefect: started a local API server" in stderr else "kept from a run before"


def rl_result(workdir: Path, after: float) -> dict[str, Any]:
    """The result line of the RL stage that ran after `after` (its newest log)."""
    logs = [p for p in (workdir / ".alignflow" / "logs").glob("ppo-*.log") if p.stat().st_mtime >= after]
    if not logs:
        raise SystemExit(f"no RL stage ran: no .alignflow/logs/ppo-*.log in {workdir} after the run started")
    lines = max(logs, key=lambda p: p.stat().st_mtime).read_text().splitlines()
    return json.loads(next(line for line in reversed(lines) if line.startswith('{"stage"')))


def first_iteration_s(output_uri: str) -> float:
    with open(Path(output_uri.removeprefix("file://")) / "metrics.jsonl") as f:
        return float(json.loads(f.readline())["timing/iteration"])


def measure(config: Path, workdir: Path, env: dict[str, str], runs: int) -> list[dict[str, Any]]:
    rows = []
    for run in range(1, runs + 1):
        for stage in RERUN:
            shutil.rmtree(workdir / "artifacts" / stage, ignore_errors=True)
        started = time.time()
        wall, stderr = alignflow_run(config, workdir, env)
        result = rl_result(workdir, started)
        m = result["metrics"]
        began = m["startup/since_run"]
        rows.append({
            "server": server_of(stderr, env), "run": str(run), "began_s": began,
            "ended_s": began + first_iteration_s(result["output_uri"]),
            "orchestration_s": began - m["startup/to_first_iteration"], "process_s": m["startup/process"],
            "setup_s": m["startup/stage"], "wall_s": wall,
        })
    wall, stderr = alignflow_run(config, workdir, env)
    rows.append({"server": server_of(stderr, env), "run": "all cached", "wall_s": wall})
    return rows


def stop_kept(workdir: Path) -> None:
    """Stop the Prefect server and the stage fork server the runs in workdir keep (flows/kept_server.py)."""
    stop_kept_servers(workdir / "prefect-home" / "alignflow-server")
    folder = private_folder()
    if folder is not None:
        stop_kept_servers(folder, workdir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.yaml")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/alignflow-startup"))
    parser.add_argument("--per-run", action="store_true", help="also with a Prefect server per run")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config, workdir = args.config.resolve(), args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # Each run starts its own clock, and finds no Prefect API but the kept server of its own Prefect home.
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", RUN_STARTED_AT_VAR, KEEP_VAR)}
    env["PREFECT_HOME"] = str(workdir / "prefect-home")
    stop_kept(workdir)  # those left by an earlier benchmark: the first run starts them again
    try:
        alignflow_run(config, workdir, env)  # caches every stage (seconds when the workdir has them already)
        rows = measure(config, workdir, env, args.runs)
    finally:
        stop_kept(workdir)
    if args.per_run:
        rows += measure(config, workdir, {**env, KEEP_VAR: "0"}, args.runs)
    if args.json:
        print(json.dumps(rows))
        return
    table = Table(title=f"alignflow run to the first RL iteration, earlier stages cached ({cpu_name()}, "
                        f"{os.cpu_count()} cores; seconds)")
    columns = ("server", "run", "began_s", "ended_s", "orchestration_s", "process_s", "setup_s", "wall_s")
    for column in columns:
        table.add_column(column.removesuffix("_s"), justify="left" if column in columns[:2] else "right")
    for row in rows:
        table.add_row(*(f"{row[c]:.2f}" if isinstance(row.get(c), float) else row.get(c, "-")
                        for c in columns))
    Console(width=140).print(table)
    reused = [r["began_s"] for r in rows if r["server"] == "kept from a run before" and "began_s" in r]
    print(f"median first iteration began {statistics.median(reused):.2f} s after `alignflow run` "
          "(goal: <= 5 s)")


if __name__ == "__main__":
    main()
