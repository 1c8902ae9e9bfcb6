"""A config's data files checked before anything starts: format, required fields, bad records by file:line.

What it is for: fast feedback. `alignflow validate` and `alignflow run` call it before Prefect or any
stage process starts (the data stage itself would report the same errors, but only after Prefect's
server and a stage process started: 15-22 s on the 2-core box), with the same loaders the data stage
uses, so the two cannot disagree. Torch-free. What it is not: a check of remote files (s3://): those
are read by the data stage, which reports them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from alignflow.config import DataConfig
from alignflow.stages.data.formats import DataError, PreferenceRecord, SizeLimits, load_records

# Config key -> record kind of the loaders.
DATA_FILES = {"sft": "sft", "preferences": "preferences", "prompts": "prompts", "eval_prompts": "prompts"}


@dataclass
class DataReport:
    """What the check found: records per checked file, warnings, and files it left to the data stage."""

    records: dict[str, int] = field(default_factory=dict)  # config key -> records
    warnings: list[str] = field(default_factory=list)
    remote: dict[str, str] = field(default_factory=dict)  # config key -> URI not checked here

    def summary(self) -> str:
        checked = ", ".join(f"data.{key} {count:,} records" for key, count in self.records.items())
        parts = [f"data: {checked or 'nothing to check (demo task)'}"]
        if self.remote:
            parts.append(
                "read by the data stage: " + ", ".join(f"data.{k} ({u})" for k, u in self.remote.items())
            )
        return "; ".join(parts)


def identical_pairs(records: list[PreferenceRecord]) -> list[int]:
    """Indices of preference pairs whose chosen response equals the rejected one (no preference to learn)."""
    return [i for i, r in enumerate(records) if r.chosen.strip() == r.rejected.strip()]


def identical_pairs_warning(where: str, records: list[PreferenceRecord]) -> str | None:
    """A counted warning for pairs with chosen == rejected, or None. A warning, not an error: public
    preference sets have a few such ties, which give a reward model or DPO a zero-margin pair and nothing
    to learn."""
    same = identical_pairs(records)
    if not same:
        return None
    return (
        f"{where}: {len(same)} of {len(records)} preference pairs have chosen == rejected (first: record "
        f"{same[0] + 1}); they teach nothing; remove them to silence this"
    )


def size_limits(config: DataConfig) -> SizeLimits:
    """The file and record limits the user's data files are held to (data.max_file_mb, data.max_record_kb)."""
    return SizeLimits(max_file_mb=config.max_file_mb, max_record_kb=config.max_record_kb)


def local_path(uri: str, workdir: Path) -> Path | None:
    """The local file a data URI names (relative paths against the workdir, as the data stage reads them)."""
    if uri.startswith("file://"):
        return Path(uri.removeprefix("file://"))
    if "://" in uri:
        return None
    path = Path(uri)
    return path if path.is_absolute() else workdir / path


def check_data(config: DataConfig, workdir: Path) -> DataReport:
    """Load every local data file of `config` with the data stage's loaders and size limits; raise DataError
    listing every problem (file:line and how to fix it) of every file, or return what was checked and the
    warnings."""
    report = DataReport()
    if config.source != "files":
        return report
    errors: list[str] = []
    for key, kind in DATA_FILES.items():
        uri = getattr(config, key)
        if not uri:
            continue
        path = local_path(uri, workdir)
        if path is None:
            report.remote[key] = uri
            continue
        try:
            records = load_records(path, kind, size_limits(config))
        except DataError as exc:
            errors.extend(exc.errors)
            continue
        report.records[key] = len(records)
        if kind == "preferences":
            warning = identical_pairs_warning(str(path), records)
            if warning:
                report.warnings.append(warning)
    if errors:
        raise DataError(errors)
    return report
