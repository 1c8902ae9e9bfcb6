"""gpu_check.sh's pipeline step: SFT -> reward -> engine -> PPO -> evaluate, then GRPO, on one device.

    python scripts/gpu_check_pipeline.py --config configs/gpu-small.yaml --device cuda --workdir DIR \\
        [--set key=value ...] [--result FILE]

The stages run as the pipeline runs them, each its own process (`python -m alignflow.stages.<stage> --spec`,
flows/launch.py), in flows/plan.py's order, with the output URIs the flow derives, so a published output is
reused. What it is not: the Prefect flow. There is no Prefect and no MLflow here (a bare GPU machine has
neither, and `make gpu-check` carries no wheels for them): tracking is off, stages run one at a time, nothing
is retried or registered. `alignflow run` is the pipeline; this checks that its stages compute on the device.

GRPO reuses every upstream output of the PPO run and runs its own RL and evaluate stages. Prints the stage
table (status, seconds, where each role computed, key metric) and each run's held-out gold gain (the evaluate
stage's eval/gold_delta, ± its standard error). Fails (exit 1) when a stage fails or, on cuda, when a stage
records a role that computed on the CPU. Its JSON object of figures goes to --result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PIPELINE = ["data", "base", "sft", "reward", "engine", "ppo", "evaluate"]
COMPUTING = ("sft", "reward", "engine", "ppo", "evaluate")  # the stages that train, score or generate
GROUP_SIZE = 4  # GRPO's completions per prompt; its prompts per iteration are PPO's / 4 (as many completions)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def run_stages(config, stages: list[str] | None = None, rename: dict[str, str] | None = None,
               substitute: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run the stage calls of `config` (those of `stages`, default all) in plan order; rows as the flow
    returns them.

    `substitute` maps an upstream key to another (e.g. {"sft": "base"}: the base checkpoint stands in for
    SFT's); `rename` labels rows (e.g. {"ppo": "ppo (grpo)"}). A stage whose output is published is reused
    ('skipped').
    """
    from alignflow.contract import StageResult, StageSpec
    from alignflow.flows.launch import launch_local
    from alignflow.flows.plan import plan
    from alignflow.manifest import code_version, find_published, output_uri
    from alignflow.storage import normalize_root

    workdir = Path(config.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    root, version = normalize_root(config.storage.root, workdir), code_version()
    results: dict[str, StageResult] = {}
    rows = []
    for call in plan(config):
        if stages is not None and call.stage not in stages:
            continue
        inputs = {name: (substitute or {}).get(up, up) for name, up in call.inputs.items()}
        missing = [up for up in inputs.values() if up not in results]
        if missing:
            raise SystemExit(f"stage {call.key} needs {missing}, which this run does not produce")
        # As flows/pipeline.py's build_spec: the output URI is a digest of (stage, config, inputs, code
        # version).
        digests = {name: results[up].manifest_digest for name, up in inputs.items()}
        spec = StageSpec(
            stage=call.stage,
            config=call.config,
            inputs={name: results[up].output_uri for name, up in inputs.items()},
            input_digests=digests,
            output_uri=output_uri(root, call.stage, call.identity(), digests, version),
            storage=config.storage,
            tracking=None,
            code_version=version,
            workdir=str(workdir),
        )
        manifest = find_published(spec.output_uri, spec.storage)
        if manifest is not None:
            result = StageResult.from_manifest(
                manifest, "skipped", message="output already published; reused"
            )
        else:
            log(f"--- stage {call.key}")
            started = time.perf_counter()
            result, _ = launch_local(spec, call.key, workdir)
            if result.duration_s == 0.0:
                result = result.model_copy(update={"duration_s": round(time.perf_counter() - started, 3)})
        results[call.key] = result
        rows.append({"key": (rename or {}).get(call.key, call.key), **result.model_dump()})
        if result.status == "failed":
            log(f"stage {call.key} failed: {result.message}")
            break
    return rows


def cpu_roles(rows: list[dict[str, Any]]) -> list[str]:
    """'stage: role' for every role a stage recorded on the CPU."""
    return [
        f"{row['key']}: {role}"
        for row in rows
        for role, where in (row.get("devices") or {}).items()
        if where == "cpu"
    ]


def gold_gain(row: dict[str, Any]) -> dict[str, float] | None:
    """eval/gold_delta of an evaluate row, with its standard error from eval.json; None without gold."""
    delta = (row.get("metrics") or {}).get("eval/gold_delta")
    if delta is None:
        return None
    gain = {"gold_delta": delta}
    report = Path(str(row.get("output_uri", "")).removeprefix("file://")) / "eval.json"
    if report.is_file():
        gain["gold_delta_se"] = json.loads(report.read_text()).get("gold_delta_se")
    return gain


def print_table(rows: list[dict[str, Any]], device: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Pipeline stages on {device}")
    for column in ("stage", "status", "seconds", "devices", "key metric"):
        table.add_column(column, justify="right" if column == "seconds" else "left")
    for row in rows:
        devices = ", ".join(f"{role} {where}" for role, where in (row.get("devices") or {}).items()) or "-"
        name = row.get("key_metric")
        value = (row.get("metrics") or {}).get(name) if name else None
        table.add_row(
            row["key"],
            row["status"],
            f"{row['duration_s']:.1f}",
            devices,
            f"{name}={value:.4g}" if value is not None else "-",
        )
    Console(file=sys.stdout, width=160).print(table)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs/gpu-small.yaml")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), required=True, help="model.device of every stage"
    )
    parser.add_argument(
        "--workdir", type=Path, required=True, help="outputs and logs (reused when run again)"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, repeatable (CPU mode shrinks the model and the runs with these)",
    )
    parser.add_argument("--result", type=Path, default=None, help="write this step's JSON object here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from alignflow.config import load_config
    from alignflow.manifest import code_version
    from alignflow.offline import set_offline_defaults

    set_offline_defaults()
    # One code version for the whole run: on a checkout others edit meanwhile, the GRPO run must still find
    # the PPO run's upstream outputs (their URIs digest the code version).
    os.environ.setdefault("ALIGNFLOW_CODE_VERSION", code_version())
    started = time.perf_counter()
    base = [
        f"workdir={args.workdir.resolve()}",
        "tracking.enabled=false",
        f"model.device={args.device}",
        f"stages=[{','.join(PIPELINE)}]",
        *args.overrides,
    ]
    rows = run_stages(load_config(args.config, base))
    if rows and all(r["status"] != "failed" for r in rows):
        ppo = load_config(args.config, base).ppo
        grpo_overrides = [
            "ppo.algorithm=grpo",
            f"ppo.group_size={GROUP_SIZE}",
            f"ppo.prompts_per_iteration={max(1, ppo.prompts_per_iteration // GROUP_SIZE)}",
        ]
        grpo = run_stages(
            load_config(args.config, base + grpo_overrides),  # upstream reused: its RL and eval run
            rename={"ppo": "ppo (grpo)", "evaluate": "evaluate (grpo)"},
        )
        rows += [r for r in grpo if r["key"].endswith("(grpo)") or r["status"] == "failed"]
    print_table(rows, args.device)

    failed = [r["key"] for r in rows if r["status"] == "failed"]
    ran = {r["key"] for r in rows}
    missing = [
        k
        for k in ("data", "base", "sft", "engine", "ppo", "evaluate", "ppo (grpo)", "evaluate (grpo)")
        if k not in ran
    ] + ([] if any(k.startswith("reward") for k in ran) else ["reward"])
    on_cpu = cpu_roles(rows) if args.device == "cuda" else []
    gains = {
        "ppo": gold_gain(next((r for r in rows if r["key"] == "evaluate"), {})),
        "grpo": gold_gain(next((r for r in rows if r["key"] == "evaluate (grpo)"), {})),
    }
    for name, gain in gains.items():
        if gain is not None:
            se = gain.get("gold_delta_se")
            print(f"held-out gold gain, {name}: {gain['gold_delta']:+.4f}" + (f" ± {se:.4f}" if se else ""))
    problems = (
        ([f"stage(s) failed: {', '.join(failed)}"] if failed else [])
        + ([f"not run: {', '.join(missing)}"] if missing and not failed else [])
        + ([f"computed on cpu under --device cuda: {'; '.join(on_cpu)}"] if on_cpu else [])
    )
    recorded = "devices" in (rows[0] if rows else {})
    status = "fail" if problems else "pass"
    if problems:
        summary = "; ".join(problems)
    elif any(gains.values()):
        summary = "held-out gold gain: " + ", ".join(
            f"{name} {gain['gold_delta']:+.3f}"
            + (f" ± {se:.3f}" if (se := gain.get("gold_delta_se")) else "")
            for name, gain in gains.items()
            if gain
        )
    else:
        summary = "ok (no gold scorer)"
    silent = [
        r["key"]
        for r in rows
        if r["status"] == "ok" and not r.get("devices") and r["key"].split(" ")[0].split("-")[0] in COMPUTING
    ]
    if not recorded:
        summary += " (stages record no devices: StageResult has no 'devices' field here)"
    elif silent:
        summary += f" (no devices recorded by: {', '.join(silent)})"
    figures = {
        "step": "pipeline",
        "status": status,
        "summary": summary,
        "seconds": round(time.perf_counter() - started, 1),
        "figures": {
            "stages": {
                r["key"]: {
                    "status": r["status"],
                    "seconds": r["duration_s"],
                    "devices": r.get("devices") or {},
                }
                for r in rows
            },
            "gold_gain": gains,
            "on_cpu": on_cpu,
            "devices_recorded": recorded,
        },
    }
    print(f"pipeline: {status}: {summary}")
    if args.result is not None:
        args.result.write_text(json.dumps(figures))
    return 0 if status == "pass" else 1


if __name__ == "__main__":
    raise SystemExit(main())
