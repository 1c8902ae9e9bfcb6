"""The RL stage on one node against two namespaced nodes: iteration time, refit bytes and seconds.

    .venv/bin/python benchmarks/rl_nodes.py [--repeats 2] [--iterations 4] [--set K=V] [--json]

Runs configs/tiny.yaml (its SFT and reward model trimmed as tests/flows/test_scaleout_pipeline.py trims them)
through data, base, SFT, the reward model and the engine once, then the PPO stage in each variant,
interleaved `--repeats` times, each run its own set of processes:

- "1 node x 2 ranks": `ppo.resources.nproc_per_node=2`, the elastic launcher on this machine (127.0.0.1);
- "2 nodes x 1 rank": `nnodes=2`, each node a network namespace with its own address, hostname and launcher
  (tests/stages/common/netns.py), the two meeting at node A's address over a veth pair;
- "1 rank + replica, 1 node": one trainer rank and its rollout replica beside it;
- "1 rank + replica on node B": the same, the replica on a rollout node of its own (`engine.rollout_nodes=1`,
  node B runs `--rollout-node 0`), the refit and the work queue crossing the veth.

Each refits one rollout replica (`engine.rollout_workers=1`) every iteration. The figures are
the medians over the runs of each run's per-iteration median (its first iteration, which loads and warms
up, left out). Each namespaced node's trainer ranks get half the cores (OMP_NUM_THREADS), as one node's two
ranks do; a trainer and its rollout node, which take turns, keep every core, as on one node.
On one box the nodes share the cores and the wire is a veth: this measures what going through addresses and
two launchers costs, not a speed-up. The two-node row needs root and `ip`; without them it is
left out, saying why.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_vs_full import REPO, run_stage, stage_spec  # noqa: E402
from training_ranks import cpu_name  # noqa: E402

sys.path.insert(0, str(REPO))
from alignflow.config import load_config  # noqa: E402
from alignflow.contract import StageResult  # noqa: E402
from alignflow.flows.pipeline import alignflow_pipeline  # noqa: E402
from alignflow.offline import set_offline_defaults  # noqa: E402
from tests.stages.common import netns  # noqa: E402

TRIM = ["data.demo.n_sft=1000", "data.demo.n_preferences=1500", "sft.epochs=1", "reward.epochs=1"]
PPO_INPUTS = {"engine": "engine", "sft": "sft", "data": "data", "reward_rm": "reward-rm"}
RDZV_PORT = 29400
ROLLOUT_PORT = 29500
# The rollout queues' shared secret, for this benchmark's own nodes only.
SECRET = {"ALIGNFLOW_ROLLOUT_SECRET": "rl-nodes-benchmark-secret-0123456789"}


def run_on_two_nodes(spec, nodes, workdir: Path, rollout_node: bool = False) -> StageResult:
    """The stage's command on both nodes at once (node B as a rollout node with `rollout_node`); node A's
    (rank 0's) result."""
    path = spec.dump(workdir / f"spec-{spec.output_uri.rsplit('/', 1)[-1]}.json")
    # Trainer ranks on both nodes compute at once: each node gets half the cores, as two machines of half this
    # one would (its launcher would otherwise size its rank's thread pool to every core, and the two nodes
    # would oversubscribe them). A trainer and its rollout node take turns (the trainer waits while the
    # replica generates), as they do on one node: each keeps every core.
    threads = {} if rollout_node else {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    env = {"ALIGNFLOW_WARM_STAGES": "0", **threads, **SECRET}
    roles = [[], ["--rollout-node", "0"] if rollout_node else []]
    procs = [node.start(["-m", "alignflow.stages", "ppo", "--spec", str(path), *role], cwd=workdir, env=env)
             for node, role in zip(nodes, roles, strict=True)]
    outputs = [proc.communicate(timeout=3600) for proc in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        if proc.returncode:
            raise SystemExit(f"ppo on two nodes failed:\n{err[-4000:]}")
    return StageResult.from_output(outputs[0][0])


def per_iteration(result: StageResult) -> dict[str, float]:
    """Medians over the run's iterations after the first."""
    lines = Path(result.output_uri.removeprefix("file://"), "metrics.jsonl").read_text().splitlines()
    later = [json.loads(line) for line in lines][1:]
    return {key: statistics.median(m[key] for m in later)
            for key in ("timing/iteration", "refit/bytes_sent", "refit/seconds")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2, help="interleaved runs of every variant")
    parser.add_argument("--iterations", type=int, default=4, help="RL iterations per run")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    parser.add_argument("--only", action="append", default=[], metavar="VARIANT",
                        help="run only this variant (repeatable; the names of the table's rows)")
    args = parser.parse_args(argv)
    set_offline_defaults()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="rl-nodes-bench-"))
    base = [f"workdir={workdir}", "tracking.enabled=false", *TRIM, f"ppo.iterations={args.iterations}",
            "ppo.checkpoint_every=1000", "engine.rollout_workers=1", *args.set]
    upstream = load_config(REPO / "configs/tiny.yaml", [*base, "stages=[data, base, sft, reward, engine]"])
    rows = {row["key"]: row for row in alignflow_pipeline(upstream)}
    why_not = netns.why_not()
    nodes = None if why_not else netns.make_two_nodes("bench")
    variants: dict[str, list[str]] = {"1 node x 2 ranks": ["ppo.resources.nproc_per_node=2"]}
    if nodes is not None:
        variants["2 nodes x 1 rank"] = ["ppo.resources.nnodes=2", "ppo.resources.nproc_per_node=1",
                                        f"ppo.resources.rdzv_endpoint={nodes[0].address}:{RDZV_PORT}"]
    variants["1 rank + replica, 1 node"] = []
    if nodes is not None:
        variants["1 rank + replica on node B"] = [
            "engine.rollout_nodes=1", f"engine.rollout_endpoint={nodes[0].address}:{ROLLOUT_PORT}"]
    if args.only:
        unknown = sorted(set(args.only) - set(variants))
        if unknown:
            raise SystemExit(f"--only {unknown}: no such variant here; variants: {sorted(variants)}")
        variants = {name: overrides for name, overrides in variants.items() if name in args.only}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    try:
        for repeat in range(args.repeats):
            for name, overrides in variants.items():
                cfg = load_config(REPO / "configs/tiny.yaml", [*base, *overrides])
                spec = stage_spec("ppo", cfg, rows, PPO_INPUTS, f"{name} #{repeat}", workdir)
                if "2 nodes" in name or "node B" in name:
                    result = run_on_two_nodes(spec, nodes, workdir, rollout_node="node B" in name)
                else:
                    result = run_stage(spec, workdir)[0]
                runs[name].append(per_iteration(result))
    finally:
        if nodes is not None:
            netns.remove_two_nodes(nodes)
    results = [{"variant": name, **{key: statistics.median(r[key] for r in done) for key in done[0]}}
               for name, done in runs.items()]
    header = {"cpu": cpu_name(), "cores": os.cpu_count(), "repeats": args.repeats,
              "iterations": args.iterations, "two_nodes_left_out": why_not}
    if args.json:
        print(json.dumps({**header, "rows": results}, indent=2))
        return 0
    table = Table(title=f"RL stage (configs/tiny.yaml, {args.iterations} iterations), {header['cpu']}, "
                  f"{header['cores']} cores; medians of {args.repeats} interleaved runs")
    for column in ("variant", "s / iteration", "refit MiB sent", "refit s", "refit MiB/s"):
        table.add_column(column, justify="right")
    for r in results:
        mib = r["refit/bytes_sent"] / 2**20
        table.add_row(r["variant"], f"{r['timing/iteration']:.3f}", f"{mib:.2f}", f"{r['refit/seconds']:.3f}",
                      f"{mib / r['refit/seconds']:.0f}")
    Console(file=sys.stdout, width=200).print(table)
    if why_not:
        print(f"the two-node rows: left out, {why_not}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
