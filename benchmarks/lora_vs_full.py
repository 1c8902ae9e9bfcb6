"""LoRA vs full fine-tuning in the SFT and RL stages: trainable parameters, peak memory, step time, refit.

    .venv/bin/python benchmarks/lora_vs_full.py [--rank 8] [--workdir DIR] [--set KEY=VALUE ...] [--json]

Runs configs/tiny.yaml with a larger model (default hidden 512, 8 layers, vocab 2048: ~26M
parameters, so optimizer state and model copies show in the memory figures) up to the engine stage
once, then each variant of the SFT stage (from the base model) and of the RL stage (PPO with its
critic and a KL reference, from the full SFT checkpoint) as its own process, and prints one table.
Peak memory is the stage process's own peak RSS (VmHWM, Linux), which includes ~0.5 GiB of
interpreter, torch and library imports common to every row, and in the RL rows the engine, the
reward model and (full fine-tuning only) the separate reference model. LoRA adapts every linear layer
of a block (q, k, v, o, gate, up, down), and in a third variant q_proj and v_proj only. Time is seconds per
optimizer step for SFT and the median seconds per iteration (generate, score, forwards, train, refit; the
first iteration left out) for PPO.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from alignflow.config import load_config
from alignflow.contract import StageResult, StageSpec, stage_program
from alignflow.flows.pipeline import alignflow_pipeline
from alignflow.manifest import output_uri
from alignflow.offline import set_offline_defaults

REPO = Path(__file__).resolve().parent.parent
MODEL = ["model.tiny.hidden_size=512", "model.tiny.intermediate_size=1376", "model.tiny.num_hidden_layers=8",
         "model.tiny.num_attention_heads=8", "model.tiny.num_key_value_heads=4", "model.tiny.vocab_size=2048"]
# Short runs: the figures are per step, not learning curves.
SHORT = ["sft.epochs=0.25", "reward.epochs=0.25", "ppo.iterations=4", "ppo.checkpoint_every=4",
         "ppo.prompts_per_iteration=16", "ppo.minibatch_size=16", "ppo.ppo_epochs=1"]


def peak_rss_kib(pid: int) -> int | None:
    """VmHWM (the process's own peak resident set, KiB) from /proc; None where there is no /proc."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), None)
    except OSError:
        return None


def run_stage(spec: StageSpec, workdir: Path) -> tuple[StageResult, float]:
    """(result, peak RSS in MiB) of one stage run in its own process.

    The peak is the stage process's own high-water mark, read from /proc every 50 ms until it exits (it only
    grows, so the last read is the peak up to the final 50 ms of teardown). Not ru_maxrss of the children:
    that is the largest descendant's, so a C++ build the stage waits for (DeepSpeed's comm op, the CPU
    kernels; cc1plus can take over 1 GiB) would show instead of the stage (one such row read 1.5 GiB where
    its twin read 0.6).
    """
    path = spec.dump(workdir / f"spec-{spec.output_uri.rsplit('/', 1)[-1]}.json")
    env = {**os.environ, "ALIGNFLOW_WARM_STAGES": "0"}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, "-m", stage_program(spec.stage), "--spec", str(path)],
                                stdout=out, stderr=err, text=True, env=env, cwd=workdir)
        peak_kib = 0
        while proc.poll() is None:
            peak_kib = max(peak_kib, peak_rss_kib(proc.pid) or 0)
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode:
        raise SystemExit(f"{spec.stage} failed:\n{stderr[-4000:]}")
    result_line = stdout.strip().splitlines()[-1]
    result = StageResult.model_validate_json(result_line)
    if result.status == "skipped":  # found its published output: nothing ran, nothing was measured
        raise SystemExit(
            f"{spec.stage}: {result.output_uri} is published already; remove {workdir / 'bench'} or "
            "pass another --workdir"
        )
    return result, peak_kib / 1024


def stage_spec(
    stage: str, config, rows: dict, inputs: dict[str, str], variant: str, workdir: Path
) -> StageSpec:
    dump = config.model_dump(mode="json")
    sections = {
        "sft": {"sft": dump["sft"], "model": dump["model"]},
        "ppo": {"ppo": dump["ppo"], "model": dump["model"], "engine": dump["engine"]},
    }[stage]
    return StageSpec(
        stage=stage,
        config=sections,
        inputs={k: rows[v]["output_uri"] for k, v in inputs.items()},
        input_digests={k: rows[v]["manifest_digest"] for k, v in inputs.items()},
        output_uri=output_uri(f"file://{workdir}/bench", stage, {"variant": variant, **sections}, {}, "b"),
        code_version="bench",
        workdir=str(workdir),
    )


def measure(cfg, rows: dict, variant: str, workdir: Path) -> list[dict[str, Any]]:
    """The SFT row and the PPO row of one variant, each stage in its own process."""
    sft, sft_peak = run_stage(
        stage_spec("sft", cfg, rows, {"base": "base", "data": "data"}, variant, workdir), workdir
    )
    ppo, ppo_peak = run_stage(
        stage_spec(
            "ppo",
            cfg,
            rows,
            {"engine": "engine", "sft": "sft", "data": "data", "reward_rm": "reward-rm"},
            variant,
            workdir,
        ),
        workdir,
    )
    history = [
        json.loads(line)
        for line in (Path(ppo.output_uri.removeprefix("file://")) / "metrics.jsonl").read_text().splitlines()
    ]
    return [
        {
            "stage": "sft",
            "variant": variant,
            "trainable_parameters": sft.metrics["perf/trainable_parameters"],
            "trainable_share": sft.metrics["perf/trainable_share"],
            "peak_rss_mib": sft_peak,
            "seconds": sft.metrics["timing/train_s"] / sft.metrics["train/steps"],
            "per": "step",
            "refit_bytes": None,
        },
        {
            "stage": "ppo",
            "variant": variant,
            "trainable_parameters": ppo.metrics["perf/trainable_parameters"],
            "trainable_share": ppo.metrics["perf/trainable_share"],
            "peak_rss_mib": ppo_peak,
            "seconds": statistics.median(h["timing/iteration"] for h in history[1:] or history),
            "per": "iteration",
            "refit_bytes": history[-1]["refit/bytes"],
        },
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    args = parser.parse_args(argv)
    set_offline_defaults()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="lora-bench-"))
    base = [f"workdir={workdir}", "tracking.enabled=false", *MODEL, *SHORT, *args.set]
    config = load_config(REPO / "configs/tiny.yaml", [*base, "stages=[data, base, sft, reward, engine]"])
    rows = {row["key"]: row for row in alignflow_pipeline(config)}
    lora = [
        f"sft.lora.rank={args.rank}",
        f"sft.lora.alpha={2 * args.rank}",
        f"ppo.lora.rank={args.rank}",
        f"ppo.lora.alpha={2 * args.rank}",
    ]
    # Every linear layer (the default) vs attention's q and v only: the refit sends the adapted modules'
    # merged weights, so how much it saves depends on target_modules, not on the rank.
    qv = [*lora, "sft.lora.target_modules=[q_proj,v_proj]", "ppo.lora.target_modules=[q_proj,v_proj]"]
    results = [
        row
        for variant, overrides in (("full", []), ("lora", lora), ("lora q,v", qv))
        for row in measure(
            load_config(REPO / "configs/tiny.yaml", [*base, *overrides]), rows, variant, workdir
        )
    ]
    results.sort(key=lambda r: r["stage"] == "ppo")  # SFT rows first, then PPO
    if args.json:
        print(
            json.dumps(
                {
                    "rank": args.rank,
                    "parameters": rows["base"]["metrics"]["model/parameters"],
                    "rows": results,
                },
                indent=2,
            )
        )
        return 0
    table = Table(
        title=f"LoRA (rank {args.rank}; lora: every linear layer of a block, lora q,v: q_proj and "
        "v_proj) vs full fine-tuning; "
        f"{rows['base']['metrics']['model/parameters'] / 1e6:.1f}M-parameter Llama, "
        f"{os.cpu_count()} CPU threads"
    )
    for column in (
        "stage",
        "variant",
        "trainable parameters",
        "share",
        "peak RSS (MiB)",
        "seconds",
        "refit per iteration",
    ):
        table.add_column(column, justify="right")
    for r in results:
        table.add_row(
            r["stage"],
            r["variant"],
            f"{r['trainable_parameters']:,.0f}",
            f"{r['trainable_share']:.2%}",
            f"{r['peak_rss_mib']:,.0f}",
            f"{r['seconds']:.3f} per {r['per']}",
            "" if r["refit_bytes"] is None else f"{r['refit_bytes'] / 2**20:,.2f} MiB",
        )
    Console(file=sys.stdout, width=200).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
