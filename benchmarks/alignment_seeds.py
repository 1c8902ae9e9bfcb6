"""Does RL align the policy? PPO and GRPO vs SFT on the demo task's held-out gold score, over seeds.

    .venv/bin/python benchmarks/alignment_seeds.py [--seeds 0 1 2] [--set KEY=VALUE ...] [--json] [--workdir DIR]

`--set` overrides the config of every RL run (e.g. `--set ppo.async_rollouts=true`).

Runs configs/tiny.yaml once up to the engine stage (data, base, SFT, reward model and engine are
shared), then PPO and GRPO (group size 4, 16 prompts x 4 completions per iteration) with each
seed followed by the evaluation stage, and prints one table: gold and reward-model deltas over
SFT with their standard errors, win rate under gold, KL to the reference.
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
ALGORITHMS = {"ppo": [], "grpo": ["ppo.algorithm=grpo", "ppo.group_size=4", "ppo.prompts_per_iteration=16",
                                  "ppo.minibatch_size=32"]}


def run(workdir: Path, algorithm: str, seed: int, overrides: list[str]) -> dict[str, float]:
    config = load_config(REPO / "configs/tiny.yaml", [f"workdir={workdir}", "tracking.enabled=false",
                                                      f"ppo.seed={seed}", *ALGORITHMS[algorithm], *overrides])
    rows = {row["key"]: row for row in alignflow_pipeline(config)}
    report = json.loads((Path(rows["evaluate"]["output_uri"].removeprefix("file://")) / "eval.json").read_text())
    return {"algorithm": algorithm, "seed": seed, "gold_delta": report["gold_delta"],
            "gold_delta_se": report["gold_delta_se"], "rm_delta": report["rm_delta"],
            "win_rate_gold": report["win_rate_gold"], "kl_to_ref": report["kl_to_ref"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="config override of every RL run (repeatable)")
    args = parser.parse_args(argv)
    set_offline_defaults()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="align-bench-"))
    results = [run(workdir, algorithm, seed, args.set) for algorithm in ALGORITHMS for seed in args.seeds]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    table = Table(title="Held-out gold score of the RL policy minus SFT (configs/tiny.yaml, 128 prompts, T=1"
                        + (", " + ", ".join(args.set) if args.set else "") + ")")
    for column in ("algorithm", "seed", "gold delta ± s.e.", "RM delta (z)", "win rate (gold)", "KL to ref (nats)"):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(r["algorithm"], str(r["seed"]), f"{r['gold_delta']:+.3f} ± {r['gold_delta_se']:.3f}",
                      f"{r['rm_delta']:+.3f}", f"{r['win_rate_gold']:.1%}", f"{r['kl_to_ref']:.2f}")
    for algorithm in ALGORITHMS:
        mine = [r for r in results if r["algorithm"] == algorithm]
        table.add_row(algorithm, "mean", f"{statistics.mean(r['gold_delta'] for r in mine):+.3f}",
                      f"{statistics.mean(r['rm_delta'] for r in mine):+.3f}",
                      f"{statistics.mean(r['win_rate_gold'] for r in mine):.1%}",
                      f"{statistics.mean(r['kl_to_ref'] for r in mine):.2f}")
    Console(file=sys.stdout, width=200).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
