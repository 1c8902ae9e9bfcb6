"""The `alignflow` command line: run a pipeline config, validate it, print its plan.

    alignflow run configs/tiny.yaml --set sft.lr=1e-4 --set storage.root=s3://bucket/prefix
    alignflow validate configs/tiny.yaml
    alignflow plan configs/tiny.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from alignflow.config import ConfigError, PipelineConfig, load_config
from alignflow.offline import set_offline_defaults


def _load(args) -> PipelineConfig:
    return load_config(args.config, args.set)


def _cmd_validate(args) -> int:
    config = _load(args)
    print(json.dumps(config.model_dump(mode="json"), indent=2))
    print(f"{args.config}: valid", file=sys.stderr)
    return 0


def _cmd_plan(args) -> int:
    from alignflow.flows.plan import plan

    for call in plan(_load(args)):
        reads = ", ".join(f"{name}<-{up}" for name, up in call.inputs.items()) or "-"
        print(f"{call.key:<14} stage={call.stage:<9} inputs: {reads}")
    return 0


def _cmd_run(args) -> int:
    config = _load(args)
    from alignflow.flows.pipeline import alignflow_pipeline
    from alignflow.flows.report import print_summary

    started = time.perf_counter()
    try:
        rows = alignflow_pipeline(config)
    except Exception as exc:  # the flow already logged the stage's output; say it in one line
        print(f"error: pipeline failed: {exc}", file=sys.stderr)
        return 1
    print_summary(config, rows, time.perf_counter() - started)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignflow", description="RLHF pipeline: SFT -> reward -> engine -> PPO -> eval")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (("run", _cmd_run, "run the pipeline (Prefect flow, stages as processes)"),
                               ("validate", _cmd_validate, "validate a config and print it resolved"),
                               ("plan", _cmd_plan, "print the stage calls a config makes")):
        cmd = sub.add_parser(name, help=helptext)
        cmd.add_argument("config", type=Path, help="pipeline YAML, e.g. configs/tiny.yaml")
        cmd.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                         help="override a config value, e.g. --set sft.lr=1e-4 (repeatable)")
        cmd.set_defaults(fn=fn)
    return parser


def main(argv: list[str] | None = None) -> int:
    set_offline_defaults()
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
