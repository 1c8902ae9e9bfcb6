"""The rollout Parquet schema, declared once, and the only writer and reader of rollout files.

One row is one sampled response with everything the update used (token ids, log-probs, values, rewards,
advantages), so a run can be audited or re-trained offline from its rollouts alone. Every write and
every read checks the data against ROLLOUT_SCHEMA; errors name the column and the row. This module
knows nothing about models or object storage: it reads and writes local paths.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# Bumped on any change to ROLLOUT_SCHEMA; a file with another version is refused on read.
ROLLOUT_SCHEMA_VERSION = "1"
SCHEMA_VERSION_KEY = b"alignflow.rollout_schema_version"

FINISH_REASONS: tuple[str, ...] = ("eos", "length", "stop")


def _field(name: str, type_: pa.DataType, description: str, nullable: bool = False) -> pa.Field:
    return pa.field(name, type_, nullable=nullable, metadata={"description": description})


def _int_list() -> pa.DataType:
    return pa.list_(pa.field("element", pa.int32(), nullable=False))


def _float_list() -> pa.DataType:
    return pa.list_(pa.field("element", pa.float32(), nullable=False))


ROLLOUT_SCHEMA: pa.Schema = pa.schema(
    [
        _field("iteration", pa.int32(), "RL iteration (1-based) that generated this row."),
        _field(
            "policy_version",
            pa.int32(),
            "Version of the actor weights in the engine when the response was sampled (bumped at each "
            "refit, 0 = the SFT weights); `iteration - 1` when rollouts are fully on-policy.",
        ),
        _field("prompt_id", pa.string(), "Stable id of the prompt in the prompt set; the GRPO group key."),
        _field("prompt", pa.string(), "Prompt text as given to the engine (after any chat template)."),
        _field("response", pa.string(), "Decoded response text, special tokens removed."),
        _field("prompt_token_ids", _int_list(), "Prompt token ids."),
        _field(
            "response_token_ids",
            _int_list(),
            "Generated token ids (EOS included when finish_reason is eos); `length` of them.",
        ),
        _field(
            "logprobs",
            _float_list(),
            "Per-token log-prob of each sampled token under the rollout policy (the old policy of the PPO "
            "ratio).",
        ),
        _field(
            "ref_logprobs",
            _float_list(),
            "Per-token log-prob under the frozen reference policy; null when the "
            "reference forward was skipped (KL coefficient 0, ppo.kl_metric false).",
            nullable=True,
        ),
        _field(
            "values",
            _float_list(),
            "Per-token critic values V(s_t); null for GRPO (no critic).",
            nullable=True,
        ),
        _field(
            "token_rewards",
            _float_list(),
            "Per-token rewards: the score on the last token, minus kl_coef * KL on every token when the KL "
            "is in the reward.",
        ),
        _field(
            "advantages",
            _float_list(),
            "Per-token advantages as fed to the loss (GAE for PPO, the group-relative advantage on every "
            "token for GRPO), after whitening when enabled.",
        ),
        _field(
            "returns", _float_list(), "Per-token GAE returns (critic targets); null for GRPO.", nullable=True
        ),
        _field(
            "rewards",
            pa.map_(pa.string(), pa.field("value", pa.float32(), nullable=False)),
            "Raw score of each reward model and reward function, by name, before weighting, "
            "normalisation and clipping.",
        ),
        _field(
            "reward_total",
            pa.float32(),
            "The sequence score trained on: weighted sum of `rewards` plus any missing-EOS penalty, after "
            "normalisation and clipping.",
        ),
        _field(
            "kl",
            pa.float32(),
            "KL(policy || reference) of the response in nats: the per-token sum; 0 when the reference "
            "forward was skipped.",
        ),
        _field("length", pa.int32(), "Number of response tokens: the length of every per-token column."),
        _field(
            "finish_reason",
            pa.string(),
            "Why generation stopped: eos (the model ended it), length (max_new_tokens reached) or stop "
            "(a stop string or token other than EOS).",
        ),
    ],
    metadata={SCHEMA_VERSION_KEY: ROLLOUT_SCHEMA_VERSION.encode()},
)

# Columns holding one value per response token: their list length must equal `length`.
PER_TOKEN_COLUMNS: tuple[str, ...] = (
    "response_token_ids",
    "logprobs",
    "ref_logprobs",
    "values",
    "token_rewards",
    "advantages",
    "returns",
)
_FLOAT_LIST_COLUMNS = ("logprobs", "ref_logprobs", "values", "token_rewards", "advantages", "returns")
_FLOAT_COLUMNS = ("reward_total", "kl")


class RolloutSchemaError(ValueError):
    """Rollout data or a rollout file that does not match ROLLOUT_SCHEMA; the message names the column."""


# --------------------------------------------------------------------------------------------------
# Building a table that has the schema
# --------------------------------------------------------------------------------------------------


def _table_from_rows(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    names = ROLLOUT_SCHEMA.names
    known = set(names)
    required = [f.name for f in ROLLOUT_SCHEMA if not f.nullable]
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise RolloutSchemaError(
                f"rollouts: row {i}: expected a mapping of column -> value, got {type(row).__name__}"
            )
        unknown = sorted(set(row) - known)
        if unknown:
            raise RolloutSchemaError(
                f"rollouts: row {i}: unknown column(s) {', '.join(map(repr, unknown))}; valid columns: "
                f"{', '.join(names)}"
            )
        missing = [name for name in required if name not in row]
        if missing:
            raise RolloutSchemaError(
                f"rollouts: row {i}: missing required column(s) {', '.join(map(repr, missing))}"
            )
    arrays = []
    for field in ROLLOUT_SCHEMA:
        values = [row.get(field.name) for row in rows]
        try:
            arrays.append(pa.array(values, type=field.type))
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            for i, value in enumerate(values):
                try:
                    pa.array([value], type=field.type)
                except (pa.ArrowException, TypeError, ValueError, OverflowError) as exc:
                    shown = repr(value)
                    shown = shown if len(shown) <= 80 else shown[:77] + "..."
                    raise RolloutSchemaError(
                        f"rollouts: column {field.name!r} row {i}: cannot store {shown} as "
                        f"{_type_name(field.type)} ({exc})"
                    ) from None
            raise
    return pa.Table.from_arrays(arrays, schema=ROLLOUT_SCHEMA)


def _conform_table(table: pa.Table) -> pa.Table:
    """Reorder a table's columns to the schema and cast exactly-convertible types; else raise."""
    names = ROLLOUT_SCHEMA.names
    unknown = [n for n in table.column_names if n not in names]
    if unknown:
        raise RolloutSchemaError(
            f"rollouts: unknown column(s) {', '.join(map(repr, unknown))}; valid columns: {', '.join(names)}"
        )
    missing = [n for n in names if n not in table.column_names]
    if missing:
        raise RolloutSchemaError(f"rollouts: missing column(s) {', '.join(map(repr, missing))}")
    columns = []
    for field in ROLLOUT_SCHEMA:
        column = table.column(field.name)
        if column.type != field.type:
            try:
                column = column.cast(field.type, safe=True)
            except (pa.ArrowException, TypeError, ValueError) as exc:
                raise RolloutSchemaError(
                    f"rollouts: column {field.name!r}: type {_type_name(column.type)} cannot be stored as "
                    f"{_type_name(field.type)} ({exc})"
                ) from None
        columns.append(column)
    return pa.Table.from_arrays(columns, schema=ROLLOUT_SCHEMA)


def _to_table(data: Any) -> pa.Table:
    if isinstance(data, pa.Table):
        return _conform_table(data)
    try:
        import pandas as pd
    except ImportError:  # pragma: no cover - pandas is a core dependency
        pd = None
    if pd is not None and isinstance(data, pd.DataFrame):
        # Row by row, so that a bad cell is reported with its column and row (rollouts are ~1e2-1e4 rows).
        return _table_from_rows(data.to_dict("records"))
    if isinstance(data, Mapping) or isinstance(data, (str, bytes)):
        raise RolloutSchemaError(
            "write_rollouts takes a list of row dicts, a pyarrow Table or a pandas DataFrame, got "
            f"{type(data).__name__}"
        )
    if isinstance(data, Iterable):
        return _table_from_rows(list(data))
    raise RolloutSchemaError(
        "write_rollouts takes a list of row dicts, a pyarrow Table or a pandas DataFrame, got "
        f"{type(data).__name__}"
    )


# --------------------------------------------------------------------------------------------------
# Validation of the values
# --------------------------------------------------------------------------------------------------


def _first_true(mask: pa.Array | pa.ChunkedArray) -> int | None:
    """Index of the first True (nulls count as False), or None."""
    filled = pc.fill_null(mask, False)
    index = pc.index(filled, True).as_py()
    return None if index < 0 else index


def _flat_values_with_rows(column: pa.ChunkedArray) -> tuple[pa.Array, np.ndarray]:
    """The items of a list or map column and, for each item, the row it belongs to.

    Built from the offsets with numpy: pyarrow 25's pc.list_parent_indices aborts the process on a
    MapArray, and `.values`/`.items` ignore slicing, so both are avoided.
    """
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy()
    child = array.items if isinstance(array, pa.MapArray) else array.values
    items = child.slice(int(offsets[0]), int(offsets[-1] - offsets[0]))
    rows = np.repeat(np.arange(len(array)), np.diff(offsets))
    return items, rows


def validate_rollouts(table: pa.Table) -> list[str]:
    """Every problem of a table that already has ROLLOUT_SCHEMA's columns and types: one line per
    failed check, each naming the column and the first offending row. Empty list = valid."""
    problems: list[str] = []
    for field in ROLLOUT_SCHEMA:
        column = table.column(field.name)
        if not field.nullable and column.null_count:
            row = _first_true(pc.is_null(column))
            problems.append(f"column {field.name!r} row {row}: null in a required column")

    lengths = table.column("length")
    negative = _first_true(pc.less(lengths, 0))
    if negative is not None:
        problems.append(f"column 'length' row {negative}: negative length {lengths[negative].as_py()}")
    for name in PER_TOKEN_COLUMNS:
        counts = pc.list_value_length(table.column(name))
        bad = _first_true(pc.not_equal(counts, lengths))
        if bad is not None:
            problems.append(
                f"column {name!r} row {bad}: has {counts[bad].as_py()} values but the response has "
                f"{lengths[bad].as_py()} tokens (column 'length')"
            )

    for name in (*_FLOAT_LIST_COLUMNS, "rewards", "prompt_token_ids", "response_token_ids"):
        items, rows = _flat_values_with_rows(table.column(name))
        if items.null_count:
            bad = _first_true(pc.is_null(items))
            problems.append(f"column {name!r} row {int(rows[bad])}: null inside the list")
        elif pa.types.is_floating(items.type):
            bad = _first_true(pc.invert(pc.is_finite(items)))
            if bad is not None:
                problems.append(
                    f"column {name!r} row {int(rows[bad])}: non-finite value {items[bad].as_py()}"
                )
    for name in _FLOAT_COLUMNS:
        column = table.column(name)
        bad = _first_true(pc.invert(pc.is_finite(column)))
        if bad is not None:
            problems.append(f"column {name!r} row {bad}: non-finite value {column[bad].as_py()}")

    for name in ("iteration", "policy_version"):
        bad = _first_true(pc.less(table.column(name), 0))
        if bad is not None:
            problems.append(f"column {name!r} row {bad}: must be >= 0, got {table.column(name)[bad].as_py()}")
    finish = table.column("finish_reason")
    bad = _first_true(pc.invert(pc.is_in(finish, value_set=pa.array(FINISH_REASONS))))
    if bad is not None and finish[bad].is_valid:
        problems.append(
            f"column 'finish_reason' row {bad}: {finish[bad].as_py()!r} is not one of "
            f"{', '.join(FINISH_REASONS)}"
        )
    return problems


def _raise_if_invalid(table: pa.Table, where: str) -> None:
    problems = validate_rollouts(table)
    if len(problems) == 1:
        raise RolloutSchemaError(f"{where}: {problems[0]}")
    if problems:
        raise RolloutSchemaError(f"{where}: {len(problems)} problems:\n  - " + "\n  - ".join(problems))


# --------------------------------------------------------------------------------------------------
# Write and read
# --------------------------------------------------------------------------------------------------


def write_rollouts(rows_or_table: Any, path: str | os.PathLike[str]) -> Path:
    """Validate rollouts and write them to one zstd-compressed Parquet file, atomically.

    Args:
        rows_or_table: a list of row dicts (column -> value; nullable columns may be left out), a
            pyarrow Table or a pandas DataFrame with exactly ROLLOUT_SCHEMA's columns.
        path: destination file; its directory is created. The data goes to a temporary file in the
            same directory, is fsynced, then os.replace()d onto `path`, so a reader never sees half a file.

    Returns:
        The path written.

    Raises:
        RolloutSchemaError naming the column and row of every problem (unknown/missing columns, wrong
        types, nulls in required columns, per-token lists whose length differs from `length`,
        NaN/inf values, unknown finish_reason).
    """
    table = _to_table(rows_or_table)
    _raise_if_invalid(table, "rollouts")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        pq.write_table(table, tmp, compression="zstd")
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _check_file_schema(schema: pa.Schema, path: Path) -> None:
    version = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
    if version is None:
        raise RolloutSchemaError(
            f"{path}: no rollout schema version in the file metadata; it was not written by write_rollouts"
        )
    if version.decode() != ROLLOUT_SCHEMA_VERSION:
        raise RolloutSchemaError(
            f"{path}: rollout schema version {version.decode()!r}, this code reads version "
            f"{ROLLOUT_SCHEMA_VERSION!r}"
        )
    problems = []
    for field in ROLLOUT_SCHEMA:
        if field.name not in schema.names:
            problems.append(f"column {field.name!r} is missing")
            continue
        found = schema.field(field.name)
        if found.type != field.type:
            problems.append(
                f"column {field.name!r} has type {_type_name(found.type)}, expected {_type_name(field.type)}"
            )
        elif found.nullable != field.nullable:
            expected = "nullable" if field.nullable else "not nullable"
            problems.append(f"column {field.name!r} nullability differs (expected {expected})")
    problems += [
        f"column {name!r} is not in the schema" for name in schema.names if name not in ROLLOUT_SCHEMA.names
    ]
    if not problems and schema.names != ROLLOUT_SCHEMA.names:
        problems.append(f"columns are in the wrong order: {', '.join(schema.names)}")
    if problems:
        raise RolloutSchemaError(f"{path}: schema mismatch: " + "; ".join(problems))


def _expand(path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[Path]:
    items = [path_or_paths] if isinstance(path_or_paths, (str, os.PathLike)) else list(path_or_paths)
    paths: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(p.glob("*.parquet"))
            if not found:
                raise RolloutSchemaError(f"{p}: directory holds no *.parquet rollout files")
            paths.extend(found)
        elif p.is_file():
            paths.append(p)
        else:
            raise RolloutSchemaError(f"{p}: no such rollout file or directory")
    if not paths:
        raise RolloutSchemaError("read_rollouts: no paths given")
    return paths


def read_rollouts(path_or_paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> pa.Table:
    """Read one or more rollout files (or directories of *.parquet) into one Table with ROLLOUT_SCHEMA.

    Each file's schema must match ROLLOUT_SCHEMA exactly (names, order, types, nullability, schema
    version) and its values must pass the write-time checks; errors name the file and the column.
    """
    tables = []
    for path in _expand(path_or_paths):
        _check_file_schema(pq.read_schema(path), path)
        table = pa.Table.from_arrays(pq.read_table(path).columns, schema=ROLLOUT_SCHEMA)
        _raise_if_invalid(table, str(path))
        tables.append(table)
    return pa.concat_tables(tables) if len(tables) > 1 else tables[0]


# --------------------------------------------------------------------------------------------------
# Documentation
# --------------------------------------------------------------------------------------------------


_SIMPLE_TYPE_NAMES = {
    pa.int32(): "int32",
    pa.int64(): "int64",
    pa.float32(): "float32",
    pa.float64(): "float64",
    pa.string(): "string",
    pa.large_string(): "large_string",
}


def _type_name(type_: pa.DataType) -> str:
    if type_ in _SIMPLE_TYPE_NAMES:
        return _SIMPLE_TYPE_NAMES[type_]
    if isinstance(type_, pa.MapType):
        return f"map<{_type_name(type_.key_type)}, {_type_name(type_.item_type)}>"
    if pa.types.is_list(type_) or pa.types.is_large_list(type_):
        return f"list<{_type_name(type_.value_type)}>"
    return str(type_)


def schema_markdown() -> str:
    """ROLLOUT_SCHEMA as a Markdown table (column, type, nullable, description) for the README."""
    lines = [
        f"Rollout schema version {ROLLOUT_SCHEMA_VERSION} (one row per sampled response; Parquet, zstd).",
        "",
        "| column | type | nullable | description |",
        "|---|---|---|---|",
    ]
    for field in ROLLOUT_SCHEMA:
        description = (field.metadata or {}).get(b"description", b"").decode().replace("|", "\\|")
        lines.append(
            f"| `{field.name}` | {_type_name(field.type)} | {'yes' if field.nullable else 'no'} | "
            f"{description} |"
        )
    return "\n".join(lines) + "\n"
