"""The RL optimisation ladder: GRPO and PPO iteration time from the baseline to every optimisation, vs TRL.

    .venv/bin/python benchmarks/rl_ladder.py [--rounds 3] [--iterations 10] [--shapes grpo,grpo_rm,ppo]
        [--levels baseline,...] [--model llama-4.7m|llama-115m] [--trl-python PY] [--trl-ppo-python PY]
        [--workdir DIR] [--json]

Model: a benchmark Llama of benchmarks/rl_setup.py, 4.72M parameters by default or the production-shaped
114.8M one (`model.base` points at the checkpoint it builds; SFT, reward model and engines come from the
pipeline's own stages, cached). Shapes (the RL-speed issues'): GRPO 4 prompts x 4 completions, 32 new
tokens, 1 epoch, KL 0, scored by a reward function (`letter_share`); GRPO-RM the same scored by the
pipeline's reward model (TRL's side scores with the same checkpoint); PPO 16 prompts x 1, 32 new tokens,
4 epochs, one minibatch of 16, critic and reward model. fp32 weights, learning rate 1e-5, temperature 1.

Each level adds to the one before:
  baseline        hf engine, old and reference log-probs recomputed, plain training step on DeepSpeed, fp32
  native          the native engine (eager)
  compiled        compiled decode step + C++ CPU kernels
  decode_loop     the whole decode loop in one C++ call (engine.cpu_decode_loop) instead of the compiled step
  no_redundant    engine log-probs as old log-probs, no reference forward at KL 0
  fast_step       trimmed minibatches, LM head on response columns, entropy not differentiated, eager
                  attention, plain torch AdamW instead of DeepSpeed (one rank), bf16 autocast where
                  the CPU has bf16 arithmetic
  bf16_weights    the engine's linear weights read as bf16 (engine.cpu_linear_weights): the bf16-rounded model
                  generates, as autocast's bf16 weights train; half the bytes a decode step streams
  async           generation of iteration k+1 overlapped with training on k (one-step off-policy)

A round runs every level of every shape, each as the PPO stage's own process, and TRL's trainer on
the same model and shape (benchmarks/trl_baseline.py) in between, so drifts of a shared machine hit
both. Iteration time is the median of iterations 2..N of a run; the ratio to TRL is taken per round
and its median reported. The bottleneck column is the profiler's sentence for the iterations' phases.
A second table sets each level against the round's fp32 GEMM peak (gemm_peak_gflops): the stage's model
FLOPs an iteration (flops/*), the share of the peak reached, the floor they set and TRL's time over it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rl_setup  # noqa: E402

SHAPES: dict[str, dict[str, Any]] = {
    "grpo": dict(algorithm="grpo", prompts_per_iteration=4, group_size=4, max_new_tokens=32, ppo_epochs=1,
                 minibatch_size=16, kl_coef=0.0, actor_lr=1e-5, temperature=1.0,
                 reward_functions=["alignflow.stages.ppo.reward_functions:letter_share"]),
    "ppo": dict(algorithm="ppo", prompts_per_iteration=16, group_size=1, max_new_tokens=32, ppo_epochs=4,
                minibatch_size=16, actor_lr=1e-5, temperature=1.0),
}
SHAPES["grpo_rm"] = {**SHAPES["grpo"], "reward_functions": []}
WITH_REWARD_MODEL = {"grpo": False, "grpo_rm": True, "ppo": True}

# level -> (engine variant, PPO-section overrides); each level keeps the ones before it.
LEVELS: dict[str, tuple[str, dict[str, Any]]] = {
    "baseline": ("hf", dict(old_logprobs="recompute", kl_metric=True, fast_train_step=False, autocast="off",
                            train_backend="deepspeed", async_rollouts=False)),
    "native": ("native", {}),
    "compiled": ("native_compiled", {}),
    "decode_loop": ("native_loop", {}),
    "no_redundant": ("native_loop", dict(old_logprobs="auto", kl_metric=False)),
    "fast_step": ("native_loop", dict(fast_train_step=True, autocast="auto", train_backend="auto")),
    "bf16_weights": ("native_loop_bf16", {}),
    "async": ("native_loop_bf16", dict(async_rollouts=True)),
}


def level_config(level: str) -> tuple[str, dict[str, Any]]:
    """(engine variant, cumulative PPO overrides) of `level`."""
    overrides: dict[str, Any] = {}
    engine = ""
    for name, (variant, extra) in LEVELS.items():
        engine = variant
        overrides.update(extra)
        if name == level:
            return engine, overrides
    raise ValueError(f"unknown level '{level}'; levels: {', '.join(LEVELS)}")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def bottleneck(iterations: list[dict[str, float]], facts: dict[str, Any]) -> str:
    """The profiler's first finding for the summed phases of these iterations, its advice narrowed by the
    run's `facts` (alignflow_run.json's run_facts: what the run trained and generated with)."""
    from alignflow.stages.common.bottleneck_advice import RunFacts
    from alignflow.stages.common.profiler import ProfileSnapshot, bottleneck_rules

    phases: dict[str, float] = {}
    for m in iterations:
        for key, value in m.items():
            if key.startswith("timing/") and key not in ("timing/iteration", "timing/generate_engine"):
                phases[key.removeprefix("timing/")] = phases.get(key.removeprefix("timing/"), 0.0) + value
    wall = sum(m["timing/iteration"] for m in iterations)
    found = bottleneck_rules(ProfileSnapshot(phase_totals=phases, wall_s=wall, facts=RunFacts(**facts)))
    return found[0] if found else ""


def run_level(up: rl_setup.Upstream, shape: str, level: str, iterations: int, threads: int, scratch: Path
              ) -> dict[str, Any]:
    engine, overrides = level_config(level)
    ppo = {**SHAPES[shape], **overrides, "iterations": iterations, "checkpoint_every": iterations}
    spec = rl_setup.ppo_spec(
        up, engine, ppo, WITH_REWARD_MODEL[shape], scratch / f"spec-{shape}-{level}.json"
    )
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "alignflow.stages.ppo", "--spec", str(spec)],
        capture_output=True,
        text=True,
        env=env,
        cwd=up.workdir,
    )
    total = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{shape}/{level} failed:\n{done.stderr[-3000:]}")
    metrics = rl_setup.read_metrics(spec)[1:]  # iteration 1 is warm-up (first compiled calls, allocator)
    facts = json.loads((rl_setup.run_output(spec) / "alignflow_run.json").read_text())["run_facts"]
    # Each run publishes the trained policy (and critic): 0.9 GB a run at 114.8M, which filled the disk
    shutil.rmtree(rl_setup.run_output(spec), ignore_errors=True)
    seconds = statistics.median(m["timing/iteration"] for m in metrics)
    completions = SHAPES[shape]["prompts_per_iteration"] * SHAPES[shape]["group_size"]
    phases = sorted({k for m in metrics for k in m if k.startswith("timing/") and k != "timing/iteration"})
    # The stage's model FLOPs of each phase (stages/ppo/iteration_flops.py): the same every iteration but for
    # the responses' lengths.
    counted = sorted({k for m in metrics for k in m if k.startswith("flops/")})
    phase_gflops = {k.removeprefix("flops/"): statistics.median(m.get(k, 0.0) for m in metrics) / 1e9
                    for k in counted}
    return {
        "shape": shape,
        "level": level,
        "iteration_s": seconds,
        "completions_per_s": completions / seconds,
        "stage_wall_s": total,
        "bottleneck": bottleneck(metrics, facts),
        "phases_s": {
            k.removeprefix("timing/"): statistics.median(m.get(k, 0.0) for m in metrics) for k in phases
        },
        "phase_gflops": phase_gflops,
        "model_gflops": sum(phase_gflops.values()),
    }


def gemm_peak_gflops(threads: int, repeats: int = 5) -> float:
    """The most fp32 GFLOP/s this machine's matmuls reach on `threads` cores: torch.mm's best over square
    sizes with the threads as one team, or `threads` times one thread's best (processes on a core each, as
    PPO's actor and critic run), whichever is higher. An upper bound on any phase's rate, so the floor it
    gives (model FLOPs / peak) is a lower bound on an iteration's time."""
    import torch
    from cpu_roofline import gemm_gflops  # a sibling script

    sizes = (512, 1024, 2048)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = gemm_gflops("float32", repeats, sizes)
        torch.set_num_threads(threads)
        team = gemm_gflops("float32", repeats, sizes)
    finally:
        torch.set_num_threads(before)
    return max(team, threads * single)


def run_trl(
    python: str, up: rl_setup.Upstream, shape: str, iterations: int, threads: int
) -> dict[str, Any] | None:
    """TRL's figure for `shape`, or None
    (with the reason on stderr) when that interpreter has no usable TRL."""
    prompts = Path(up.data[0].removeprefix("file://")) / "prompts.jsonl"
    sft_dir = Path(up.sft[0].removeprefix("file://"))
    reward_model = ["--reward-model-dir", up.reward[0].removeprefix("file://")] if shape == "grpo_rm" else []
    command = [
        python,
        str(Path(__file__).with_name("trl_baseline.py")),
        "--model-dir",
        str(sft_dir),
        "--shape",
        shape,
        "--iterations",
        str(iterations),
        "--threads",
        str(threads),
        "--prompts-file",
        str(prompts),
        *reward_model,
        "--json",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)}
    )
    if done.returncode != 0:
        print(
            f"TRL {shape}: skipped "
            f"({done.stderr.strip().splitlines()[-1] if done.stderr.strip() else done.returncode})",
            file=sys.stderr,
        )
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def against_the_peak(runs: list[dict[str, Any]], rounds: list[dict[str, Any]],
                     trl: list[dict[str, Any] | None]) -> dict[str, Any]:
    """A level's runs against each round's GEMM peak: its model GFLOP an iteration, the share of the peak the
    iteration and its train and generate phases reached, the floor (model FLOPs at the peak: the least
    time an iteration could take on this machine) and TRL's time over that floor, the most `x TRL` could
    be. Medians over rounds; {} when the stage counted no FLOPs."""
    if not all(run.get("model_gflops") for run in runs):
        return {}
    peaks = [r["gemm_peak_gflops"] for r in rounds]

    def share(run: dict[str, Any], peak: float, phase: str, timing: str) -> float | None:
        seconds, gflops = run["phases_s"].get(timing, 0.0), run["phase_gflops"].get(phase)
        return gflops / seconds / peak if gflops and seconds else None

    def median_of(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    floors = [run["model_gflops"] / peak for run, peak in zip(runs, peaks, strict=True)]
    paired = list(zip(runs, peaks, strict=True))
    return {
        "model_gflops": statistics.median(run["model_gflops"] for run in runs),
        "gemm_peak_gflops": statistics.median(peaks),
        "peak_share": statistics.median(f / run["iteration_s"] for f, run in zip(floors, runs, strict=True)),
        "train_peak_share": median_of([share(run, p, "train", "train") for run, p in paired]),
        "generate_peak_share": median_of([share(run, p, "generate", "generate_engine") for run, p in paired]),
        "floor_s": statistics.median(floors),
        "vs_trl_at_floor": median_of([t["median_s"] / f if t else None
                                      for t, f in zip(trl, floors, strict=True)]),
    }


def summarise(rounds: list[dict[str, Any]], shapes: list[str], levels: list[str]) -> list[dict[str, Any]]:
    """One row per (shape, level): medians over rounds, speed-up over the baseline, ratio to TRL per round."""
    rows = []
    for shape in shapes:
        base = [r["levels"][(shape, levels[0])]["completions_per_s"] for r in rounds]
        for level in levels:
            runs = [r["levels"][(shape, level)] for r in rounds]
            trl = [r["trl"].get(shape) for r in rounds]
            ratios = [
                run["completions_per_s"] / t["completions_per_s"]
                for run, t in zip(runs, trl, strict=True)
                if t
            ]
            rows.append(
                {
                    "shape": shape,
                    "level": level,
                    "iteration_s": statistics.median(x["iteration_s"] for x in runs),
                    "completions_per_s": statistics.median(x["completions_per_s"] for x in runs),
                    "speedup_vs_baseline": statistics.median(
                        x["completions_per_s"] / b for x, b in zip(runs, base, strict=True)
                    ),
                    "vs_trl": statistics.median(ratios) if ratios else None,
                    "vs_trl_rounds": ratios,
                    "bottleneck": runs[-1]["bottleneck"],
                    "phases_s": runs[-1]["phases_s"],
                    **against_the_peak(runs, rounds, trl),
                }
            )
        # (TRL run, the same round's baseline) for the rounds whose TRL run was not skipped
        trl_runs = [(r["trl"][shape], b) for r, b in zip(rounds, base, strict=True) if r["trl"].get(shape)]
        if trl_runs:
            rows.append(
                {
                    "shape": shape,
                    "level": f"TRL {trl_runs[0][0].get('trl_version', '')}",
                    "iteration_s": statistics.median(t["median_s"] for t, _ in trl_runs),
                    "completions_per_s": statistics.median(t["completions_per_s"] for t, _ in trl_runs),
                    "speedup_vs_baseline": statistics.median(t["completions_per_s"] / b for t, b in trl_runs),
                    "vs_trl": 1.0,
                    "vs_trl_rounds": [],
                    "bottleneck": "",
                    "phases_s": {},
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=10, help="per run; the first is left out (warm-up)")
    parser.add_argument("--shapes", default="grpo,grpo_rm,ppo")
    parser.add_argument("--model", default=rl_setup.DEFAULT_MODEL, choices=list(rl_setup.MODELS))
    parser.add_argument("--levels", default=",".join(LEVELS))
    parser.add_argument("--threads", type=int, default=2, help="torch threads of every run (OMP_NUM_THREADS)")
    parser.add_argument(
        "--trl-python", default=sys.executable, help="interpreter with trl for the GRPO shape"
    )
    parser.add_argument(
        "--trl-ppo-python",
        default=None,
        help="interpreter with a trl that still has PPO (1.12; dropped in 1.16); default --trl-python",
    )
    parser.add_argument("--no-trl", action="store_true")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="reuse a workdir (keeps the upstream cache)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    levels = [lv for lv in args.levels.split(",") if lv]
    for name in shapes:
        if name not in SHAPES:
            parser.error(f"--shapes: unknown shape '{name}'; shapes: {', '.join(SHAPES)}")
    for level in levels:
        if level not in LEVELS:
            parser.error(f"--levels: unknown level '{level}'; levels: {', '.join(LEVELS)}")
    if args.iterations < 2:
        parser.error("--iterations must be >= 2: the first iteration is warm-up and left out")
    from alignflow.offline import set_offline_defaults

    set_offline_defaults()
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    workdir = (args.workdir or Path(tempfile.mkdtemp(prefix="rl-ladder-"))).resolve()
    # What the upstream stages and DeepSpeed's import print goes to stderr: with --json, stdout is the JSON
    # alone.
    with contextlib.redirect_stdout(sys.stderr):
        up = rl_setup.prepare(workdir, args.model, sorted({level_config(level)[0] for level in levels}))
    scratch = workdir / "ladder" / args.model  # one model's specs never overwrite another's
    scratch.mkdir(parents=True, exist_ok=True)
    trl_python = {"grpo": args.trl_python, "grpo_rm": args.trl_python,
                  "ppo": args.trl_ppo_python or args.trl_python}
    rounds = []
    for index in range(args.rounds):
        # Each round measures the peak again: the shared host's drifts move it with the runs beside it.
        record: dict[str, Any] = {"levels": {}, "trl": {}, "gemm_peak_gflops": gemm_peak_gflops(args.threads)}
        print(f"round {index + 1}: fp32 GEMM peak {record['gemm_peak_gflops']:.1f} GFLOP/s", file=sys.stderr,
              flush=True)
        for shape in shapes:
            if not args.no_trl:
                trl = record["trl"][shape] = run_trl(
                    trl_python[shape], up, shape, args.iterations, args.threads
                )
                if trl:
                    print(
                        f"round {index + 1}: {shape:4s} {'TRL ' + trl.get('trl_version', ''):13s} "
                        f"{trl['median_s']:.3f} s/iteration {trl['completions_per_s']:6.1f} completions/s",
                        file=sys.stderr,
                        flush=True,
                    )
            for level in levels:
                result = run_level(up, shape, level, args.iterations, args.threads, scratch)
                record["levels"][(shape, level)] = result
                print(
                    f"round {index + 1}: {shape:4s} {level:13s} {result['iteration_s']:.3f} s/iteration "
                    f"{result['completions_per_s']:6.1f} completions/s",
                    file=sys.stderr,
                    flush=True,
                )
        rounds.append(record)
    rows = summarise(rounds, shapes, levels)
    machine = {"cpu": cpu_name(), "cpus": os.cpu_count(), "threads": args.threads, "model": args.model}
    if args.json:
        print(
            json.dumps(
                {"machine": machine, "rounds": args.rounds, "iterations": args.iterations, "rows": rows},
                indent=2,
            )
        )
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"RL ladder, {args.model}: median of {args.rounds} rounds, iterations 2-{args.iterations}, "
        f"{args.threads} threads, {machine['cpu']}"
    )
    for column in ("shape", "level", "s/iteration", "completions/s", "x baseline", "x TRL", "bottleneck"):
        table.add_column(column, justify="left" if column in ("shape", "level", "bottleneck") else "right")
    for r in rows:
        table.add_row(
            r["shape"],
            r["level"],
            f"{r['iteration_s']:.3f}",
            f"{r['completions_per_s']:.1f}",
            f"{r['speedup_vs_baseline']:.2f}",
            f"{r['vs_trl']:.2f}" if r["vs_trl"] else "-",
            r["bottleneck"][:90],
        )
    console = Console(file=sys.stdout, width=220)
    console.print(table)
    counted = [r for r in rows if r.get("floor_s")]
    if counted:
        console.print(peak_table(counted, args.model))
    return 0


def peak_table(rows: list[dict[str, Any]], model: str):
    """The levels against this machine's fp32 GEMM peak (against_the_peak)."""
    from rich.table import Table

    peak = rows[0]["gemm_peak_gflops"]
    table = Table(title=f"{model} against the fp32 GEMM peak ({peak:.0f} GFLOP/s, median of rounds): "
                  "model FLOPs an iteration, the share of the peak reached, and the floor they set")
    for column in ("shape", "level", "model GFLOP/it", "% of peak", "train % of peak", "generate % of peak",
                   "floor s/it", "x TRL at the floor", "x TRL"):
        table.add_column(column, justify="left" if column in ("shape", "level") else "right")

    def percent(value: float | None) -> str:
        return f"{100 * value:.0f}%" if value is not None else "-"

    for r in rows:
        table.add_row(r["shape"], r["level"], f"{r['model_gflops']:.1f}", percent(r["peak_share"]),
                      percent(r["train_peak_share"]), percent(r["generate_peak_share"]),
                      f"{r['floor_s']:.3f}",
                      f"{r['vs_trl_at_floor']:.2f}" if r["vs_trl_at_floor"] else "-",
                      f"{r['vs_trl']:.2f}" if r["vs_trl"] else "-")
    return table


if __name__ == "__main__":
    raise SystemExit(main())
