"""Data files over data.max_file_mb and records over data.max_record_kb are refused by name (and line), in
the loaders, in `alignflow validate`'s data check and in the data stage, before they are read or parsed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from alignflow.config import DataConfig
from alignflow.contract import StageSpec
from alignflow.stages.data import stage as data_stage
from alignflow.stages.data.formats import DataError, SizeLimits, load_prompts, load_sft
from alignflow.stages.data.preflight import check_data, size_limits

SFT = {"prompt": "Tea?", "completion": "Yes."}


def long_record(kib: int) -> dict:
    """An SFT record of a little over `kib` KiB as a JSONL line."""
    return {"prompt": "Write at length?", "completion": "x" * (kib * 1024)}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_file_over_the_default_limit_is_refused_without_being_read(tmp_path):
    """A 3 GiB file (sparse: it takes no disk) is refused by its size alone; reading it would take 3 GiB."""
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as fh:
        os.truncate(fh.fileno(), 3 * 1024**3)
    assert DataConfig().max_file_mb == 2048
    with pytest.raises(DataError) as refused:
        load_sft(path, size_limits(DataConfig()))
    assert refused.value.errors == [
        f"{path}: 3,072.0 MiB, over data.max_file_mb=2048; split the file or raise data.max_file_mb"
    ]


def test_a_file_over_a_lowered_limit_is_refused_and_one_at_the_limit_loads(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [long_record(600), long_record(600)])
    with pytest.raises(DataError, match=r"sft.jsonl: 1.2 MiB, over data.max_file_mb=1; split the file"):
        load_sft(path, SizeLimits(max_file_mb=1))
    assert len(load_sft(path, SizeLimits(max_file_mb=2))) == 2
    assert len(load_sft(path)) == 2  # no limits: the pipeline's own files


def test_a_jsonl_record_over_the_limit_is_named_by_line(tmp_path):
    path = write_jsonl(tmp_path / "sft.jsonl", [SFT, long_record(3), SFT, long_record(1)])
    with pytest.raises(DataError) as refused:
        load_sft(path, SizeLimits(max_record_kb=2))
    assert refused.value.errors == [
        f"{path}:2: record is 3 KiB, over data.max_record_kb=2; shorten it or raise data.max_record_kb"
    ]
    assert len(load_sft(path, SizeLimits(max_record_kb=4))) == 4


def test_an_over_long_line_is_not_parsed(tmp_path):
    """The refusal comes from the line's length: a line that is not even JSON gets the size error."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ok"}\n' + "{" * 5000 + "\n")
    with pytest.raises(DataError) as refused:
        load_prompts(path, SizeLimits(max_record_kb=4))
    assert refused.value.errors == [
        f"{path}:2: record is 5 KiB, over data.max_record_kb=4; shorten it or raise data.max_record_kb"
    ]


def test_multibyte_text_is_measured_in_bytes(tmp_path):
    """1,000 characters of 3-byte UTF-8 are ~3 KiB: over a 2 KiB limit though fewer characters than it."""
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "Tea?", "completion": "茶" * 1000}])
    path.write_text(path.read_text().replace("\\u8336", "茶"), encoding="utf-8")
    with pytest.raises(DataError, match=r"sft.jsonl:1: record is 3 KiB, over data.max_record_kb=2"):
        load_sft(path, SizeLimits(max_record_kb=2))


def test_json_and_parquet_records_over_the_limit_are_named_by_index(tmp_path):
    records = [SFT, long_record(3)]
    as_json = tmp_path / "sft.json"
    as_json.write_text(json.dumps(records))
    as_parquet = tmp_path / "sft.parquet"
    pq.write_table(pa.Table.from_pylist(records), as_parquet)
    limits = SizeLimits(max_record_kb=2)
    with pytest.raises(DataError, match=r"sft.json\[1\]: record is 3 KiB, over data.max_record_kb=2"):
        load_sft(as_json, limits)
    with pytest.raises(DataError, match=r"sft.parquet:row 1: record is 3 KiB, over data.max_record_kb=2"):
        load_sft(as_parquet, limits)


def files_config(tmp_path: Path, **changes) -> DataConfig:
    write_jsonl(tmp_path / "sft.jsonl", [SFT] * 20 + [long_record(3)])
    write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "Tea?", "chosen": "Yes.", "rejected": "No."}] * 20)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "Tea?"}] * 20)
    return DataConfig(source="files", sft="sft.jsonl", preferences="prefs.jsonl", prompts="prompts.jsonl",
                      eval_fraction=0.1, **changes)


def test_validate_and_the_data_stage_refuse_the_same_record(tmp_path, capsys):
    config = files_config(tmp_path, max_record_kb=2)
    message = (
        f"{tmp_path}/sft.jsonl:21: record is 3 KiB, over data.max_record_kb=2; shorten it or raise "
        "data.max_record_kb"
    )
    with pytest.raises(DataError) as refused:
        check_data(config, tmp_path)
    assert refused.value.errors == [message]

    spec = StageSpec(stage="data", config={"data": config.model_dump(mode="json")},
                     output_uri=f"file://{tmp_path}/out", workdir=str(tmp_path))
    assert data_stage.main(["--spec", str(spec.dump(tmp_path / "spec.json"))]) == 2
    assert capsys.readouterr().err.strip() == f"error: data: {message}"

    assert check_data(files_config(tmp_path), tmp_path).records["sft"] == 21  # the default 1024 KiB
