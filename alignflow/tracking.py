"""MLflow tracking helpers; the only module that imports mlflow.

One parent run per pipeline run, one nested run per stage. Params are the flattened resolved
config; metrics are namespaced (`train/`, `eval/`, `rollout/`, `losses/`, `kl/`, `timing/`, `perf/`).

Artifacts: the object store is the one home of checkpoints and engines. A stage run logs each
output's manifest (file list, sizes, sha256, URI) and its small human-facing files (reports, plots,
configs) as MLflow artifacts, and tags the run with the output URI; the model registry points at
the object-store folder. Checkpoints are therefore never stored twice (see README, "Tracking").

Attempts: a stage that is retried or resumed (a killed RL stage continues from its last checkpoint) logs
each attempt into a fresh run. Every stage run is tagged `alignflow.attempt_key` (a digest of the output
URI it writes); opening one ends the unfinished runs of earlier attempts at the same output (RUNNING ->
KILLED: their process died without ending them; FAILED stays FAILED), renames them "<stage> (superseded)"
and tags them `alignflow.superseded_by`. The new run is the one the pipeline's stage table and the model
registry point at. Why not reopen the old run: MLflow cannot delete metric steps, and a killed RL
attempt may have logged iterations past its last checkpoint that the resumed attempt runs again with
other values; the resumed run instead starts with the checkpoint's history (`StageRun.log_history`).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlflow
from mlflow.data.dataset_source import DatasetSource
from mlflow.data.meta_dataset import MetaDataset
from mlflow.entities import DatasetInput, InputTag, Metric, Param
from mlflow.tracking import MlflowClient

from alignflow.config import TrackingConfig, flatten
from alignflow.contract import TrackingAccessError, TrackingUnavailableError
from alignflow.offline import set_offline_defaults

# MLflow caps a param value at 6000 characters (3.x); longer values are truncated with a marker.
_PARAM_MAX_CHARS = 6000
# log_batch accepts at most 1000 metrics per call.
_METRICS_PER_BATCH = 1000
# The metric sender's wait for an unreachable server: 15 min by default, past MLflow's own retries
# (RETRIES_VAR; a server restart or upgrade fits); a PPO iteration's ~45 metrics every 0.3 s is ~135k kept
# metrics, tens of MB.
OUTAGE_VAR = "ALIGNFLOW_TRACKING_OUTAGE_S"
_OUTAGE_DEFAULT_S = 900.0
_RETRY_FIRST_S, _RETRY_MAX_S = 1.0, 30.0
# MLflow's client retries an HTTP call itself: 7 retries at its default, backoff 0, 4, 8, ... capped at 120 s,
# about 4 min before a call to a server that is down fails. A stage's synchronous calls (opening its run,
# logging params, the output's manifest and tags at publish time) block the stage meanwhile, so in a process
# that uses this module the default is 5 retries: about 1 min (0 + 4 + 8 + 16 + 32 s, plus up to 1 s of jitter
# each), which still covers a server restart (tens of seconds). Past it the stage stops with one
# line and exit 1; its re-run reuses what was published (and the RL stage resumes from its checkpoint). A
# value the user exported is kept.
RETRIES_VAR = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"
_RETRIES_DEFAULT = 5
ATTEMPT_KEY_TAG = "alignflow.attempt_key"
SUPERSEDED_BY_TAG = "alignflow.superseded_by"
# The object-store folder a registered version stands for. It is also the version's `source`, except where an
# MLflow server refuses a local folder as a source (it only accepts local paths inside the run's artifact
# folder).
SOURCE_TAG = "alignflow.source"
# Where a run whose local folder the server refused gets its pointer artifact (`source.txt`).
REGISTERED_OUTPUT_PATH = "registered-output"


def resolve_tracking_uri(config: TrackingConfig, workdir: str | Path) -> str:
    """The configured URI, or a SQLite file in the working dir (no server needed).

    MLFLOW_TRACKING_URI is deliberately not a fallback: mlflow.set_tracking_uri exports it into the
    process environment, so a second pipeline in the same process would log into the first one's store.
    """
    if config.uri:
        return config.uri
    return f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


def preload() -> None:
    """Import MLflow's SQL tracking store now, which MLflow otherwise imports on a client's first call: a warm
    stage process (alignflow.stages.common.warm) pays that second of start-up before it has a stage to run
    (docs/performance.md#start-up)."""
    import mlflow.store.tracking.sqlalchemy_store  # noqa: F401


def _mlflow(uri: str):
    set_offline_defaults()
    os.environ.setdefault(RETRIES_VAR, str(_RETRIES_DEFAULT))  # read by MLflow at each call (see RETRIES_VAR)
    mlflow.set_tracking_uri(uri)
    return mlflow


@contextlib.contextmanager
def reaching(uri: str, what: str) -> Iterator[None]:
    """Turn a synchronous call's "the tracking server did not answer" (after MLflow's own retries) into a
    one-line TrackingUnavailableError that names the server and what to do, and a refusal (401, 403) into a
    TrackingAccessError that names the credentials to set; other errors pass through unchanged.

    Why fail and not buffer, as the metric sender does: these calls either need the server's answer (a run
    id), or record the output the stage publishes; a stage that reported success while its run missed them
    would leave the pipeline's stage table and the registry without it. Stages are idempotent, so exit 1 and a
    re-run (the flow's task retry) lose at most the work since the last checkpoint. Only an HTTP server is a
    server: with a local store (sqlite, a folder) an OSError is the disk's, and is raised as it is."""
    try:
        yield
    except (TrackingUnavailableError, TrackingAccessError):
        raise
    except Exception as exc:
        on_server = uri.startswith(("http://", "https://"))
        status = refused_status(exc) if on_server else None
        if status is not None:
            user = os.environ.get("MLFLOW_TRACKING_USERNAME")
            who = f"user '{user}'" if user else "a client without credentials (no MLFLOW_TRACKING_USERNAME)"
            fix = (
                "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD to the pipeline user's"
                " (infra/.env: ALIGNFLOW_MLFLOW_PIPELINE_*)"
                if status == 401
                else "run the pipeline as the pipeline user, which may create and write (a viewer only reads)"
            )
            raise TrackingAccessError(
                f"MLflow tracking server {uri} answered {status} to {who} while {what}; {fix}", status
            ) from None
        if not (on_server and server_unreachable(exc)):
            raise
        retries = os.environ.get(RETRIES_VAR, str(_RETRIES_DEFAULT))
        raise TrackingUnavailableError(
            f"MLflow tracking server {uri} unreachable while {what} ({_first_line(exc)}, after {retries} "
            f"retries, {RETRIES_VAR}); start the server (or fix tracking.uri), then re-run: published "
            "outputs are reused and the RL stage resumes from its last checkpoint"
        ) from None


def _ensure_experiment(mlflow, name: str) -> str:
    experiment = mlflow.get_experiment_by_name(name)
    if experiment is None:
        return mlflow.create_experiment(name)
    return experiment.experiment_id


def start_parent_run(
    uri: str, experiment: str, run_name: str, params: dict[str, Any], tags: dict[str, str]
) -> str:
    """Create the pipeline's parent run (left open for the flow's lifetime) and return its id."""
    mlflow = _mlflow(uri)
    with reaching(uri, "creating the pipeline's run"):
        experiment_id = _ensure_experiment(mlflow, experiment)
        client = MlflowClient(uri)
        run = client.create_run(experiment_id, run_name=run_name, tags={"alignflow.kind": "pipeline", **tags})
        _log_params(client, run.info.run_id, params)
    return run.info.run_id


def end_run(uri: str, run_id: str, status: str = "FINISHED") -> None:
    _mlflow(uri)
    with reaching(uri, f"ending run {run_id}"):
        MlflowClient(uri).set_terminated(run_id, status=status)


def _log_params(client, run_id: str, params: dict[str, Any]) -> None:
    flat = flatten(params) if any(isinstance(v, dict) for v in params.values()) else params
    items = [Param(k, _param_text(v)) for k, v in flat.items()]
    for start in range(0, len(items), 100):  # log_batch accepts at most 100 params per call
        client.log_batch(run_id, params=items[start : start + 100])


def _param_text(value: Any) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= _PARAM_MAX_CHARS else text[: _PARAM_MAX_CHARS - 12] + "...[truncated]"


class StageRun:
    """A stage's nested MLflow run: metrics, params, artifacts and dataset inputs."""

    def __init__(self, client, run_id: str, mlflow_module, uri: str = ""):
        self._client = client
        self._mlflow = mlflow_module
        self.run_id = run_id
        self._uri = uri
        self._sender: MetricSender | None = None

    def _reaching(self, what: str):
        return reaching(self._uri, f"{what} (run {self.run_id})")

    def log_params(self, params: dict[str, Any]) -> None:
        with self._reaching("logging params"):
            _log_params(self._client, self.run_id, params)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Log now, waiting for the store (for a handful of metrics outside a training loop)."""
        items = _metric_items(metrics, step or 0)
        with self._reaching("logging metrics"):
            for start in range(0, len(items), _METRICS_PER_BATCH):
                self._client.log_batch(self.run_id, metrics=items[start : start + _METRICS_PER_BATCH])

    def log_metrics_async(self, metrics: dict[str, float], step: int) -> None:
        """Queue metrics for the background sender and return at once (a training loop's per-step metrics)."""
        if self._sender is None:
            self._sender = MetricSender(self._client, self.run_id)
        self._sender.send(_metric_items(metrics, step))

    def log_history(self, history: list[dict[str, float]], step_key: str = "iteration") -> None:
        """Queue earlier steps, one dict per step numbered by its `step_key` value (which is not logged)."""
        for row in history:
            self.log_metrics_async({k: v for k, v in row.items() if k != step_key}, step=int(row[step_key]))

    def flush(self) -> None:
        """Wait until every queued metric is in the store; raises if the sender failed."""
        if self._sender is not None:
            self._sender.flush()

    def close(self) -> None:
        """Flush and stop the background sender."""
        sender, self._sender = self._sender, None
        if sender is not None:
            sender.close()

    def set_tags(self, tags: dict[str, str]) -> None:
        with self._reaching("setting tags"):
            for key, value in tags.items():
                self._client.set_tag(self.run_id, key, str(value))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        with self._reaching(f"logging artifact {path.name}"):
            self._client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, folder: Path, artifact_path: str | None = None) -> None:
        with self._reaching(f"logging artifacts of {folder}"):
            self._client.log_artifacts(self.run_id, str(folder), artifact_path)

    def log_dataset(self, name: str, source_uri: str, digest: str, context: str, n_records: int) -> None:
        """Record a dataset as a run input (name, source URI, digest) without copying its records."""
        dataset = MetaDataset(source=UriDatasetSource(source_uri), name=name, digest=digest[:36])
        tags = [
            InputTag(key="mlflow.data.context", value=context),
            InputTag(key="alignflow.records", value=str(n_records)),
        ]
        with self._reaching(f"logging dataset {name}"):
            self._client.log_inputs(
                self.run_id, datasets=[DatasetInput(dataset=dataset._to_mlflow_entity(), tags=tags)]
            )


def _metric_items(metrics: dict[str, float], step: int) -> list[Metric]:
    now = int(time.time() * 1000)
    return [Metric(k, float(v), now, step) for k, v in metrics.items()]


class MetricSender:
    """Logs metrics to one MLflow run from a background thread, in the order they were queued.

    Why a thread: a log_batch of an RL iteration's metrics is a round trip to the store, a sizeable share of
    a short iteration (configs/tiny.yaml's on a small machine's SQLite store), while queueing them costs a
    fraction of a millisecond. When the store is slower than the loop, whatever is queued meanwhile goes out
    in one call (up to 1000 metrics). A failure is raised by the next `send`,
    `flush` or `close`, as a synchronous log would have raised it, so a run never silently loses its curves.

    Server outages: MLflow's client retries a call itself (RETRIES_VAR: ~1 min). A batch that still
    fails because the server is unreachable (connection refused or cut, timeout, 5xx, 429) is kept, not
    dropped: the loop goes on queueing and the sender tries the kept batch again (1 s doubling to 30 s) until
    the server answers, then everything queued meanwhile, in order. Past `outage_s` of failing it gives up
    with a TrackingUnavailableError (one line; the stage exits 1 and its re-run resumes). A re-sent batch is
    never doubled in the run: its metrics keep the timestamps they were queued with, and MLflow's SQL store
    skips a metric whose (key, timestamp, step, value) is already in the run, as when a batch was stored but
    its reply lost.
    """

    def __init__(self, client, run_id: str, outage_s: float | None = None):
        self._client = client
        self._run_id = run_id
        self._outage_s = outage_limit_s() if outage_s is None else outage_s
        self._queue: queue.Queue[list[Metric] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._gave_up: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"mlflow-metrics-{run_id[:8]}", daemon=True)
        self._thread.start()

    def send(self, items: list[Metric]) -> None:
        self._raise_error()
        self._queue.put(items)

    def flush(self) -> None:
        self._queue.join()
        self._raise_error()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, TrackingUnavailableError):
                raise error
            raise RuntimeError(f"logging metrics to MLflow run {self._run_id} failed: {error!r}") from error

    def _run(self) -> None:
        stop = False
        while not stop:
            taken = [self._queue.get()]
            while True:  # everything queued meanwhile goes in the same calls
                try:
                    taken.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(batch is None for batch in taken)
            items = [item for batch in taken if batch is not None for item in batch]
            try:
                self._send_through_outages(items)
            except BaseException as exc:  # kept for the caller: a daemon thread's exception would go nowhere
                self._error = exc
            finally:
                for _ in taken:
                    self._queue.task_done()

    def _send_through_outages(self, items: list[Metric]) -> None:
        """log_batch `items` in order,
        waiting out an unreachable server for up to `outage_s` (class docstring)."""
        if self._gave_up is not None:  # once given up, fail at once: the stage is stopping, don't wait again
            raise TrackingUnavailableError(self._gave_up)
        sent, down_since, wait = 0, None, _RETRY_FIRST_S
        while sent < len(items):
            batch = items[sent : sent + _METRICS_PER_BATCH]
            try:
                self._client.log_batch(self._run_id, metrics=batch)
            except Exception as exc:
                if not server_unreachable(exc):
                    raise
                now = time.monotonic()
                if down_since is None:
                    down_since = now
                    _warn(
                        f"MLflow unreachable while logging run {self._run_id} ({_first_line(exc)}); the "
                        "stage goes on and its metrics are kept and sent when the server is back (giving up "
                        f"after {self._outage_s:.0f} s)"
                    )
                if now - down_since >= self._outage_s:
                    self._gave_up = (
                        f"MLflow unreachable for {now - down_since:.0f} s (limit {self._outage_s:.0f} s, "
                        f"{OUTAGE_VAR}) while logging run {self._run_id}: {_first_line(exc)}; start the "
                        "server again, then re-run: the stage resumes and its new run gets every step"
                    )
                    raise TrackingUnavailableError(self._gave_up) from None
                time.sleep(min(wait, max(self._outage_s - (now - down_since), 0.0)))
                wait = min(2 * wait, _RETRY_MAX_S)
                continue
            sent += len(batch)
        if down_since is not None:
            _warn(
                f"MLflow reachable again after {time.monotonic() - down_since:.0f} s; the metrics kept "
                f"meanwhile ({len(items)}) are in run {self._run_id}"
            )


def outage_limit_s() -> float:
    """How long the metric sender waits out an unreachable MLflow server:
    ALIGNFLOW_TRACKING_OUTAGE_S, or 900 s."""
    value = os.environ.get(OUTAGE_VAR, "")
    try:
        return float(value) if value else _OUTAGE_DEFAULT_S
    except ValueError:
        raise ValueError(
            f"{OUTAGE_VAR}='{value}' is not a number of seconds; unset it (default "
            f"{_OUTAGE_DEFAULT_S:.0f}) or set e.g. {OUTAGE_VAR}=600"
        ) from None


def server_unreachable(exc: BaseException) -> bool:
    """True when a tracking call failed because the server could not answer (worth trying again later): a
    network error anywhere in the chain (requests' errors are OSErrors), or an MLflow error with HTTP status
    5xx or 429. A 4xx (a bad value, a run no longer active) is the caller's fault and is raised."""
    error: BaseException | None = exc
    while error is not None:
        if isinstance(error, OSError):
            return True
        if isinstance(error, mlflow.exceptions.MlflowException):
            status = error.get_http_status_code()
            if status >= 500 or status == 429:
                return True
        error = error.__cause__ or error.__context__
    return False


def refused_status(exc: BaseException) -> int | None:
    """401 or 403 when a tracking call failed because the server refused the credentials or their rights."""
    error: BaseException | None = exc
    while error is not None:
        if isinstance(error, mlflow.exceptions.MlflowException):
            status = error.get_http_status_code()
            # The basic-auth app answers a plain-text 401; MLflow's client then reports it in its message.
            if status in (401, 403):
                return status
            for refused in (401, 403):
                if f"error code {refused} " in str(error):
                    return refused
        error = error.__cause__ or error.__context__
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class UriDatasetSource(DatasetSource):
    """A dataset that lives at an object-store URI (file:// or s3://); MLflow records, never loads, it."""

    def __init__(self, uri: str):
        self.uri = uri

    @staticmethod
    def _get_source_type() -> str:
        return "alignflow_uri"

    def load(self, **kwargs):
        return self.uri

    @staticmethod
    def _can_resolve(raw_source: Any) -> bool:
        return False

    @classmethod
    def _resolve(cls, raw_source: Any) -> UriDatasetSource:
        return cls(str(raw_source))

    def to_dict(self) -> dict[str, Any]:
        return {"uri": self.uri}

    @classmethod
    def from_dict(cls, source_dict: dict[Any, Any]) -> UriDatasetSource:
        return cls(source_dict["uri"])


@contextlib.contextmanager
def stage_run(
    uri: str,
    experiment: str,
    stage: str,
    parent_run_id: str | None,
    tags: dict[str, str] | None = None,
    run_name: str | None = None,
    attempt_of: str | None = None,
) -> Iterator[StageRun]:
    """Open a stage's nested run under the pipeline's parent run; FINISHED on exit, FAILED on exception.

    `attempt_of`: the output URI the stage writes. The runs of earlier, unfinished attempts at it are
    marked superseded by this one (module docstring). Queued metrics are flushed on every exit path.
    """
    _mlflow(uri)
    client = MlflowClient(uri)
    all_tags = {"alignflow.kind": "stage", "alignflow.stage": stage, **(tags or {})}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    if attempt_of:
        all_tags[ATTEMPT_KEY_TAG] = attempt_key(attempt_of)
    with reaching(uri, f"opening the {stage} stage's run"):
        experiment_id = _ensure_experiment(mlflow, experiment)
        run_id = client.create_run(experiment_id, run_name=run_name or stage, tags=all_tags).info.run_id
        if attempt_of:
            supersede_earlier_attempts(client, experiment_id, run_id, all_tags[ATTEMPT_KEY_TAG])
    handle = StageRun(client, run_id, mlflow, uri)
    try:
        yield handle
    except BaseException as exc:
        with contextlib.suppress(Exception):  # the stage's own error is the one to report
            handle.close()
        _end_failed(client, run_id, exc)
        raise
    try:
        handle.close()  # the last metrics are in before the run shows FINISHED
    except BaseException as exc:
        _end_failed(client, run_id, exc)
        raise
    with reaching(uri, f"ending the {stage} stage's run {run_id}"):
        client.set_terminated(run_id, status="FINISHED")


def _end_failed(client, run_id: str, exc: BaseException) -> None:
    """End the run FAILED, unless the server is what failed: then the call would only wait out MLflow's
    retries (RETRIES_VAR) and fail too; the run stays RUNNING until the re-run's attempt marks it superseded
    (KILLED). A server that stops answering only now leaves it RUNNING the same way, and the stage's own error
    is raised."""
    if isinstance(exc, TrackingUnavailableError):
        return
    try:
        client.set_terminated(run_id, status="FAILED")
    except Exception as end_error:
        if not server_unreachable(end_error):
            raise
        _warn(f"run {run_id} left RUNNING: MLflow unreachable ({_first_line(end_error)})")


def attempt_key(output_uri: str) -> str:
    """The `alignflow.attempt_key` tag of a stage run writing `output_uri` (a digest:
    safe in a filter string)."""
    return hashlib.sha256(output_uri.encode()).hexdigest()[:32]


def supersede_earlier_attempts(client, experiment_id: str, run_id: str, key: str) -> list[str]:
    """End the runs of earlier attempts with attempt key `key` as superseded by `run_id`; returns their ids.

    A RUNNING one is ended KILLED (its process died without ending it); a FAILED or FINISHED one keeps its
    status. Each is renamed "<name> (superseded)" and tagged `alignflow.superseded_by`; `run_id` is tagged
    `alignflow.supersedes` with their ids.
    """
    superseded = []
    for run in client.search_runs(
        [experiment_id], filter_string=f"tags.`{ATTEMPT_KEY_TAG}` = '{key}'", max_results=1000
    ):
        if run.info.run_id == run_id or SUPERSEDED_BY_TAG in run.data.tags:
            continue
        if run.info.status in ("RUNNING", "SCHEDULED"):
            client.set_terminated(run.info.run_id, status="KILLED")
        client.set_tag(run.info.run_id, SUPERSEDED_BY_TAG, run_id)
        client.update_run(run.info.run_id, name=f"{run.info.run_name} (superseded)")
        superseded.append(run.info.run_id)
    if superseded:
        client.set_tag(run_id, "alignflow.supersedes", ",".join(superseded))
    return superseded


def record_skipped_stage(
    uri: str,
    experiment: str,
    stage: str,
    parent_run_id: str | None,
    output_uri: str,
    original_run_id: str | None,
    tags: dict[str, str] | None = None,
) -> str:
    """A nested run that says the stage was reused from an earlier pipeline run (and where)."""
    extra = {"alignflow.cached": "true", "alignflow.output_uri": output_uri, **(tags or {})}
    if original_run_id:
        extra["alignflow.original_run_id"] = original_run_id
    with stage_run(uri, experiment, stage, parent_run_id, tags=extra, run_name=f"{stage} (reused)") as run:
        return run.run_id


def run_tag(uri: str, run_id: str, key: str, value: str) -> None:
    _mlflow(uri)
    with reaching(uri, f"tagging run {run_id}"):
        MlflowClient(uri).set_tag(run_id, key, value)


# ------------------------------------------------------------------------------------------------
# Model registry: versions point at object-store folders (never a copy), aliases name the roles.
# ------------------------------------------------------------------------------------------------


def register_version(
    uri: str,
    name: str,
    source: str,
    run_id: str | None,
    tags: dict[str, str],
    aliases: tuple[str, ...] = ("candidate",),
    description: str = "",
) -> str:
    """Register `source` (an object-store folder) as a new version of model `name`; returns the version.

    The folder is the version's `source` and its `alignflow.source` tag. An MLflow server refuses a local
    folder (a `storage.root` on the local disk) as a source, so there the source is
    `runs:/<run_id>/registered-output`, where a `source.txt` names the folder, and the tag is what
    `resolve_models_uri` and `alias_version` read.
    """
    _mlflow(uri)
    with reaching(uri, f"registering a version of model '{name}'"):
        return _register_version(MlflowClient(uri), uri, name, source, run_id, tags, aliases, description)


def _register_version(
    client,
    uri: str,
    name: str,
    source: str,
    run_id: str | None,
    tags: dict[str, str],
    aliases: tuple[str, ...],
    description: str,
) -> str:
    registry_source = source
    if _server_refuses_local_source(uri, source):
        if not run_id:
            raise ValueError(
                f"registering '{source}' as a version of '{name}' on the MLflow server {uri} needs the "
                "stage's MLflow run (the server refuses a local folder as a source); put storage.root "
                "on S3, or re-run the stage with tracking on"
            )
        client.log_text(run_id, f"{source}\n", f"{REGISTERED_OUTPUT_PATH}/source.txt")
        registry_source = f"runs:/{run_id}/{REGISTERED_OUTPUT_PATH}"
    try:
        client.get_registered_model(name)
    except mlflow.exceptions.MlflowException as exc:
        if uri.startswith(("http://", "https://")) and server_unreachable(exc):
            raise  # not "no such model": `reaching` reports it
        client.create_registered_model(name, description=description or None)
    version = client.create_model_version(
        name,
        source=registry_source,
        run_id=run_id,
        tags={**{k: str(v) for k, v in tags.items()}, SOURCE_TAG: source},
    )
    for alias in aliases:
        client.set_registered_model_alias(name, alias, version.version)
    return str(version.version)


def _server_refuses_local_source(uri: str, source: str) -> bool:
    """True for a local folder registered through an MLflow server (HTTP):
    the server's source check refuses it."""
    from mlflow.utils.uri import is_local_uri

    return uri.startswith(("http://", "https://")) and is_local_uri(source, is_tracking_or_registry_uri=False)


def _folder_of(version) -> str:
    """The object-store folder a registered version stands for (its tag;
    the source for versions made before it)."""
    return version.tags.get(SOURCE_TAG, version.source)


def alias_version(uri: str, name: str, alias: str) -> dict[str, Any] | None:
    """{'version', 'source', 'tags'} of `name@alias`, or None when the model or alias does not exist.

    'source' is the object-store folder the version stands for (see `register_version`)."""
    _mlflow(uri)
    client = MlflowClient(uri)
    try:
        with reaching(uri, f"reading '{name}@{alias}'"):  # a server that is down is not "no such alias"
            version = client.get_model_version_by_alias(name, alias)
    except TrackingUnavailableError:
        raise
    except TrackingAccessError as exc:
        # A basic-auth server answers 403, not 404, for a model that does not exist (it finds no permission
        # for it); a 401 is the credentials' fault and stands.
        if exc.status != 403:
            raise
        return None
    except mlflow.exceptions.MlflowException:
        return None
    return {"version": str(version.version), "source": _folder_of(version), "tags": dict(version.tags)}


def set_alias(uri: str, name: str, alias: str, version: str) -> None:
    _mlflow(uri)
    with reaching(uri, f"setting '{name}@{alias}'"):
        MlflowClient(uri).set_registered_model_alias(name, alias, version)


def tag_version(uri: str, name: str, version: str, tags: dict[str, str]) -> None:
    _mlflow(uri)
    client = MlflowClient(uri)
    with reaching(uri, f"tagging version {version} of '{name}'"):
        for key, value in tags.items():
            client.set_model_version_tag(name, version, key, str(value))


def resolve_models_uri(uri: str, models_uri: str) -> str:
    """The object-store folder behind 'models:/<name>@<alias>' or 'models:/<name>/<version>'."""
    spec = models_uri.removeprefix("models:/")
    _mlflow(uri)
    client = MlflowClient(uri)
    try:
        with reaching(uri, f"resolving '{models_uri}'"):  # a server that is down is not "no such version"
            if "@" in spec:
                name, alias = spec.split("@", 1)
                return _folder_of(client.get_model_version_by_alias(name, alias))
            name, version = spec.rsplit("/", 1)
            return _folder_of(client.get_model_version(name, version))
    except TrackingUnavailableError:
        raise
    except TrackingAccessError as exc:
        if exc.status != 403:  # as in alias_version: 403 is also a basic-auth server's "no such model"
            raise
        raise ValueError(
            f"'{models_uri}': no such registered model version, or one this user may not read ({exc})"
        ) from None
    except (mlflow.exceptions.MlflowException, ValueError) as exc:
        raise ValueError(f"'{models_uri}': no such registered model version ({exc})") from None
