"""The `alignflow` command line: run a pipeline config, validate it, print its plan or a stage's k8s Job.

    alignflow run configs/tiny.yaml --set sft.lr=1e-4 --set storage.root=s3://bucket/prefix
    alignflow validate configs/tiny.yaml
    alignflow plan configs/tiny.yaml
    alignflow deploy configs/tiny.yaml        # register the deployment with PREFECT_API_URL's server
    alignflow k8s-job configs/llama3-8b-gpu.yaml --stage ppo --set ppo.resources.nnodes=2 \
        --set ppo.resources.rdzv_endpoint=alignflow-rl-0.alignflow-rl-rdzv:29400 | kubectl create -f -
    alignflow ui                              # local Prefect server + MLflow UI on 127.0.0.1
"""

from __future__ import annotations

import time

# When this command started, taken before any other import so that only the interpreter's own start precedes
# it (psutil's process creation time is read against a whole-second boot time on Linux, so it is up to 1 s
# off).
STARTED_AT = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NoReturn  # noqa: E402

from alignflow import console  # noqa: E402
from alignflow.config import ConfigError, PipelineConfig, load_config  # noqa: E402
from alignflow.contract import RUN_STARTED_AT_VAR  # noqa: E402
from alignflow.import_gc import imports_without_gc  # noqa: E402
from alignflow.offline import set_offline_defaults  # noqa: E402
from alignflow.process_exit import end_process  # noqa: E402


def _load(args) -> PipelineConfig:
    return load_config(args.config, args.set)


def _check_data(config: PipelineConfig) -> bool:
    """Check the config's local data files (stages/data/preflight.py); print the problems; False when bad."""
    from alignflow.stages.data.formats import DataError
    from alignflow.stages.data.preflight import check_data

    try:
        report = check_data(config.data, Path(config.workdir).resolve())
    except DataError as exc:
        print(f"error: {len(exc.errors)} data error(s):", file=sys.stderr)
        for line in exc.errors:
            print(f"  - {line}", file=sys.stderr)
        return False
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    if config.data.source == "files":
        print(report.summary(), file=sys.stderr)
    return True


def _check_start(config: PipelineConfig, source: Path, machine: str = "note") -> bool:
    """Make every stage's start checks (alignflow/start_checks.py) and print the problems, all together, each
    with its stage and key. What the stages need of their machine that this one lacks is printed per
    `machine`: 'note' (validate, plan: the stages may run elsewhere), 'warning' (run: they run here, but the
    GPU count is read from the driver, not torch) or 'error' (--here). False when a stage would refuse to
    start."""
    from alignflow.flows.plan import machine_findings, start_problems

    problems = [f"{p.stage} [{p.key}]: {p.message}" for p in start_problems(config)]
    unmet, elsewhere = machine_findings(config, probe=machine == "error")
    grouped: dict[tuple[str, str], list[str]] = {}
    for finding in unmet:
        grouped.setdefault((finding.key, finding.message), []).append(finding.stage)
    needs = [f"{', '.join(stages)} [{key}]: {message}" for (key, message), stages in grouped.items()]
    if machine == "error":
        problems += needs
        if elsewhere:
            print(
                f"note: {', '.join(elsewhere)} run as their own deployments (deployment.stage_infra): their "
                "machine is not this one and was not checked",
                file=sys.stderr,
            )
    else:
        where = (
            "where the stage runs; pass --here when that is this machine"
            if machine == "note"
            else "the stage checks it again when it starts"
        )
        for line in needs:
            print(f"{machine}: {line} ({where})", file=sys.stderr)
    if problems:
        print(
            f"error: {source}: {len(problems)} stage start problem(s), as the stages would report them:",
            file=sys.stderr,
        )
        for line in problems:
            print(f"  - {line}", file=sys.stderr)
    return not problems


def _cmd_validate(args) -> int:
    config = _load(args)
    print(json.dumps(config.model_dump(mode="json"), indent=2))
    data_ok = _check_data(config)
    if not (_check_start(config, args.config, "error" if args.here else "note") and data_ok):
        return 2
    print(f"{args.config}: valid", file=sys.stderr)
    return 0


def _cmd_plan(args) -> int:
    from alignflow.flows.plan import plan

    config = _load(args)
    for call in plan(config):
        reads = ", ".join(f"{name}<-{up}" for name, up in call.inputs.items()) or "-"
        print(f"{call.key:<14} stage={call.stage:<9} inputs: {reads}")
    return 0 if _check_start(config, args.config, "error" if args.here else "note") else 2


@contextlib.contextmanager
def run_clock(started_at: float) -> Iterator[None]:
    """RUN_STARTED_AT_VAR set to this run's start while it runs, for the stage processes it starts (they
    report their start-up against it: startup/since_run), and as it was before once it ends: a later run in
    this process, or a command a run starts, never reads an earlier run's start."""
    before = os.environ.get(RUN_STARTED_AT_VAR)
    os.environ[RUN_STARTED_AT_VAR] = f"{started_at:.6f}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RUN_STARTED_AT_VAR, None)
        else:
            os.environ[RUN_STARTED_AT_VAR] = before


def _cmd_run(args) -> int:
    with run_clock(args.started_at):
        return _run(args)


def _run(args) -> int:
    config = _load(args)
    # Before Prefect's server and any stage process start, which take seconds (docs/performance.md#start-up),
    # so a bad input fails at once: the data files, and every stage's start checks.
    data_ok = _check_data(config)
    if not (_check_start(config, args.config, "warning") and data_ok):
        return 2
    from alignflow.flows.kept_server import KEEP_VAR, keep_seconds
    from alignflow.flows.launch import WARM
    from alignflow.flows.prefect_server import PrefectServer

    try:
        keep_seconds()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    # Start-up in parallel: a stage process imports torch, Prefect's server starts in its own process, and
    # this thread imports the flow; one after the other their times would add up
    # (docs/performance.md#start-up).
    workdir = Path(config.workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    WARM.start(workdir)
    server = PrefectServer()
    server.start()
    with imports_without_gc():  # Prefect's and MLflow's (alignflow/import_gc.py)
        from alignflow import tracking
        from alignflow.flows.pipeline import alignflow_pipeline
        from alignflow.flows.report import print_summary

        uri = tracking.resolve_tracking_uri(config.tracking, workdir)
        if not uri.startswith(("http:", "https:", "file:")):
            tracking.preload()  # the parent run's SQL store while the server starts: this thread would wait
    server.wait()
    if server.error is not None:
        print(f"warning: Prefect's server: {server.error}; Prefect starts its own", file=sys.stderr)
    elif server.kept is not None and server.api_url is not None and not server.reused:
        print(
            f"Prefect: started a local API server at {server.api_url}, kept for later runs until unused for "
            f"{keep_seconds():g} s ({KEEP_VAR}=0: one per run; its log: {server.kept.log_path})",
            file=sys.stderr,
        )

    started = time.perf_counter()
    try:
        with server.api_settings():
            rows = alignflow_pipeline(config)
    except Exception as exc:  # the flow already logged the stage's output; say it in one line
        print(f"error: pipeline failed: {exc}", file=sys.stderr)
        return 1
    finally:
        WARM.close()
    print_summary(config, rows, time.perf_counter() - started)
    return 0


def _cmd_deploy(args) -> int:
    config = _load(args)
    from alignflow.flows.deploy import deploy

    for name, deployment_id in deploy(config).items():
        print(f"deployed {name} ({deployment_id})")
    schedules = [s.cron or f"every {s.interval_s} s" for s in config.deployment.schedules]
    print(
        f"schedules: {', '.join(schedules) or 'none'}; start a worker with: "
        f"prefect worker start --pool {config.deployment.work_pool}"
    )
    return 0


def _cmd_k8s_job(args) -> int:
    from alignflow.flows.k8s_jobs import (
        ROLLOUT_TEMPLATE,
        TEMPLATE,
        render_multinode_job,
        to_yaml,
        write_manifests,
    )

    config = _load(args)
    objects = render_multinode_job(
        config,
        args.stage,
        spec_uri=args.spec_uri,
        image=args.image,
        host_network=args.host_network,
        socket_ifname=args.socket_ifname,
        template=args.template or TEMPLATE,
        rollout_template=args.rollout_template or ROLLOUT_TEMPLATE,
    )
    if args.output is None:
        sys.stdout.write(to_yaml(objects))
        return 0
    paths = write_manifests(objects, args.output)
    for path in paths:
        print(f"wrote {path}")
    print("create them with (the trainer's first):")
    print("kubectl create " + " ".join(f"-f {path}" for path in paths))
    return 0


def _cmd_ui(args) -> int:
    from alignflow.ui import serve

    return serve(args.workdir, args.prefect_port, args.mlflow_port)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="alignflow", description="RLHF pipeline: SFT -> reward -> engine -> PPO -> eval"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, fn, helptext in (
        ("run", _cmd_run, "run the pipeline (Prefect flow, stages as processes)"),
        ("validate", _cmd_validate, "validate a config and print it resolved"),
        ("plan", _cmd_plan, "print the stage calls a config makes"),
        ("deploy", _cmd_deploy, "register the pipeline deployment with a Prefect server"),
        ("k8s-job", _cmd_k8s_job, "print a training stage's multi-node Kubernetes Job (Indexed Job + "
         "headless Service; the RL stage's rollout nodes' Job too) as YAML"),
    ):
        cmd = sub.add_parser(name, help=helptext)
        cmd.add_argument("config", type=Path, help="pipeline YAML, e.g. configs/tiny.yaml")
        cmd.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value, e.g. --set sft.lr=1e-4 (repeatable)",
        )
        cmd.add_argument(
            "--verbose",
            action="store_true",
            help="show other libraries' logs, warnings and progress bars too (in the stages as well: "
            f"sets {console.VERBOSE_VAR}=1)",
        )
        if name in ("validate", "plan"):
            cmd.add_argument(
                "--here",
                action="store_true",
                help="the stages run on this machine (as `alignflow run` runs them): what they need of "
                "it (a GPU for model.device cuda, the engine backend's package, in "
                "engine.worker_python too: started to look) are problems, not notes",
            )
        if name == "k8s-job":
            cmd.add_argument(
                "--stage",
                required=True,
                choices=("sft", "reward", "dpo", "ppo"),
                help="the stage; its resources.nnodes (>= 2, or 1 for ppo with engine.rollout_nodes) "
                "and rdzv_endpoint (pod 0: <Job name>-0.<Service name>:<port>) shape the Job",
            )
            cmd.add_argument(
                "--spec-uri",
                help="the stage spec the pods read (default: <storage.root>/specs/<stage>.json on S3)",
            )
            cmd.add_argument("--image", help="container image (default: the stage's, flows/k8s_jobs.py)")
            cmd.add_argument(
                "--host-network",
                action="store_true",
                help="pods on their node's network, for a fast fabric the pod network does not reach "
                "(needs a namespace that allows it: docs/production.md)",
            )
            cmd.add_argument(
                "--socket-ifname",
                default="eth0",
                help="interface NCCL and gloo use (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME; default eth0, the "
                "pod's)",
            )
            cmd.add_argument(
                "--template",
                type=Path,
                help="the pod spec's template (default: infra/k8s/job-stage-training-multinode.yaml of this "
                "checkout)",
            )
            cmd.add_argument(
                "--rollout-template",
                type=Path,
                help="the rollout pods' template, for ppo with engine.rollout_nodes (default: "
                "infra/k8s/job-stage-rollout-nodes.yaml of this checkout)",
            )
            cmd.add_argument(
                "--output",
                type=Path,
                metavar="DIR",
                help="write one file per Job (<Job name>.yaml, its Service with it) to DIR and print "
                "the kubectl command that creates them, instead of printing the YAML",
            )
        cmd.set_defaults(fn=fn)
    ui = sub.add_parser(
        "ui", help="start a local Prefect server and MLflow UI on 127.0.0.1 and print their URLs"
    )
    ui.add_argument("--workdir", type=Path, default=Path("."), help="where mlflow.db lives (default: .)")
    ui.add_argument("--prefect-port", type=int, default=4200)
    ui.add_argument("--mlflow-port", type=int, default=5000)
    ui.set_defaults(fn=_cmd_ui)
    return parser


def main(argv: list[str] | None = None, started_at: float | None = None) -> int:
    """The command's body; started_at: when the command started (time.time()), default now."""
    args = build_parser().parse_args(argv)
    args.started_at = time.time() if started_at is None else started_at
    if getattr(args, "verbose", False):
        console.set_verbose()
    set_offline_defaults()
    console.quiet()  # before Prefect, MLflow or a stage process starts: they inherit the switches
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def entry() -> NoReturn:
    """The `alignflow` command (pyproject's script): main(), then the exit without the interpreter's
    tear-down (alignflow/process_exit.py)."""
    end_process(main(started_at=STARTED_AT))


if __name__ == "__main__":
    entry()
