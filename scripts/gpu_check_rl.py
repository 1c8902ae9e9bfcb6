"""gpu_check.sh's RL step: one GRPO iteration of alignflow beside TRL's GRPOTrainer, same device and model.

    python scripts/gpu_check_rl.py --config configs/gpu-small.yaml --device cuda --workdir DIR \\
        [--iterations 8] [--set key=value ...] [--result FILE]

The shape is benchmarks/rl_ladder.py's GRPO shape (4 prompts x 4 completions of 32 new tokens, one update per
generation, KL 0, reward = share of the letter "e"); the model is the config's base model, random init (an RL
iteration costs the same whatever SFT taught the policy, so by default this step needs neither SFT nor a
reward model and does not depend on the pipeline step; --policy sft takes the pipeline step's SFT checkpoint
and engine instead, which saves the CPU mode an engine build). alignflow's side is the RL stage as configured
(model.device, the config's engine: CUDA graphs on a GPU), run as its own process like the pipeline runs it;
TRL's side is benchmarks/trl_baseline.py --shape grpo on the same checkpoint, prompts and device. Both report
the median seconds per iteration of iterations 2..N; the ratio is alignflow's completions/s over TRL's.

Without an importable trl (>= 1.16) TRL's side is "not run: trl not installed": the step then reports that and
alignflow's own figure, and it is not a pass.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_check_pipeline import log, run_stages  # noqa: E402  (sibling scripts, not a package)
from rl_ladder import SHAPES  # noqa: E402

SHAPE = "grpo"


def completions_per_iteration() -> int:
    return SHAPES[SHAPE]["prompts_per_iteration"] * SHAPES[SHAPE]["group_size"]


def ours(config_path: Path, overrides: list[str], iterations: int, policy: str) -> tuple[dict, Path, Path]:
    """alignflow's figure, and the (model folder, prompts file) TRL gets; `policy` is the checkpoint both
    start from: 'base' (the random init) or 'sft' (the pipeline step's, reused with its engine when
    published)."""
    from alignflow.config import load_config

    ppo = {**SHAPES[SHAPE], "iterations": iterations, "checkpoint_every": iterations}
    rl = [f"ppo.{key}={json.dumps(value)}" for key, value in ppo.items()]
    # sft stays in `stages` (the engine and RL stages need an input named sft); the base checkpoint is that
    # input.
    config = load_config(config_path, [*overrides, "stages=[data,base,sft,engine,ppo]", *rl])
    if config.engine.max_batch_size < completions_per_iteration():
        config = load_config(config_path, [*overrides, "stages=[data,base,sft,engine,ppo]", *rl,
                                           f"engine.max_batch_size={completions_per_iteration()}"])
    stages = ["data", "base", "engine", "ppo"] + (["sft"] if policy == "sft" else [])
    rows = {row["key"]: row for row in run_stages(config, stages=stages,
                                                  substitute={"sft": "base"} if policy == "base" else None)}
    failed = [key for key, row in rows.items() if row["status"] == "failed"]
    if failed:
        raise RuntimeError(f"stage {failed[0]} failed: {rows[failed[0]]['message'][-800:]}")
    out = Path(rows["ppo"]["output_uri"].removeprefix("file://"))
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = statistics.median(m["timing/iteration"] for m in metrics[1:] or metrics)  # iteration 1: warm-up
    phases = sorted({k for m in metrics for k in m if k.startswith("timing/") and k != "timing/iteration"})
    figure = {
        "iteration_s": round(seconds, 4),
        "completions_per_s": round(completions_per_iteration() / seconds, 2),
        "iterations": len(metrics),
        "devices": rows["ppo"].get("devices") or {},
        "phases_s": {
            k.removeprefix("timing/"): round(
                statistics.median(m.get(k, 0.0) for m in metrics[1:] or metrics), 4
            )
            for k in phases
        },
        # The stage's model TFLOP/s per phase and, on a GPU it knows the peak of, the train phase's MFU.
        "perf": {
            k.removeprefix("perf/"): round(statistics.median(m[k] for m in metrics[1:] or metrics), 4)
            for k in sorted({k for m in metrics for k in m if k.startswith(("perf/tflops/", "perf/mfu/"))})
            if all(k in m for m in metrics[1:] or metrics)
        },
    }
    model_dir = Path(rows[policy]["output_uri"].removeprefix("file://"))
    prompts = Path(rows["data"]["output_uri"].removeprefix("file://")) / "prompts.jsonl"
    return figure, model_dir, prompts


def trl(model_dir: Path, prompts: Path, iterations: int, device: str, log_path: Path) -> dict | str:
    """TRL's figure, or why it did not run ("not run: trl not installed", or the failure)."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:  # before a process that imports torch to find that out
        log_path.write_text("trl is not installed here\n")
        return "not run: trl not installed"
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "trl_baseline.py"),
        "--model-dir",
        str(model_dir),
        "--shape",
        SHAPE,
        "--iterations",
        str(iterations),
        "--device",
        device,
        "--prompts-file",
        str(prompts),
        "--json",
    ]
    done = subprocess.run(command, capture_output=True, text=True)
    log_path.write_text(done.stderr)
    if done.returncode == 2 and "trl is not importable" in done.stderr:
        return "not run: trl not installed"
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit code {done.returncode}"
        return f"failed: {last}"
    return json.loads(done.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs/gpu-small.yaml")
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument(
        "--iterations", type=int, default=8, help="per side; the first is warm-up and left out"
    )
    parser.add_argument(
        "--policy",
        choices=("base", "sft"),
        default="base",
        help="the checkpoint both sides start from: base (needs no SFT: this step stands alone) or "
        "sft (the pipeline step's SFT and engine outputs in --workdir, reused)",
    )
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--result", type=Path, default=None, help="write this step's JSON object here")
    args = parser.parse_args(argv)
    if args.iterations < 2:
        parser.error("--iterations must be >= 2: the first iteration is warm-up and left out")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from alignflow.manifest import code_version
    from alignflow.offline import set_offline_defaults

    set_offline_defaults()
    os.environ.setdefault("ALIGNFLOW_CODE_VERSION", code_version())  # one version for every stage of this run
    started = time.perf_counter()
    overrides = [
        f"workdir={args.workdir.resolve()}",
        "tracking.enabled=false",
        f"model.device={args.device}",
        *args.overrides,
    ]
    shape = SHAPES[SHAPE]
    figures: dict = {
        "shape": f"{SHAPE}: {shape['prompts_per_iteration']} prompts x {shape['group_size']} "
        f"completions, {shape['max_new_tokens']} new tokens"
    }
    try:
        figures["alignflow"], model_dir, prompts = ours(args.config, overrides, args.iterations, args.policy)
    except RuntimeError as exc:
        status, summary = "fail", f"alignflow's RL stage: {exc}"
    else:
        log(
            f"alignflow {figures['alignflow']['iteration_s']:.3f} s/iteration; TRL's GRPOTrainer on "
            f"{model_dir}"
        )
        theirs = trl(model_dir, prompts, args.iterations, args.device, args.workdir / "trl.log")
        ours_cps = figures["alignflow"]["completions_per_s"]
        if isinstance(theirs, str):
            status = "not run" if theirs.startswith("not run") else "fail"
            summary = f"TRL {theirs}; alignflow {ours_cps:.1f} completions/s"
            figures["trl"] = theirs
        else:
            figures["trl"] = {
                k: theirs[k] for k in ("trl_version", "median_s", "completions_per_s", "iterations")
            }
            figures["ratio"] = round(ours_cps / theirs["completions_per_s"], 3)
            status = "pass"
            summary = (
                f"alignflow {ours_cps:.1f} vs TRL {theirs['trl_version']} {theirs['completions_per_s']:.1f} "
                f"completions/s: {figures['ratio']:.2f}x"
            )
        mfu = figures["alignflow"]["perf"].get("mfu/train")
        if mfu is not None:  # a GPU whose peak the stage knows (stages/common/model_flops.py)
            summary += f"; train at {100 * mfu:.1f}% MFU"
        on_cpu = [role for role, where in figures["alignflow"]["devices"].items() if where == "cpu"]
        if args.device == "cuda" and on_cpu:
            status, summary = "fail", f"{summary}; computed on cpu under --device cuda: {', '.join(on_cpu)}"
    print(f"rl: {status}: {summary}")
    line = {
        "step": "rl",
        "status": status,
        "summary": summary,
        "seconds": round(time.perf_counter() - started, 1),
        "figures": figures,
    }
    if args.result is not None:
        args.result.write_text(json.dumps(line))
    return 0 if status in ("pass", "not run") else 1


if __name__ == "__main__":
    raise SystemExit(main())
