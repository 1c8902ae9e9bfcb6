"""SFT on 1 rank vs 2 ranks (ZeRO-2, ZeRO-3): seconds per step, tokens per second and the held-out loss.

    .venv/bin/python benchmarks/training_ranks.py [--repeats 2] [--workdir DIR] [--set KEY=VALUE ...] [--json]

Runs configs/tiny.yaml with lora_vs_full's larger model (~26M parameters) through data and base once,
then the SFT stage from the base model in each variant, interleaved `--repeats` times, each run its
own process (the ranks: torch's elastic launcher from the stage's entry point). The global batch is
the same in every variant (32 sequences: 1 rank accumulates 2 micro-batches of 16, each of 2 ranks
runs 1), so the held-out losses should agree and the time is the cost or gain of splitting it. On a
CPU machine the ranks share the cores (OMP_NUM_THREADS = cores / ranks): this measures the overhead of the
distributed path (gloo all-reduce, ZeRO-3's gathers), not a speed-up; on GPUs each rank has its own device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_vs_full import MODEL, REPO, run_stage, stage_spec  # noqa: E402

from alignflow.config import load_config  # noqa: E402
from alignflow.flows.pipeline import alignflow_pipeline  # noqa: E402
from alignflow.offline import set_offline_defaults  # noqa: E402

VARIANTS = {"1 rank": ["sft.resources.nproc_per_node=1", "sft.zero_stage=0"],
            "2 ranks, ZeRO-2": ["sft.resources.nproc_per_node=2", "sft.zero_stage=2"],
            "2 ranks, ZeRO-3": ["sft.resources.nproc_per_node=2", "sft.zero_stage=3"]}
SHORT = ["sft.epochs=0.25", "sft.batch_size=32", "sft.micro_batch_size=16", "sft.eval_every=1000"]


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of every variant")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    set_offline_defaults()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ranks-bench-"))
    base = [f"workdir={workdir}", "tracking.enabled=false", *MODEL, *SHORT, *args.set]
    config = load_config(REPO / "configs/tiny.yaml", [*base, "stages=[data, base]"])
    rows = {row["key"]: row for row in alignflow_pipeline(config)}
    runs: dict[str, list[Any]] = {name: [] for name in VARIANTS}
    for repeat in range(args.repeats):
        for name, overrides in VARIANTS.items():
            cfg = load_config(REPO / "configs/tiny.yaml", [*base, *overrides])
            spec = stage_spec(
                "sft", cfg, rows, {"base": "base", "data": "data"}, f"{name} #{repeat}", workdir
            )
            result, _ = run_stage(spec, workdir)
            runs[name].append(result)
    results = []
    for name, done in runs.items():
        results.append(
            {
                "variant": name,
                "seconds_per_step": statistics.median(
                    r.metrics["timing/train_s"] / r.metrics["train/steps"] for r in done
                ),
                "tokens_per_s": statistics.median(r.metrics["perf/tokens_per_s"] for r in done),
                "stage_seconds": statistics.median(r.duration_s for r in done),
                "eval_loss": statistics.median(r.metrics["eval/loss"] for r in done),
                "steps": done[0].metrics["train/steps"],
            }
        )
    header = {
        "parameters": rows["base"]["metrics"]["model/parameters"],
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "repeats": args.repeats,
    }
    if args.json:
        print(json.dumps({**header, "rows": results}, indent=2))
        return 0
    table = Table(
        title=f"SFT, global batch 32, {header['parameters'] / 1e6:.1f}M-parameter Llama, {header['cpu']}, "
        f"{header['cores']} cores; medians of {args.repeats} interleaved runs"
    )
    for column in ("variant", "s / step", "tokens / s", "stage wall (s)", "held-out loss", "steps"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r["variant"],
            f"{r['seconds_per_step']:.3f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['stage_seconds']:.1f}",
            f"{r['eval_loss']:.4f}",
            f"{r['steps']:.0f}",
        )
    Console(file=sys.stdout, width=200).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
