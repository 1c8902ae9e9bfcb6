"""The rollout writer: files land whole and in order, in the background or in line, uploads go to a remote
store, an error in a write is raised by the next call (in line: by the call itself) instead of being lost, and
the thread is used where a core is free for it or an upload waits on the network."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from alignflow.stages.common.rollouts import RolloutSchemaError, read_rollouts
from alignflow.stages.ppo import rollout_writer
from alignflow.stages.ppo.rollout_writer import RolloutWriter, writes_in_background
from tests.stages.common.test_rollouts import make_row


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


@pytest.mark.parametrize("background", [True, False])
def test_files_are_written_whole_after_wait_in_the_background_or_in_line(tmp_path, background):
    writer = RolloutWriter(LocalStore(), str(tmp_path), background=background)
    for iteration in (1, 2, 3):
        writer.submit(
            [make_row(i) for i in range(4)], tmp_path / "rollouts" / f"iter_{iteration:05d}.parquet"
        )
    writer.close()
    for iteration in (1, 2, 3):
        assert read_rollouts(tmp_path / "rollouts" / f"iter_{iteration:05d}.parquet").num_rows == 4


def test_a_remote_store_gets_each_file_after_it_is_written(tmp_path):
    store = RemoteStore()
    writer = RolloutWriter(store, "s3://bucket/run/ppo")
    assert writer.background
    writer.submit([make_row(0)], tmp_path / "iter_00001.parquet")
    writer.submit([make_row(1)], tmp_path / "iter_00002.parquet")
    writer.close()
    assert store.uploaded == [
        ("iter_00001.parquet", "s3://bucket/run/ppo/rollouts/iter_00001.parquet"),
        ("iter_00002.parquet", "s3://bucket/run/ppo/rollouts/iter_00002.parquet"),
    ]


def test_a_failed_write_is_raised_by_the_next_call(tmp_path):
    bad = make_row(0)
    bad["length"] = 99  # per-token lists of another length: the schema check refuses the row
    writer = RolloutWriter(LocalStore(), str(tmp_path), background=True)
    writer.submit([bad], tmp_path / "iter_00001.parquet")
    with pytest.raises(RolloutSchemaError):
        writer.submit([make_row(1)], tmp_path / "iter_00002.parquet")
    writer.close()
    assert not (tmp_path / "iter_00001.parquet").exists()
    bad_again = RolloutWriter(LocalStore(), str(tmp_path), background=True)
    bad_again.submit([bad], tmp_path / "iter_00003.parquet")
    with pytest.raises(RolloutSchemaError):
        bad_again.close()


def test_in_line_a_failed_write_is_raised_by_its_own_submit_and_leaves_no_file(tmp_path):
    bad = make_row(0)
    bad["length"] = 99
    writer = RolloutWriter(LocalStore(), str(tmp_path), background=False)
    with pytest.raises(RolloutSchemaError):
        writer.submit([bad], tmp_path / "iter_00001.parquet")
    writer.submit([make_row(1)], tmp_path / "iter_00002.parquet")  # still usable
    writer.close()
    assert not (tmp_path / "iter_00001.parquet").exists()
    assert read_rollouts(tmp_path / "iter_00002.parquet").num_rows == 1


def test_the_thread_is_used_for_uploads_and_where_a_core_is_left_over(monkeypatch):
    monkeypatch.setattr(rollout_writer.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert not writes_in_background(LocalStore(), "/tmp/run")  # 2 cores, both torch's: in line
        assert writes_in_background(RemoteStore(), "s3://bucket/run")  # an upload: in the background
        assert not RolloutWriter(LocalStore(), "/tmp/run").background
        torch.set_num_threads(1)
        assert writes_in_background(LocalStore(), "/tmp/run")  # a core left over
    finally:
        torch.set_num_threads(threads)
