"""The data check that `alignflow validate` and `run` make first: all files' problems in one report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignflow.config import DataConfig
from alignflow.stages.data.formats import DataError
from alignflow.stages.data.preflight import check_data, identical_pairs_warning, local_path

PAIR = {"prompt": "Tea?", "chosen": "Yes, please.", "rejected": "No."}


def write(folder: Path, name: str, records: list[dict]) -> str:
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return name


def files_config(tmp_path: Path, **changes) -> DataConfig:
    paths = {
        "sft": write(tmp_path, "sft.jsonl", [{"prompt": "Tea?", "completion": "Yes."}] * 3),
        "preferences": write(tmp_path, "prefs.jsonl", [PAIR] * 3),
        "prompts": write(tmp_path, "prompts.jsonl", [{"prompt": "Tea?"}] * 3),
    }
    return DataConfig(source="files", **{**paths, **changes})


def test_good_files_are_counted_relative_to_the_workdir(tmp_path):
    report = check_data(files_config(tmp_path), tmp_path)
    assert report.records == {"sft": 3, "preferences": 3, "prompts": 3}
    assert not report.warnings and not report.remote
    assert report.summary() == "data: data.sft 3 records, data.preferences 3 records, data.prompts 3 records"


def test_every_files_problems_are_reported_together(tmp_path):
    (tmp_path / "bad_sft.jsonl").write_text(
        '{"prompt": "a", "completion": "b"}\n{"prompt": "x" "completion": "y"}\n'
    )
    write(tmp_path, "bad_prefs.jsonl", [PAIR, {"prompt": "p", "rejected": "r"}])
    with pytest.raises(DataError) as info:
        check_data(
            files_config(
                tmp_path, sft="bad_sft.jsonl", preferences="bad_prefs.jsonl", prompts="missing.jsonl"
            ),
            tmp_path,
        )
    assert info.value.errors == [
        f"{tmp_path}/bad_sft.jsonl:2: malformed JSON (Expecting ',' delimiter: line 1 column 16)",
        f"{tmp_path}/bad_prefs.jsonl:2: record is missing required field 'chosen' "
        "(preference records need prompt, chosen, rejected)",
        f"{tmp_path}/missing.jsonl: dataset file not found",
    ]


def test_pairs_with_chosen_equal_to_rejected_are_a_counted_warning(tmp_path):
    same = {**PAIR, "chosen": "No.", "rejected": " No."}
    config = files_config(tmp_path, preferences=write(tmp_path, "ties.jsonl", [PAIR, same, PAIR, same]))
    report = check_data(config, tmp_path)
    assert report.records["preferences"] == 4
    assert report.warnings == [
        f"{tmp_path}/ties.jsonl: 2 of 4 preference pairs have chosen == rejected (first: "
        "record 2); they teach nothing; remove them to silence this"
    ]
    assert identical_pairs_warning("x", []) is None


def test_remote_files_are_left_to_the_data_stage_and_the_demo_needs_nothing(tmp_path):
    report = check_data(files_config(tmp_path, sft="s3://bucket/sft.jsonl"), tmp_path)
    assert report.remote == {"sft": "s3://bucket/sft.jsonl"} and "sft" not in report.records
    assert "read by the data stage: data.sft (s3://bucket/sft.jsonl)" in report.summary()
    assert check_data(DataConfig(), tmp_path).records == {}
    assert local_path("file:///data/a.jsonl", tmp_path) == Path("/data/a.jsonl")
