"""The background rollout writer: files land whole and in order, uploads go to a remote store, and an error in
a write is raised by the next call instead of being lost."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignflow.stages.rl.rollout_writer import RolloutWriter
from alignflow.stages.rollouts import RolloutSchemaError, read_rollouts
from tests.stages.test_rollouts import make_row


class LocalStore:
    def local_path(self, uri: str) -> Path:
        return Path(uri)


class RemoteStore:
    def __init__(self) -> None:
        self.uploaded: list[tuple[str, str]] = []

    def local_path(self, uri: str) -> None:
        return None

    def put_file(self, path: Path, uri: str) -> None:
        assert path.exists(), "uploaded before the file was written"
        self.uploaded.append((path.name, uri))


def test_files_are_written_in_the_background_and_whole_after_wait(tmp_path):
    writer = RolloutWriter(LocalStore(), str(tmp_path))
    for iteration in (1, 2, 3):
        writer.submit([make_row(i) for i in range(4)], tmp_path / "rollouts" / f"iter_{iteration:05d}.parquet")
    writer.close()
    for iteration in (1, 2, 3):
        assert read_rollouts(tmp_path / "rollouts" / f"iter_{iteration:05d}.parquet").num_rows == 4


def test_a_remote_store_gets_each_file_after_it_is_written(tmp_path):
    store = RemoteStore()
    writer = RolloutWriter(store, "s3://bucket/run/ppo")
    writer.submit([make_row(0)], tmp_path / "iter_00001.parquet")
    writer.submit([make_row(1)], tmp_path / "iter_00002.parquet")
    writer.close()
    assert store.uploaded == [("iter_00001.parquet", "s3://bucket/run/ppo/rollouts/iter_00001.parquet"),
                              ("iter_00002.parquet", "s3://bucket/run/ppo/rollouts/iter_00002.parquet")]


def test_a_failed_write_is_raised_by_the_next_call(tmp_path):
    bad = make_row(0)
    bad["length"] = 99  # per-token lists of another length: the schema check refuses the row
    writer = RolloutWriter(LocalStore(), str(tmp_path))
    writer.submit([bad], tmp_path / "iter_00001.parquet")
    with pytest.raises(RolloutSchemaError):
        writer.submit([make_row(1)], tmp_path / "iter_00002.parquet")
    writer.close()
    assert not (tmp_path / "iter_00001.parquet").exists()
    bad_again = RolloutWriter(LocalStore(), str(tmp_path))
    bad_again.submit([bad], tmp_path / "iter_00003.parquet")
    with pytest.raises(RolloutSchemaError):
        bad_again.close()
