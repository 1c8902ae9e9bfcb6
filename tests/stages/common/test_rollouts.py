"""The rollout Parquet schema: round trips (pyarrow, pandas, DuckDB), rejected rows, rejected files."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignflow.stages.common import rollouts as ro
from alignflow.stages.common.rollouts import ROLLOUT_SCHEMA, RolloutSchemaError, read_rollouts, write_rollouts


def make_row(i: int = 0, n: int = 3, grpo: bool = False) -> dict:
    """A valid row with n response tokens; float values are exact in float32 so round trips compare equal."""
    return {
        "iteration": 2,
        "policy_version": 2,
        "prompt_id": f"p{i}",
        "prompt": f"Write about topic {i}.\n",
        "response": "The ocean is calm.",
        "prompt_token_ids": [0, 17, 42],
        "response_token_ids": list(range(10, 10 + n)),
        "logprobs": [-0.5] * n,
        "ref_logprobs": [-0.75] * n,
        "values": None if grpo else [0.25] * n,
        "token_rewards": [0.0] * (n - 1) + [1.5],
        "advantages": [0.125 * (t + 1) for t in range(n)],
        "returns": None if grpo else [0.5] * n,
        "rewards": {"rm": 1.5, "length_penalty": -0.25},
        "reward_total": 1.25,
        "kl": 0.75,
        "length": n,
        "finish_reason": "eos",
    }


@pytest.fixture
def rows() -> list[dict]:
    return [make_row(0, 3), make_row(1, 1), make_row(2, 5, grpo=True)]


def test_schema_is_declared_with_docs():
    assert ROLLOUT_SCHEMA.names[:3] == ["iteration", "policy_version", "prompt_id"]
    for field in ROLLOUT_SCHEMA:
        assert field.metadata and field.metadata[b"description"], f"{field.name} has no description"
    nullable = {f.name for f in ROLLOUT_SCHEMA if f.nullable}
    # ref_logprobs: null when the reference is skipped
    assert nullable == {
        "values",
        "returns",
        "ref_logprobs",
    }
    rewards = ROLLOUT_SCHEMA.field("rewards").type
    assert (rewards.key_type, rewards.item_type) == (pa.string(), pa.float32())
    assert ROLLOUT_SCHEMA.field("logprobs").type.value_type == pa.float32()


def test_round_trip_pyarrow(tmp_path, rows):
    path = write_rollouts(rows, tmp_path / "iter_00002.parquet")
    table = read_rollouts(path)
    assert table.schema.equals(ROLLOUT_SCHEMA, check_metadata=True)
    back = table.to_pylist()
    for row in back:
        row["rewards"] = dict(row["rewards"])  # maps come back as lists of (key, value)
    assert back == rows
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    assert [p.name for p in tmp_path.iterdir()] == ["iter_00002.parquet"]  # no temp file left behind


def test_round_trip_pandas(tmp_path, rows):
    first = read_rollouts(write_rollouts(rows, tmp_path / "a.parquet"))
    frame = first.to_pandas()
    assert frame["length"].tolist() == [3, 1, 5]
    assert frame["values"].isna().tolist() == [False, False, True]
    again = read_rollouts(write_rollouts(frame, tmp_path / "b.parquet"))
    assert again.equals(first)


def test_table_input_is_conformed(tmp_path, rows):
    table = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
    reordered = table.select(list(reversed(table.column_names)))
    widened = reordered.set_column(
        reordered.column_names.index("iteration"), "iteration", reordered.column("iteration").cast(pa.int64())
    )
    assert read_rollouts(write_rollouts(widened, tmp_path / "t.parquet")).equals(table)


def test_read_many_files_and_directories(tmp_path, rows):
    write_rollouts(rows[:2], tmp_path / "runs" / "iter_0.parquet")
    write_rollouts(rows[2:], tmp_path / "runs" / "iter_1.parquet")
    table = read_rollouts(tmp_path / "runs")
    assert table.column("prompt_id").to_pylist() == ["p0", "p1", "p2"]
    listed = read_rollouts([tmp_path / "runs" / "iter_1.parquet", tmp_path / "runs" / "iter_0.parquet"])
    assert listed.column("prompt_id").to_pylist() == ["p2", "p0", "p1"]
    with pytest.raises(RolloutSchemaError, match="no such rollout file or directory"):
        read_rollouts(tmp_path / "missing.parquet")


def test_duckdb_reads_the_files(tmp_path, rows):
    duckdb = pytest.importorskip("duckdb")
    path = write_rollouts(rows, tmp_path / "r.parquet")
    got = duckdb.sql(
        f"SELECT prompt_id, length, len(logprobs), rewards['rm'], reward_total, values IS NULL "
        f"FROM read_parquet('{path}') ORDER BY prompt_id"
    ).fetchall()
    assert got == [
        ("p0", 3, 3, 1.5, 1.25, False),
        ("p1", 1, 1, 1.5, 1.25, False),
        ("p2", 5, 5, 1.5, 1.25, True),
    ]


def test_empty_rollouts_round_trip(tmp_path):
    table = read_rollouts(write_rollouts([], tmp_path / "empty.parquet"))
    assert table.num_rows == 0 and table.schema.equals(ROLLOUT_SCHEMA)


# ------------------------------------------------------------------------------------------------
# Bad rows: the exact message names the column and the row
# ------------------------------------------------------------------------------------------------


def _with(i: int, **changes) -> list[dict]:
    rows = [make_row(0), make_row(1), make_row(2)]
    rows[i].update(changes)
    return rows


@pytest.mark.parametrize(
    "rows,message",
    [
        (
            _with(1, logprobs=[-0.5, -0.5]),
            "rollouts: column 'logprobs' row 1: has 2 values but the response has 3 tokens (column 'length')",
        ),
        (
            _with(2, length=4),
            "rollouts: 7 problems:\n  - column 'response_token_ids' row 2: has 3 values but the response has "
            "4 tokens (column 'length')\n  - column 'logprobs' row 2: has 3 values but the response has 4 "
            "tokens (column 'length')\n  - column 'ref_logprobs' row 2: has 3 values but the response has 4 "
            "tokens (column 'length')\n  - column 'values' row 2: has 3 values but the response has 4 tokens "
            "(column 'length')\n  - column 'token_rewards' row 2: has 3 values but the response has 4 tokens "
            "(column 'length')\n  - column 'advantages' row 2: has 3 values but the response has 4 tokens "
            "(column 'length')\n  - column 'returns' row 2: has 3 values but the response has 4 tokens "
            "(column 'length')",
        ),
        (
            _with(0, advantages=[0.0, float("nan"), 0.0]),
            "rollouts: column 'advantages' row 0: non-finite value nan",
        ),
        (_with(2, kl=float("inf")), "rollouts: column 'kl' row 2: non-finite value inf"),
        (_with(1, rewards={"rm": float("-inf")}), "rollouts: column 'rewards' row 1: non-finite value -inf"),
        (_with(1, prompt_id=None), "rollouts: column 'prompt_id' row 1: null in a required column"),
        (_with(2, response=None), "rollouts: column 'response' row 2: null in a required column"),
        (_with(0, logprobs=[-0.5, None, -0.5]), "rollouts: column 'logprobs' row 0: null inside the list"),
        (
            _with(1, finish_reason="timeout"),
            "rollouts: column 'finish_reason' row 1: 'timeout' is not one of eos, length, stop",
        ),
        (_with(0, iteration=-1), "rollouts: column 'iteration' row 0: must be >= 0, got -1"),
        (
            _with(1, length="three"),
            "rollouts: column 'length' row 1: cannot store 'three' as int32 "
            "(Could not convert 'three' with type str: tried to convert to int32)",
        ),
        (
            _with(2, reward_model=1.0),
            "rollouts: row 2: unknown column(s) 'reward_model'; valid columns: "
            + ", ".join(ROLLOUT_SCHEMA.names),
        ),
    ],
    ids=[
        "short-list",
        "length-disagrees-with-every-list",
        "nan-in-list",
        "inf-scalar",
        "inf-in-map",
        "null-required",
        "null-required-list",
        "null-in-list",
        "finish-reason",
        "negative-iteration",
        "wrong-type",
        "unknown-column",
    ],
)
def test_bad_rows_rejected_with_exact_message(tmp_path, rows, message):
    path = tmp_path / "bad.parquet"
    with pytest.raises(RolloutSchemaError) as info:
        write_rollouts(rows, path)
    assert str(info.value) == message
    assert not path.exists() and not list(tmp_path.iterdir())


def test_missing_required_column_in_row(tmp_path):
    row = make_row()
    del row["kl"], row["length"]
    with pytest.raises(
        RolloutSchemaError, match=r"^rollouts: row 0: missing required column\(s\) 'kl', 'length'$"
    ):
        write_rollouts([row], tmp_path / "x.parquet")
    grpo = make_row()
    del grpo["values"], grpo["returns"]  # nullable columns may be left out
    assert read_rollouts(write_rollouts([grpo], tmp_path / "g.parquet")).column("values").null_count == 1


def test_table_with_missing_column_rejected(tmp_path, rows):
    table = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA).drop_columns(["kl"])
    with pytest.raises(RolloutSchemaError, match=r"^rollouts: missing column\(s\) 'kl'$"):
        write_rollouts(table, tmp_path / "x.parquet")


def test_failed_write_keeps_the_previous_file(tmp_path, rows, monkeypatch):
    path = write_rollouts(rows[:1], tmp_path / "r.parquet")

    def broken(table, where, **kwargs):
        with open(where, "wb") as handle:
            handle.write(b"half a file")
        raise OSError("disk full")

    monkeypatch.setattr(ro.pq, "write_table", broken)
    with pytest.raises(OSError, match="disk full"):
        write_rollouts(rows, path)
    monkeypatch.undo()
    assert read_rollouts(path).num_rows == 1
    assert [p.name for p in tmp_path.iterdir()] == ["r.parquet"]


# ------------------------------------------------------------------------------------------------
# Files whose schema differs are refused on read
# ------------------------------------------------------------------------------------------------


def _write_raw(table: pa.Table, path) -> str:
    pq.write_table(table, path)
    return str(path)


def test_read_rejects_schema_mismatch(tmp_path, rows):
    good = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
    kl_index = good.column_names.index("kl")
    widened = good.set_column(
        kl_index, ROLLOUT_SCHEMA.field("kl").with_type(pa.float64()), good.column("kl").cast(pa.float64())
    )
    path = _write_raw(widened, tmp_path / "f64.parquet")
    with pytest.raises(RolloutSchemaError) as info:
        read_rollouts(path)
    assert str(info.value) == f"{path}: schema mismatch: column 'kl' has type float64, expected float32"

    path = _write_raw(good.drop_columns(["finish_reason"]), tmp_path / "missing.parquet")
    with pytest.raises(RolloutSchemaError) as info:
        read_rollouts(path)
    assert str(info.value) == f"{path}: schema mismatch: column 'finish_reason' is missing"

    extra = good.append_column("score", pa.array([1.0, 2.0, 3.0]))
    path = _write_raw(extra, tmp_path / "extra.parquet")
    with pytest.raises(RolloutSchemaError) as info:
        read_rollouts(path)
    assert str(info.value) == f"{path}: schema mismatch: column 'score' is not in the schema"


def test_read_rejects_files_not_written_by_write_rollouts(tmp_path, rows):
    table = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)
    path = _write_raw(table.replace_schema_metadata(None), tmp_path / "foreign.parquet")
    with pytest.raises(RolloutSchemaError, match="no rollout schema version in the file metadata"):
        read_rollouts(path)
    future = table.replace_schema_metadata({ro.SCHEMA_VERSION_KEY: b"2"})
    path = _write_raw(future, tmp_path / "future.parquet")
    with pytest.raises(RolloutSchemaError, match="rollout schema version '2', this code reads version '1'"):
        read_rollouts(path)


def test_read_rejects_bad_values_in_a_valid_schema(tmp_path, rows):
    rows[1]["logprobs"] = [float("nan")]
    table = pa.Table.from_pylist(rows, schema=ROLLOUT_SCHEMA)  # bypasses write_rollouts' checks
    path = _write_raw(table, tmp_path / "nan.parquet")
    with pytest.raises(RolloutSchemaError) as info:
        read_rollouts(path)
    assert str(info.value) == f"{path}: column 'logprobs' row 1: non-finite value nan"


def test_schema_markdown_lists_every_column():
    text = ro.schema_markdown()
    lines = text.splitlines()
    assert "| column | type | nullable | description |" in lines
    table_rows = [line for line in lines if line.startswith("| `")]
    assert [line.split("`")[1] for line in table_rows] == ROLLOUT_SCHEMA.names
    assert (
        "| `values` | list<float32> | yes | Per-token critic values V(s_t); null for GRPO (no critic). |"
        in lines
    )
    assert "| `rewards` | map<string, float32> | no |" in text
    assert "KL(policy \\|\\| reference)" in text  # pipes escaped so the table renders


def test_os_replace_is_used_for_atomicity(tmp_path, rows, monkeypatch):
    calls = []
    real_replace = os.replace

    def spy(src, dst):
        calls.append((os.path.basename(src), os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(ro.os, "replace", spy)
    write_rollouts(rows, tmp_path / "r.parquet")
    assert len(calls) == 1 and calls[0][1] == "r.parquet" and calls[0][0].startswith(".r.parquet.")


def test_the_docs_show_the_schema_as_declared():
    """The documented rollout table is schema_markdown()'s:
    a column or description changed in one place only fails."""
    repo = Path(__file__).resolve().parents[3]
    pages = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    assert any(ro.schema_markdown().strip() in page.read_text() for page in pages), (
        "no page of README.md or docs/ shows the rollout schema; paste schema_markdown()'s table into one"
    )
