"""The bookkeeping of scripts/gpu_check.sh: one JSON line of figures per step, and the final summary table.

    python scripts/gpu_check_steps.py record STEP --rc RC --seconds S --budget B --figures FILE \\
        [--result PATH]
    python scripts/gpu_check_steps.py summary --figures FILE

`record` turns what a step left behind into its line in FILE (JSON lines): the step's own JSON object (setup,
pipeline, rl), pytest's JUnit XML (tests) or a benchmark's --json output (engine, fusions); a step that timed
out (exit 124 or 137) or left nothing is recorded as such, with its log's name. `summary` prints one table,
the last line of each step, and exits 1 when a step failed or timed out ("not run" is reported, not failed).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

STEPS = ("setup", "tests", "engine", "pipeline", "rl", "fusions")
FAILED = ("fail", "timeout")


def tests_line(result: Path, rc: int) -> dict[str, Any]:
    """Counts from pytest's JUnit XML."""
    if not result.is_file():
        return {"status": "fail", "summary": f"pytest wrote no report (exit code {rc})", "figures": {}}
    suite = ET.parse(result).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failed = [f"{case.get('classname', '')}::{case.get('name', '')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    summary = (f"{counts['passed']} passed, {counts['skipped']} skipped, {counts['failures']} failed, "
               f"{counts['errors']} errors")
    status = "pass" if rc == 0 and counts["passed"] > 0 else "fail"
    if rc == 5 or counts["tests"] == 0:
        summary = "no tests collected"
    return {"status": status, "summary": summary, "figures": {**counts, "failed_tests": failed[:20]}}


def engine_line(result: Path, rc: int) -> dict[str, Any]:
    """Tokens/s and % of the roofline of every row; on a GPU the native rows must be the CUDA-graph path."""
    try:
        data = json.loads(result.read_text())
    except (OSError, ValueError):
        return {
            "status": "fail",
            "summary": f"the benchmark printed no result (exit code {rc})",
            "figures": {},
        }
    rows = [
        {
            k: row[k]
            for k in (
                "model",
                "dtype",
                "batch",
                "engine",
                "tokens_per_s",
                "ms_per_token_step",
                "roofline_pct",
                "decode_step",
            )
        }
        for row in data["throughput"]
    ]
    on_gpu = str(data.get("device", "")).startswith("cuda")
    not_graphs = [
        f"{r['model']} b{r['batch']}"
        for r in rows
        if on_gpu and r["engine"] == "native" and "CUDA graph" not in r["decode_step"]
    ]
    lines = [
        f"copy {data['bandwidth_gbs']:.0f} GB/s on {data.get('device')}"
        + (f" ({data['machine']['gpu']})" if data["machine"].get("gpu") else "")
    ]
    for model in dict.fromkeys(r["model"] for r in rows):
        for batch in dict.fromkeys(r["batch"] for r in rows if r["model"] == model):
            cells = {r["engine"]: r for r in rows if r["model"] == model and r["batch"] == batch}
            lines.append(
                f"{model} b{batch}: "
                + " | ".join(
                    f"{name} {cell['tokens_per_s']:.0f} tok/s {cell['roofline_pct']:.1f}%"
                    for name, cell in cells.items()
                    if name != "transformers"
                )
            )
    problems = [f"native rows not on CUDA graphs: {', '.join(not_graphs)}"] if not_graphs else []
    status = "pass" if rc == 0 and rows and not problems else "fail"
    return {
        "status": status,
        "summary": "\n".join(problems + lines),
        "figures": {
            "bandwidth_gbs": data["bandwidth_gbs"],
            "device": data.get("device"),
            "gpu": data["machine"].get("gpu"),
            "rows": rows,
        },
    }


def fusions_line(result: Path, rc: int) -> dict[str, Any]:
    """benchmarks/decode_fusions.py's rows: per batch, ms per step and % of the roofline of each cumulative
    row, and what each fused op bought."""
    try:
        data = json.loads(result.read_text())
    except (OSError, ValueError):
        summary = f"the benchmark printed no result (exit code {rc})"
        return {"status": "fail", "summary": summary, "figures": {}}
    rows = data["rows"]
    lines = []
    for batch in dict.fromkeys(r["batch"] for r in rows):
        cells = [r for r in rows if r["batch"] == batch]
        lines.append(
            f"{data['model']} b{batch}: "
            + " | ".join(
                f"{r['row']} {r['ms_per_token_step']:.3f} ms {r['roofline_pct']:.1f}%"
                + ("" if r["bought_ms"] is None else f" ({r['bought_ms']:+.3f})")
                for r in cells
            )
        )
    # A graph whose capture failed decodes eagerly from then on (the engine warns): such a row measured
    # something else than its label.
    off_path = [f"{r['row']} b{r['batch']}" for r in rows if "CUDA graph" not in r["decode_step"]
                or (r["row"] != "eager ops") != ("fused Triton ops" in r["decode_step"])]
    problems = [f"rows not on the step they name: {', '.join(off_path)}"] if off_path else []
    keys = ("batch", "row", "ms_per_token_step", "roofline_pct", "bought_ms")
    return {
        "status": "pass" if rc == 0 and rows and not problems else "fail",
        "summary": "\n".join(problems + lines),
        "figures": {"model": data["model"], "device": data["device"], "gpu": data.get("gpu"),
                    "bandwidth_gbs": data["bandwidth_gbs"], "rows": [{k: r[k] for k in keys} for r in rows]},
    }


def record(args: argparse.Namespace) -> int:
    result = Path(args.result) if args.result else Path("/nonexistent")
    if args.step == "tests":
        line = tests_line(result, args.rc)
    elif args.step == "engine":
        line = engine_line(result, args.rc)
    elif args.step == "fusions":
        line = fusions_line(result, args.rc)
    elif result.is_file() and result.read_text().strip():
        line = json.loads(result.read_text())
    else:
        line = {"status": "fail", "summary": f"no result (exit code {args.rc})", "figures": {}}
    if args.rc in (124, 137):
        line["status"] = "timeout"
        line["summary"] = f"over its {args.budget:.0f} s budget; " + line.get("summary", "")
    if args.note:
        line["summary"] = f"{line.get('summary', '')} ({args.note})"
    if args.log:
        line["log"] = args.log
    line = {
        "step": args.step,
        "status": line["status"],
        "seconds": round(args.seconds, 1),
        "budget_s": args.budget,
        "summary": line.get("summary", ""),
        "figures": line.get("figures", {}),
        **({"log": line["log"]} if "log" in line else {}),
    }
    with open(args.figures, "a") as out:
        out.write(json.dumps(line) + "\n")
    print(f"{args.step}: {line['status']} in {line['seconds']:.0f} s: {line['summary']}")
    return 0


def summary(args: argparse.Namespace) -> int:
    lines = {}
    path = Path(args.figures)
    for text in path.read_text().splitlines() if path.is_file() else []:
        if text.strip():
            line = json.loads(text)
            lines[line["step"]] = line
    rows = [
        lines.get(
            step, {"step": step, "status": "not run", "seconds": 0, "budget_s": None, "summary": "no record"}
        )
        for step in STEPS
    ]
    total = sum(r["seconds"] for r in rows)
    title = f"gpu-check on {args.device}: {total:.0f} s" + (
        f" (budget {args.budget:.0f} s)" if args.budget else ""
    )
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # a bare machine without rich still gets the table
        print(title)
        for r in rows:
            print(
                f"  {r['step']:9s} {r['status']:8s} {r['seconds']:6.0f} s  "
                + r["summary"].replace("\n", "; ")
            )
    else:
        table = Table(title=title)
        for column in ("step", "status", "seconds", "budget", "figures"):
            table.add_column(column, justify="right" if column in ("seconds", "budget") else "left")
        for r in rows:
            style = "red" if r["status"] in FAILED else "yellow" if r["status"] == "not run" else "green"
            table.add_row(
                r["step"],
                f"[{style}]{r['status']}[/{style}]",
                f"{r['seconds']:.0f}",
                "-" if r.get("budget_s") is None else f"{r['budget_s']:.0f}",
                r["summary"],
            )
        Console(file=sys.stdout, width=160).print(table)
    failed = [r["step"] for r in rows if r["status"] in FAILED]
    not_run = [r["step"] for r in rows if r["status"] == "not run"]
    print(
        f"figures: {path}; "
        + (f"FAILED: {', '.join(failed)}" if failed else "no step failed")
        + (f"; not run: {', '.join(not_run)}" if not_run else "")
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="append a step's JSON line")
    rec.add_argument("step", choices=STEPS)
    rec.add_argument(
        "--rc", type=int, required=True, help="the step's exit code (124/137: killed at its budget)"
    )
    rec.add_argument("--seconds", type=float, required=True)
    rec.add_argument("--budget", type=float, required=True)
    rec.add_argument("--figures", required=True, help="the JSON-lines file")
    rec.add_argument(
        "--result", default=None, help="what the step left: its JSON, JUnit XML or benchmark JSON"
    )
    rec.add_argument("--log", default=None, help="the step's log, named in its line")
    rec.add_argument("--note", default=None, help="appended to the step's summary")
    summ = sub.add_parser("summary", help="print the table; exit 1 when a step failed")
    summ.add_argument("--figures", required=True)
    summ.add_argument("--device", default="?")
    summ.add_argument("--budget", type=float, default=None, help="the steps' budgets together")
    args = parser.parse_args(argv)
    return record(args) if args.command == "record" else summary(args)


if __name__ == "__main__":
    raise SystemExit(main())
