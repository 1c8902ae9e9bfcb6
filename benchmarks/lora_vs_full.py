"""LoRA vs full fine-tuning in the SFT and RL stages: trainable parameters, peak memory, step time, refit bytes.

    .venv/bin/python benchmarks/lora_vs_full.py [--rank 8] [--workdir DIR] [--set KEY=VALUE ...]

Runs configs/tiny.yaml with a larger model (default hidden 512, 8 layers, vocab 2048: ~26M
parameters, so optimizer state and model copies show in the memory figures) up to the engine stage
once, then each variant of the SFT stage (from the base model) and of the RL stage (PPO with its
critic and a KL reference, from the full SFT checkpoint) as its own process, and prints one table.
Peak memory is the stage process's peak RSS (ru_maxrss of the child), which includes ~0.5 GiB of
interpreter, torch and library imports common to every row. LoRA adapts every linear layer of a
block (q, k, v, o, gate, up, down).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from alignflow.config import load_config
from alignflow.contract import StageResult, StageSpec
from alignflow.flows.pipeline import alignflow_pipeline
from alignflow.manifest import output_uri
from alignflow.offline import set_offline_defaults

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.tiny.hidden_size=512", "model.tiny.intermediate_size=1376", "model.tiny.num_hidden_layers=8",
         "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=4", "model.tiny.vocab_size=2048"]
# Short runs: the figures are per step, not learning curves.
SHORT = ["sft.epochs=0.25", "reward.epochs=0.25", "ppo.iterations=4", "ppo.checkpoint_every=4",
         "ppo.prompts_per_iteration=16", "ppo.minibatch_size=16", "ppo.ppo_epochs=1"]
# Runs a stage and prints its children's peak RSS (KiB on Linux), a fresh process per measurement.
DRIVER = ("import resource, subprocess, sys; p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
          "sys.stderr.write(p.stderr[-4000:] if p.returncode else ''); "
          "print(p.stdout.strip().splitlines()[-1] if p.stdout.strip() else '{}'); "
          "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)")


def run_stage(spec: StageSpec, workdir: Path) -> tuple[StageResult, float]:
    """(result, peak RSS in MiB) of one stage run in its own process."""
    path = spec.dump(workdir / f"spec-{spec.output_uri.rsplit('/', 1)[-1]}.json")
    env = {**os.environ, "ALIGNFLOW_WARM_STAGES": "0"}
    proc = subprocess.run([sys.executable, "-c", DRIVER, sys.executable, "-m", f"alignflow.stages.{spec.stage}",
                           "--spec", str(path)], capture_output=True, text=True, env=env, cwd=workdir)
    if proc.returncode:
        raise SystemExit(f"{spec.stage} failed:\n{proc.stderr}")
    result_line, peak_kib = proc.stdout.strip().splitlines()[-2:]
    return StageResult.model_validate_json(result_line), int(peak_kib) / 1024


def stage_spec(stage: str, config, rows: dict, inputs: dict[str, str], variant: str, workdir: Path) -> StageSpec:
    dump = config.model_dump(mode="json")
    sections = {"sft": {"sft": dump["sft"], "model": dump["model"]},
                "ppo": {"ppo": dump["ppo"], "model": dump["model"], "engine": dump["engine"]}}[stage]
    return StageSpec(stage=stage, config=sections, inputs={k: rows[v]["output_uri"] for k, v in inputs.items()},
                     input_digests={k: rows[v]["manifest_digest"] for k, v in inputs.items()},
                     output_uri=output_uri(f"file://{workdir}/bench", stage, {"variant": variant, **sections}, {}, "b"),
                     code_version="bench", workdir=str(workdir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    args = parser.parse_args(argv)
    set_offline_defaults()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lora-bench-"))
    base = [f"workdir={workdir}", "tracking.enabled=false", *MODEL, *SHORT, *args.set]
    config = load_config(REPO / "configs/tiny.yaml", [*base, "stages=[data, base, sft, reward, engine]"])
    rows = {row["key"]: row for row in alignflow_pipeline(config)}
    lora = [f"sft.lora.rank={args.rank}", f"sft.lora.alpha={2 * args.rank}", f"ppo.lora.rank={args.rank}",
            f"ppo.lora.alpha={2 * args.rank}"]
    table = Table(title=f"LoRA (rank {args.rank}, every linear layer of a block) vs full fine-tuning; "
                        f"{rows['base']['metrics']['model/parameters'] / 1e6:.1f}M-parameter Llama, 2 threads")
    for column in ("stage", "variant", "trainable parameters", "share", "peak RSS (MiB)", "s/step", "refit bytes"):
        table.add_column(column, justify="right")
    for variant, overrides in (("full", []), ("lora", lora)):
        cfg = load_config(REPO / "configs/tiny.yaml", [*base, *overrides])
        sft, sft_peak = run_stage(stage_spec("sft", cfg, rows, {"base": "base", "data": "data"}, variant, workdir),
                                  workdir)
        table.add_row("sft", variant, f"{sft.metrics['perf/trainable_parameters']:,.0f}",
                      f"{sft.metrics['perf/trainable_share']:.2%}", f"{sft_peak:,.0f}",
                      f"{sft.metrics['timing/train_s'] / sft.metrics['train/steps']:.3f}", "")
        ppo, ppo_peak = run_stage(stage_spec("ppo", cfg, rows, {"engine": "engine", "sft": "sft", "data": "data",
                                                                "reward_rm": "reward-rm"}, variant, workdir), workdir)
        history = [json.loads(line) for line in
                   (Path(ppo.output_uri.removeprefix("file://")) / "metrics.jsonl").read_text().splitlines()]
        table.add_row("ppo", variant, f"{ppo.metrics['perf/trainable_parameters']:,.0f}",
                      f"{ppo.metrics['perf/trainable_share']:.2%}", f"{ppo_peak:,.0f}",
                      f"{statistics.median(h['timing/iteration'] for h in history[1:]):.3f}",
                      f"{history[-1]['refit/bytes'] / 2**20:,.1f} MiB")
    Console(file=sys.stdout, width=200).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
