"""Does alignment help? PPO, GRPO and DPO vs SFT on the demo task's held-out gold score, over seeds.

    .venv/bin/python benchmarks/alignment_seeds.py [--algorithms ppo grpo dpo] [--seeds 0 1 2]
        [--set KEY=VALUE ...] [--json] [--workdir DIR]

`--set` overrides the config of every run (e.g. `--set ppo.async_rollouts=true`, `--set dpo.beta=0.2`).

Runs configs/tiny.yaml once up to the engine stage (data, base, SFT, reward model and engine are
shared), then PPO, GRPO (group size 4, 16 prompts x 4 completions per iteration) and DPO (on the
preference pairs the reward model learned from; no engine) with each seed, each followed by the
evaluation stage, and prints one table: gold and reward-model deltas over SFT with their standard
errors, win rate under gold, KL to the reference, and the policy stage's wall time.
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
                                  "ppo.minibatch_size=32"],
              # The reward model is trained too (shared with the RL runs), only so the table can show DPO's
              # reward-model delta beside theirs; DPO itself never reads it.
              "dpo": ["stages=[data, base, sft, reward, dpo, evaluate]"]}


def run(workdir: Path, algorithm: str, seed: int, overrides: list[str]) -> dict[str, float]:
    section = "dpo" if algorithm == "dpo" else "ppo"
    config = load_config(
        REPO / "configs/tiny.yaml",
        [
            f"workdir={workdir}",
            "tracking.enabled=false",
            f"{section}.seed={seed}",
            *ALGORITHMS[algorithm],
            *overrides,
        ],
    )
    rows = {row["key"]: row for row in alignflow_pipeline(config)}
    report = json.loads(
        (Path(rows["evaluate"]["output_uri"].removeprefix("file://")) / "eval.json").read_text()
    )
    return {
        "algorithm": algorithm,
        "seed": seed,
        "gold_delta": report["gold_delta"],
        "gold_delta_se": report["gold_delta_se"],
        "rm_delta": report["rm_delta"],
        "win_rate_gold": report["win_rate_gold"],
        "kl_to_ref": report["kl_to_ref"],
        "policy_stage_s": rows[section]["duration_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", choices=list(ALGORITHMS), default=list(ALGORITHMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override of every RL run (repeatable)",
    )
    args = parser.parse_args(argv)
    set_offline_defaults()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="align-bench-"))
    results = [
        run(workdir, algorithm, seed, args.set) for algorithm in args.algorithms for seed in args.seeds
    ]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    table = Table(
        title="Held-out gold score of the aligned policy minus SFT (configs/tiny.yaml, 128 prompts, T=1"
        + (", " + ", ".join(args.set) if args.set else "")
        + ")"
    )
    for column in (
        "algorithm",
        "seed",
        "gold delta ± s.e.",
        "RM delta (z)",
        "win rate (gold)",
        "KL to ref (nats)",
        "policy stage (s)",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r["algorithm"],
            str(r["seed"]),
            f"{r['gold_delta']:+.3f} ± {r['gold_delta_se']:.3f}",
            f"{r['rm_delta']:+.3f}",
            f"{r['win_rate_gold']:.1%}",
            f"{r['kl_to_ref']:.2f}",
            f"{r['policy_stage_s']:.1f}",
        )
    for algorithm in args.algorithms:
        mine = [r for r in results if r["algorithm"] == algorithm]
        gold = [r["gold_delta"] for r in mine]
        spread = f" ± {statistics.stdev(gold):.3f} (sd)" if len(gold) > 1 else ""
        table.add_row(
            algorithm,
            "mean",
            f"{statistics.mean(gold):+.3f}{spread}",
            f"{statistics.mean(r['rm_delta'] for r in mine):+.3f}",
            f"{statistics.mean(r['win_rate_gold'] for r in mine):.1%}",
            f"{statistics.mean(r['kl_to_ref'] for r in mine):.2f}",
            f"{statistics.mean(r['policy_stage_s'] for r in mine):.1f}",
        )
    Console(file=sys.stdout, width=200).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
