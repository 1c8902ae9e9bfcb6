"""The end-of-run summary: a table of stage, status, duration, device, key metric, output and MLflow run."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from alignflow.config import PipelineConfig
from alignflow.storage import normalize_root
from alignflow.tracking import resolve_tracking_uri


def key_metric_text(row: dict[str, Any]) -> str:
    name = row.get("key_metric")
    value = (row.get("metrics") or {}).get(name) if name else None
    return f"{name}={value:.4g}" if value is not None else "-"


def startup_sentence(rows: list[dict[str, Any]]) -> str | None:
    """Where the time before the RL stage's first iteration went (from its startup/* metrics), or None."""
    for row in rows:
        m = row.get("metrics") or {}
        if row.get("status") != "ok" or "startup/stage" not in m:
            continue
        parts = []
        if "startup/since_run" in m and "startup/to_first_iteration" in m:
            earlier = earlier_stages_done_s(rows, row)
            if earlier:
                parts.append(f"earlier stages that ran in this run, done {earlier:.1f} s into the flow")
            parts.append(
                f"orchestration {m['startup/since_run'] - m['startup/to_first_iteration'] - earlier:.1f} s "
                "(Prefect, planning, earlier stages' cache checks)"
            )
        if "startup/process" in m:
            parts.append(f"process start and imports {m['startup/process']:.1f} s")
        parts.append(
            f"stage setup {m['startup/stage']:.1f} s (inputs, models, trainer, engine load; see its "
            "profile.md)"
        )
        total = m.get("startup/since_run", m.get("startup/to_first_iteration", m["startup/stage"]))
        return f"Start-up: {row['key']}'s first iteration began {total:.1f} s in: " + ", ".join(parts) + "."
    return None


def earlier_stages_done_s(rows: list[dict[str, Any]], rl_row: dict[str, Any]) -> float:
    """Seconds into the flow when the last stage that ran (not reused) before `rl_row` started finished; 0 if
    none.

    On a fresh run the earlier stages' minutes are part of the time before the first RL iteration: they are
    work, not orchestration, so the sentence names them apart."""
    if rl_row.get("finished_at_s") is None:
        return 0.0
    rl_start = rl_row["finished_at_s"] - rl_row["duration_s"]
    ends = [
        r["finished_at_s"]
        for r in rows
        if r is not rl_row
        and r.get("status") == "ok"
        and r.get("finished_at_s") is not None
        and r["finished_at_s"] <= rl_start + 1.0
    ]
    return max(ends, default=0.0)


def span_text(row: dict[str, Any]) -> str:
    """When a stage ran, in seconds from the pipeline's start ('12-48'),
    so overlapping stages show; '-' if unknown."""
    if row.get("finished_at_s") is None:
        return "-"
    return f"{max(row['finished_at_s'] - row['duration_s'], 0):.0f}-{row['finished_at_s']:.0f}"


def devices_text(row: dict[str, Any]) -> str:
    """Where the stage computed: its models' devices ('cuda:0', 'cpu'),
    '-' for a stage with no model (data)."""
    return ", ".join(sorted(set((row.get("devices") or {}).values()))) or "-"


def print_summary(config: PipelineConfig, rows: list[dict[str, Any]], wall_s: float) -> None:
    console = Console(file=sys.stdout, width=200)
    table = Table(title=f"alignflow pipeline '{config.name}' finished in {wall_s:.1f} s")
    for column in (
        "stage",
        "status",
        "duration",
        "ran (s into the run)",
        "device",
        "key metric",
        "output",
        "MLflow run",
    ):
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(
            row["key"],
            row["status"],
            f"{row['duration_s']:.1f} s",
            span_text(row),
            devices_text(row),
            key_metric_text(row),
            row.get("output_uri") or "-",
            row.get("mlflow_run_id") or "-",
        )
    console.print(table)
    startup = startup_sentence(rows)
    if startup:
        console.print(startup)
    workdir = Path(config.workdir).resolve()
    uri = resolve_tracking_uri(config.tracking, workdir)
    console.print(
        f"Outputs: {normalize_root(config.storage.root, workdir)} (each folder has a manifest.json)"
    )
    if config.tracking.enabled:
        parent = rows[0].get("parent_run_id") if rows else None
        console.print(f"MLflow: {uri} (parent run {parent})")
        console.print(
            f"Open the MLflow UI:  .venv/bin/mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000"
        )


def summary_markdown(config: PipelineConfig, rows: list[dict[str, Any]]) -> str:
    """The run's stage table as Markdown (the Prefect flow-run artifact)."""
    lines = [
        f"## alignflow pipeline `{config.name}`",
        "",
        "| stage | status | duration | ran (s into the run) | device | key metric | output | MLflow run |",
        "|---|---|---:|---:|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['key']} | {row['status']} | {row['duration_s']:.1f} s | {span_text(row)} | "
            f"{devices_text(row)} | {key_metric_text(row)} | "
            f"`{row.get('output_uri') or '-'}` | `{row.get('mlflow_run_id') or '-'}` |"
        )
    return "\n".join(lines) + "\n"


# The evaluation report's sections left out of the Prefect artifact: plots are files next to the report (their
# relative links do not resolve there) and the sample table is long.
REPORT_TAIL_HEADINGS = ("\n## Training curves", "\n## Sample responses")


def evaluation_markdown(report: str, max_lines: int = 40) -> str:
    """The head of the evaluation report (summary table, win rates, findings),
    without plots and sample table."""
    for heading in REPORT_TAIL_HEADINGS:
        report = report.split(heading, 1)[0]
    return "\n".join(report.splitlines()[:max_lines]) + "\n"
