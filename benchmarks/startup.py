"""Start-up of `alignflow run`: seconds until the RL stage's first iteration, every earlier stage cached.

    .venv/bin/python benchmarks/startup.py [--config configs/tiny.yaml] [--runs 3]
        [--workdir /tmp/alignflow-startup] [--with-server] [--json]

The config runs in the workdir (its outputs under <workdir>/artifacts, its MLflow store there) once, which
caches every stage. Before each measured run the RL stage's and the evaluation's outputs are deleted, so they
run again while data, base, SFT, reward model and engine are reused, as when a person changes an RL setting
and runs again. From the RL stage's result line (its log in .alignflow/logs) and its metrics.jsonl, each row
has: when its first iteration began and ended, in seconds after the command started, and the parts before it
(orchestration: Prefect, planning, the cached stages' checks; the stage process's start and imports; the
stage's setup), and the run's wall time. A last row times a fully cached run. `--with-server` measures the
same against a Prefect server started beforehand (PREFECT_API_URL, as `alignflow ui` gives), so that no run
starts one. The goal of the speed issue (part 4): the first iteration begins within 5 s.
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

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_ladder import cpu_name  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RERUN = ("ppo", "evaluate")  # the stages each measured run runs again (their output folders are deleted)


def alignflow_run(config: Path, workdir: Path, env: dict[str, str]) -> float:
    """`alignflow run` of the config, its outputs and MLflow store in workdir; returns the wall seconds."""
    sets = [f"workdir={workdir}", f"storage.root=file://{workdir}/artifacts"]
    argv = [sys.executable, "-m", "alignflow.cli", "run", str(config)]
    argv += [arg for setting in sets for arg in ("--set", setting)]
    started = time.perf_counter()
    done = subprocess.run(argv, cwd=workdir, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"alignflow run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return wall


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


def measure(config: Path, workdir: Path, env: dict[str, str], runs: int, server: str) -> list[dict[str, Any]]:
    rows = []
    for run in range(1, runs + 1):
        for stage in RERUN:
            shutil.rmtree(workdir / "artifacts" / stage, ignore_errors=True)
        started = time.time()
        wall = alignflow_run(config, workdir, env)
        result = rl_result(workdir, started)
        m = result["metrics"]
        began = m["startup/since_run"]
        rows.append({
            "server": server, "run": str(run), "began_s": began,
            "ended_s": began + first_iteration_s(result["output_uri"]),
            "orchestration_s": began - m["startup/to_first_iteration"], "process_s": m["startup/process"],
            "setup_s": m["startup/stage"], "wall_s": wall,
        })
    rows.append({"server": server, "run": "all cached", "wall_s": alignflow_run(config, workdir, env)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "tiny.yaml")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/alignflow-startup"))
    parser.add_argument("--with-server", action="store_true", help="also against a running Prefect server")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    config, workdir = args.config.resolve(), args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    # Each run starts its own clock and, unless --with-server, its own Prefect server.
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", RUN_STARTED_AT_VAR)}
    alignflow_run(config, workdir, env)  # caches every stage (seconds when the workdir has them already)
    rows = measure(config, workdir, env, args.runs, "started by the run")
    if args.with_server:
        from alignflow.flows.prefect_server import PrefectServer

        server = PrefectServer()
        server.start()
        server.wait()
        if server.api_url is None:
            raise SystemExit(f"Prefect's server did not start: {server.error}")
        try:
            rows += measure(config, workdir, {**env, "PREFECT_API_URL": server.api_url}, args.runs, "running")
        finally:
            server.stop()
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
    measured = [row["began_s"] for row in rows if "began_s" in row and row["server"] != "running"]
    print(f"median first iteration began {statistics.median(measured):.2f} s after `alignflow run` "
          "(goal: <= 5 s)")


if __name__ == "__main__":
    main()
