"""PPO iteration time and samples/s on the tiny config with the native and the hf engine backends.

    .venv/bin/python benchmarks/ppo_iteration.py [--iterations 6] [--json] [--workdir DIR]

Runs the pipeline up to the engine stage once per backend (data, base, sft and reward are shared
through the manifest cache), then the PPO stage for --iterations, and reads each run's
metrics.jsonl. The first iteration is left out of the means (warm-up). Prints one table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from alignflow.config import load_config
from alignflow.flows.pipeline import alignflow_pipeline
from alignflow.offline import set_offline_defaults

REPO = Path(__file__).resolve().parent.parent
PHASES = ("generate", "score", "reference", "values", "advantages", "io", "train", "refit")


def run_backend(workdir: Path, backend: str, iterations: int) -> dict[str, float]:
    config = load_config(REPO / "configs/tiny.yaml", [
        f"workdir={workdir}", "stages=[data,base,sft,reward,engine,ppo]", f"engine.backend={backend}",
        f"ppo.iterations={iterations}", f"ppo.checkpoint_every={iterations}", "tracking.enabled=false"])
    rows = {row["key"]: row for row in alignflow_pipeline(config)}
    out = Path(rows["ppo"]["output_uri"].removeprefix("file://"))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    samples = config.ppo.prompts_per_iteration * config.ppo.group_size
    mean_iteration = statistics.mean(m["timing/iteration"] for m in metrics)
    result = {
        "backend": backend,
        "iteration_s": mean_iteration,
        "samples_per_s": samples / mean_iteration,
        "gen_tokens_per_s": statistics.mean(
            m["rollout/response_length_mean"] * samples / m["timing/generate"] for m in metrics
        ),
    }
    for phase in PHASES:
        result[f"{phase}_s"] = statistics.mean(m.get(f"timing/{phase}", 0.0) for m in metrics)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None, help="reuse a workdir (keeps the cache)")
    args = parser.parse_args(argv)
    set_offline_defaults()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="ppo-bench-"))
    results = [run_backend(workdir, backend, args.iterations) for backend in ("native", "hf")]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    table = Table(
        title=f"PPO iteration on configs/tiny.yaml ({args.iterations - 1} iterations after warm-up)"
    )
    for column in ("backend", "iteration s", "samples/s", "gen tokens/s", *(f"{p} s" for p in PHASES)):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r["backend"],
            f"{r['iteration_s']:.2f}",
            f"{r['samples_per_s']:.1f}",
            f"{r['gen_tokens_per_s']:.0f}",
            *(f"{r[f'{p}_s']:.3f}" for p in PHASES),
        )
    Console(file=sys.stdout, width=200).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
