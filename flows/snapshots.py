"""Inputs that name something to look up at run time: the newest dated data snapshot and `models:/` policies.

`data.sft: s3://bucket/snapshots/{date}/sft.jsonl` picks the newest `{date}` folder (YYYY-MM-DD or
YYYYMMDD) that holds the file; `model.base: models:/alignflow-policy@champion` starts from the
registry's current champion. Both are resolved before planning, so the concrete URI goes into
the stages' config and therefore into their output digests: a new snapshot or a new champion
re-runs the pipeline, the same ones reuse it.
"""

from __future__ import annotations

import re

from alignflow import tracking
from alignflow.config import PipelineConfig, StorageConfig
from alignflow.storage import StorageError, open_store

DATE_TOKEN = "{date}"
_DATE = re.compile(r"^(\d{4}-\d{2}-\d{2}|\d{8})$")


def newest_snapshot(template: str, storage: StorageConfig) -> str:
    """The template with {date} replaced by the newest date folder under its prefix that holds the file."""
    prefix, _, suffix = template.partition(DATE_TOKEN)
    if not prefix.endswith("/") or not suffix.startswith("/"):
        raise StorageError(f"'{template}': {DATE_TOKEN} must be a whole path segment, e.g. s3://b/snap/{{date}}/sft.jsonl")
    store = open_store(prefix, storage)
    dates = set()
    for uri, _ in store.list(prefix.rstrip("/")):
        rest = uri[len(prefix):]
        segment, _, tail = rest.partition("/")
        if _DATE.match(segment) and "/" + tail == suffix:
            dates.add(segment)
    if not dates:
        raise StorageError(f"'{template}': no dated snapshot under {prefix} holds {suffix.lstrip('/')}")
    return prefix + max(dates, key=lambda d: d.replace("-", "")) + suffix


def resolve_inputs(config: PipelineConfig, tracking_uri: str | None) -> PipelineConfig:
    """A copy of `config` with dated data templates and `models:/` bases replaced by concrete URIs."""
    updates = {}
    data = config.data
    for name in ("sft", "preferences", "prompts", "eval_prompts"):
        value = getattr(data, name)
        if value and DATE_TOKEN in value:
            updates[name] = newest_snapshot(value, config.storage)
    if updates:
        config = config.model_copy(update={"data": data.model_copy(update=updates)})
    base = config.model.base
    if base and base.startswith("models:/"):
        if tracking_uri is None:
            raise ValueError(f"model.base '{base}' needs MLflow tracking (tracking.enabled: true)")
        resolved = tracking.resolve_models_uri(tracking_uri, base)
        config = config.model_copy(update={"model": config.model.model_copy(update={"base": resolved})})
    return config
