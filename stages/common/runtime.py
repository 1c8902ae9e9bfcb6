"""What every stage's `main` shares: spec loading, verified inputs, publishing, tracking, the result line.

A stage module provides `run(spec) -> StageResult` (pure: no argument parsing, no exit) and
`main(argv) -> int = stage_main("name", run, argv)`. Nothing here knows any stage's ML.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import gc
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

from alignflow import console
from alignflow.config import ConfigError
from alignflow.contract import (
    LAUNCHED_AT_VAR,
    REUSED_MESSAGE,
    StageResult,
    StageSpec,
    TrackingAccessError,
    TrackingUnavailableError,
    stage_program,
)
from alignflow.manifest import InputRef, Manifest, find_published, materialize, publish
from alignflow.offline import set_offline_defaults
from alignflow.process_exit import end_process
from alignflow.stages.common import forking, ranks
from alignflow.stages.common.devices import DeviceUnavailableError, compute_device, device_name, device_of
from alignflow.stages.common.generation.interface import BackendUnavailableError
from alignflow.stages.common.host_memory import keep_freed_memory
from alignflow.stages.common.models.loading import ModelDirError
from alignflow.stages.common.profiler import Profiler
from alignflow.stages.data.formats import DataError
from alignflow.storage import StorageError, TransientStorageError, open_store, storage_retries


class StageInputError(ValueError):
    """Bad input to a stage (data, spec, checkpoint): not retried; the message says how to fix it."""


# Errors that mean "the input is wrong": exit code 2, one-line reason, never retried.
# BackendUnavailableError: an engine backend whose package or device is missing here (the config asks for the
# wrong image or interpreter; a retry cannot help).
# DeviceUnavailableError: model.device asks for a GPU this machine does not have.
# ModelDirError: a model folder that is not one, or whose weights would be unpickled (PickleRefusedError).
BAD_INPUT_ERRORS: tuple[type[BaseException], ...] = (StageInputError, ConfigError, StorageError, DataError,
                                                      BackendUnavailableError, DeviceUnavailableError,
                                                      ModelDirError, TrackingAccessError)


def load_spec(path_or_uri: str) -> StageSpec:
    """Read a spec from a local path or an object-store URI."""
    try:
        if "://" in path_or_uri and not path_or_uri.startswith("file://"):
            raw = open_store(path_or_uri).get_bytes(path_or_uri)
        else:
            raw = Path(path_or_uri.removeprefix("file://")).read_bytes()
    except FileNotFoundError:
        raise StageInputError(f"spec '{path_or_uri}' not found") from None
    try:
        return StageSpec.model_validate_json(raw)
    except ValueError as exc:
        raise StageInputError(f"spec '{path_or_uri}' is invalid: {exc}") from None


def seconds_since(variable: str) -> float | None:
    """Seconds since the wall-clock time in environment variable `variable`
    (None when unset or unreadable)."""
    try:
        return max(time.time() - float(os.environ[variable]), 0.0)
    except (KeyError, ValueError):
        return None


class StageContext:
    """One stage run: verified local inputs, a scratch output folder, tracking, and publishing."""

    def __init__(self, spec: StageSpec):
        self.spec = spec
        self.workdir = Path(spec.workdir).resolve()
        self.cache_dir = self.workdir / ".alignflow" / "cache"
        self.started = time.perf_counter()
        self._inputs: dict[str, tuple[Path, Manifest]] = {}
        self.tracker = None  # alignflow.tracking.StageRun when tracking is enabled
        # Where each role's model computed (record_device), published in the summary and the StageResult.
        self.devices: dict[str, str] = {}
        # Every stage is profiled: stages time their phases with `ctx.profiler.phase(name)`;
        # publish_output adds profile.md to the output and the totals to MLflow.
        self.profiler = Profiler(spec.stage).start()
        # Interpreter start and imports, from the flow's launch to here (0 in a warm process that had them
        # done already); None when the stage was not launched by the flow.
        self.process_start_s = seconds_since(LAUNCHED_AT_VAR)
        if self.process_start_s is not None:
            self.profiler.record_before_start("process_start", self.process_start_s)

    def compute_device(self):
        """The torch device this rank computes on: the spec's `model.device` (auto | cpu | cuda), resolved."""
        return compute_device(str((self.spec.config.get("model") or {}).get("device", "auto")))

    def record_device(self, role: str, where) -> None:
        """Record where `role` (train, reference, score, generate, ...) computed: a device, a device name, or
        a model, whose first parameter's device is taken (where it really is, not where it was asked to
        be)."""
        if hasattr(where, "parameters") or hasattr(where, "module"):
            where = device_of(where)
        self.devices[role] = device_name(where)

    def input(self, name: str) -> Path:
        """A verified local folder of input `name` (downloaded once for s3://, in place for file://)."""
        if name not in self._inputs:
            uri = self.spec.inputs.get(name)
            if uri is None:
                raise StageInputError(
                    f"stage '{self.spec.stage}' needs input '{name}'; spec has "
                    f"{sorted(self.spec.inputs) or 'none'}"
                )
            self._inputs[name] = materialize(uri, self.cache_dir, self.spec.storage)
        return self._inputs[name][0]

    def input_manifest(self, name: str) -> Manifest:
        self.input(name)
        return self._inputs[name][1]

    @contextlib.contextmanager
    def output_dir(self) -> Iterator[Path]:
        """A fresh folder to write outputs into; for file:// outputs it is the final folder itself.

        Writing in place means a checkpoint is never copied on disk; the manifest, written last by
        `publish_output`, is what makes it visible. Leftovers of a crashed run (no manifest) are cleared.
        Ranks other than 0 get a scratch folder: only rank 0 writes the output.
        """
        store = open_store(self.spec.output_uri, self.spec.storage)
        local = store.local_path(self.spec.output_uri) if ranks.is_main() else None
        if local is not None:
            shutil.rmtree(local, ignore_errors=True)
            local.mkdir(parents=True)
            yield local
            return
        scratch = Path(tempfile.mkdtemp(prefix=f"{self.spec.stage}-", dir=self._scratch_root()))
        try:
            yield scratch
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _scratch_root(self) -> Path:
        root = self.workdir / ".alignflow" / "scratch"
        root.mkdir(parents=True, exist_ok=True)
        return root

    def publish_output(self, folder: Path, summary: dict[str, Any] | None = None) -> Manifest:
        """Publish `folder` to the spec's output URI (manifest last) and log the manifest to MLflow.

        Adds the stage's profile (profile.md) to the folder first and logs its totals as metrics.
        """
        if not ranks.is_main():
            raise RuntimeError(
                f"rank {ranks.rank()} tried to publish; only rank 0 publishes (use rank_result)"
            )
        self.profiler.stop()
        self.profiler.write_report(folder / "profile.md")
        if self.tracker is not None:
            # every queued step is in the run before the output pointing at it is published
            self.tracker.flush()
            self.tracker.log_metrics(self.profiler.summary())
            self.tracker.log_artifact(folder / "profile.md", "reports")
        inputs = {
            name: InputRef(uri=uri, digest=self.spec.input_digests.get(name, ""))
            for name, uri in self.spec.inputs.items()
        }
        if self.devices:
            summary = {**(summary or {}), "devices": dict(self.devices)}
            if self.tracker is not None:
                self.tracker.set_tags(
                    {f"alignflow.device.{role}": name for role, name in self.devices.items()}
                )
        manifest = publish(
            folder,
            self.spec.output_uri,
            stage=self.spec.stage,
            config=self.spec.config,
            inputs=inputs,
            version=self.spec.code_version,
            summary=summary,
            storage=self.spec.storage,
        )
        if self.tracker is not None:
            self.tracker.log_metrics(self.storage_metrics())
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "manifest.json"
                path.write_text(manifest.model_dump_json(indent=2))
                self.tracker.log_artifact(path, "output")
            self.tracker.set_tags(
                {"alignflow.output_uri": manifest.uri, "alignflow.output_digest": manifest.digest}
            )
        return manifest

    @staticmethod
    def storage_metrics() -> dict[str, float]:
        """`storage/retries`: object-store calls this process retried (transient S3 faults it survived)."""
        return {"storage/retries": float(sum(storage_retries().values()))}

    def result(
        self, manifest: Manifest, metrics: dict[str, float], key_metric: str | None, message: str = ""
    ) -> StageResult:
        # The GPU's peak memory (profiler: per phase and in all, allocated and reserved) where the stage used
        # one.
        peaks = {k: v for k, v in self.profiler.summary().items() if k.startswith("perf/peak_gpu")}
        return StageResult(
            stage=self.spec.stage,
            status="ok",
            output_uri=manifest.uri,
            manifest_digest=manifest.digest,
            metrics={**metrics, **peaks, **self.storage_metrics()},
            key_metric=key_metric,
            mlflow_run_id=self.tracker.run_id if self.tracker else None,
            duration_s=round(time.perf_counter() - self.started, 3),
            message=message,
            devices=dict(self.devices),
        )

    def rank_result(self, metrics: dict[str, float]) -> StageResult:
        """What a rank other than 0 reports once its share is done
        (rank 0 publishes and reports the output)."""
        return StageResult(
            stage=self.spec.stage,
            status="ok",
            metrics=metrics,
            duration_s=round(time.perf_counter() - self.started, 3),
            message=f"rank {ranks.rank()} of {ranks.world_size()}",
        )


@contextlib.contextmanager
def tracked(ctx: StageContext, run_name: str | None = None) -> Iterator[StageContext]:
    """Open the stage's nested MLflow run (when tracking is on) and log the resolved config as params.

    Every attempt gets a fresh run; earlier unfinished attempts at the same output (a killed or failed try
    that this one retries or resumes) are marked superseded by it (alignflow/tracking.py). Metrics queued
    with `ctx.tracker.log_metrics_async` are flushed before the run ends, on every exit path.
    """
    tracking = ctx.spec.tracking
    if tracking is None or not tracking.enabled or not ranks.is_main():  # rank 0 tracks for all ranks
        yield ctx
        return
    from alignflow import tracking as mlflow_tracking

    tags = {**tracking.tags, "alignflow.code_version": ctx.spec.code_version}
    with mlflow_tracking.stage_run(
        tracking.uri,
        tracking.experiment,
        ctx.spec.stage,
        tracking.parent_run_id,
        tags=tags,
        run_name=run_name,
        attempt_of=ctx.spec.output_uri,
    ) as run:
        ctx.tracker = run
        run.log_params(ctx.spec.config)
        run.log_params({f"input.{k}": v for k, v in ctx.spec.inputs.items()})
        try:
            yield ctx
        finally:
            ctx.tracker = None


def already_published(spec: StageSpec) -> StageResult | None:
    """A 'skipped' result when the output at the spec's URI is already complete."""
    manifest = find_published(spec.output_uri, spec.storage)
    if manifest is None:
        return None
    return StageResult.from_manifest(manifest, "skipped", message=REUSED_MESSAGE)


def run_program(main: Callable[[], int | None]) -> NoReturn:
    """A stage program's `if __name__ == "__main__":` block: main(), its exit code the process's, with the
    garbage collector kept off the objects the imports made, and no interpreter tear-down at exit.

    Why: torch, transformers and MLflow leave ~400K tracked objects behind their imports, and every full
    collection walks them all again: ~0.25 s of the RL stage's setup on a 2-core EPYC. So they are frozen
    (gc.freeze: no later collection looks at them) once the imports are done; the exit skips the tear-down
    (alignflow/process_exit.py: ~0.9 s of the stage process's ~1.1 s exit). For program entry points only: a
    process that goes on running (a test calling main) keeps collecting as usual. The collector is on from
    here (`python -m alignflow.stages` imports the program with it off). Nothing has computed yet, so the
    process is marked as one a torch worker may still be forked from (stages/common/forking.py)."""
    gc.freeze()
    gc.enable()
    forking.mark_clean()
    end_process(main())


def stage_main(stage: str, run: Callable[[StageSpec], StageResult], argv: list[str] | None = None,
               rollout_node: Callable[[StageSpec, int], int] | None = None) -> int:
    """Parse `--spec`, call `run`, print the StageResult JSON last; exit 2 on bad input, 1 on a crash.

    `rollout_node` (the RL stage): what `--rollout-node I` runs instead of the stage, on a node that holds
    only rollout replicas; it returns the exit code and prints no result line (rank 0's node reports)."""
    set_offline_defaults()
    keep_freed_memory()  # before the stage allocates: its steps reuse warm pages (host_memory.py)
    console.quiet()  # other libraries' noise off unless ALIGNFLOW_VERBOSE (alignflow run --verbose)
    parser = argparse.ArgumentParser(
        prog=f"python -m {stage_program(stage)}", description=f"alignflow '{stage}' stage"
    )
    parser.add_argument("--spec", required=True, help="Path or URI of the stage spec (JSON).")
    parser.add_argument(
        "--force", action="store_true", help="Re-run even if the output is already published."
    )
    if rollout_node is not None:
        parser.add_argument(
            "--rollout-node", type=int, metavar="I",
            help="Run this node's share of the rollout replicas (node I of engine.rollout_nodes) for the "
            "trainer at engine.rollout_endpoint, instead of the stage.",
        )
    args = parser.parse_args(argv)
    if getattr(args, "rollout_node", None) is not None:
        return _serve_rollout_node(stage, args.spec, args.rollout_node, rollout_node)
    started = time.perf_counter()
    if ranks.launched():
        ranks.die_with_launcher()
    spec = None
    try:
        spec = load_spec(args.spec)
        if spec.stage != stage:
            raise StageInputError(f"spec '{args.spec}' is for stage '{spec.stage}', not '{stage}'")
        result = None if args.force else already_published(spec)
        if result is None:
            resources = ranks.stage_resources(spec)
            if resources.world_size > 1 and not ranks.launched():
                code, failure = ranks.launch(
                    spec, stage_program(stage), sys.argv[1:] if argv is None else list(argv), resources
                )
                if failure is not None:
                    print(f"error: {stage}: {failure}", file=sys.stderr, flush=True)
                    _print_failure(stage, failure, started, code)
                return code
            result = run(spec)
    except (
        TransientStorageError,
        TrackingUnavailableError,
    ) as exc:  # a service's passing fault: exit 1, retried
        print(f"error: {stage}: {exc}", file=sys.stderr, flush=True)
        _print_failure(stage, str(exc), started, 1)
        return 1
    except BAD_INPUT_ERRORS as exc:
        print(f"error: {stage}: {exc}", file=sys.stderr, flush=True)
        _print_failure(stage, str(exc), started, 2)
        return 2
    except KeyboardInterrupt:
        print(f"error: {stage}: interrupted", file=sys.stderr, flush=True)
        _print_failure(stage, "interrupted", started, 130)
        return 130
    except Exception as exc:  # a crash: full traceback for the logs, one line in the result
        if _disk_full(exc):  # not a bug: say where, and what to do, without a traceback
            where = (spec.output_uri if spec is not None else None) or "the output folder"
            message = (
                f"no space left on device while writing {where} ({type(exc).__name__}: {exc}); "
                f"{_free_space(spec)}free space there or point storage.root (and workdir) at a larger disk; "
                "nothing was published"
            )
            print(f"error: {stage}: {message}", file=sys.stderr, flush=True)
            _print_failure(stage, message, started, 1)
            return 1
        lost = ranks.lost_peer(exc)  # a peer node or rank died mid-collective: name it, not gloo's socket
        if lost is not None:
            print(f"error: {stage}: {lost}", file=sys.stderr, flush=True)
            _print_failure(stage, lost, started, 1)
            return 1
        traceback.print_exc()
        _print_failure(stage, f"{type(exc).__name__}: {exc}", started, 1)
        return 1
    sys.stdout.flush()
    _report(result.to_line(), 0)
    return 0


def _serve_rollout_node(stage: str, spec_path: str, node: int,
                        serve: Callable[[StageSpec, int], int]) -> int:
    """A rollout node's command: its errors as one line on stderr (exit 2: bad input; 1: anything else)."""
    try:
        spec = load_spec(spec_path)
        return serve(spec, node)
    except BAD_INPUT_ERRORS as exc:
        print(f"error: {stage}: rollout node {node}: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # noqa: BLE001 - the traceback for the logs, one line to read first
        traceback.print_exc()
        print(f"error: {stage}: rollout node {node}: {type(exc).__name__}: {exc}", file=sys.stderr,
              flush=True)
        return 1


def _disk_full(exc: BaseException) -> bool:
    """ENOSPC, raised as OSError or wrapped by a writer (safetensors: "IoError(... StorageFull ...)")."""
    while exc is not None:
        if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or "No space left on device" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _free_space(spec: StageSpec | None) -> str:
    """ "N bytes free in <dir>; " for the disk the output is written on (s3:// outputs:
    the workdir's scratch)."""
    if spec is None:
        return ""
    local = open_store(spec.output_uri, spec.storage).local_path(spec.output_uri) or Path(spec.workdir)
    folder = next((p for p in [local, *local.parents] if p.exists()), None)
    return f"{shutil.disk_usage(folder).free} bytes free in {folder}; " if folder is not None else ""


def _report(line: str, code: int) -> None:
    """The result line: on stdout from rank 0 (the only rank the flow hears),
    to the launcher from every rank."""
    ranks.write_rank_result(code, line)
    if ranks.is_main():
        print(line, flush=True)


def _print_failure(stage: str, message: str, started: float, code: int) -> None:
    failed = StageResult(
        stage=stage,
        status="failed",
        message=message.splitlines()[0] if message else "",
        duration_s=round(time.perf_counter() - started, 3),
    )
    _report(failed.to_line(), code)


def section(spec: StageSpec, model_cls: type, key: str | None = None) -> Any:
    """Validate the stage's config section (or `spec.config[key]`) into its pydantic model."""
    raw = spec.config if key is None else spec.config.get(key)
    if raw is None:
        raise StageInputError(f"spec for stage '{spec.stage}' has no config section '{key}'")
    try:
        return model_cls.model_validate(raw)
    except ValueError as exc:
        raise ConfigError(f"spec for stage '{spec.stage}': {exc}") from None


def dump_json(obj: Any, path: Path) -> Path:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str))
    return path
