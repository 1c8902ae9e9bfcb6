"""The upstream stages the stage-level tests share: data -> base -> sft -> reward -> engine, run once."""

from __future__ import annotations

import pytest

from tests.conftest import small_config


@pytest.fixture(scope="session")
def upstream(tmp_path_factory, prefect_harness):
    """(workdir, config, rows by stage key) of one pipeline run on the small test config."""
    from alignflow.flows.pipeline import alignflow_pipeline

    workdir = tmp_path_factory.mktemp("rl")
    config = small_config(workdir, stages=["data", "base", "sft", "reward", "engine"],
                          engine={"max_seq_len": 96, "max_batch_size": 32})
    rows = {row["key"]: row for row in alignflow_pipeline(config)}
    assert {r["status"] for r in rows.values()} == {"ok"}
    return workdir, config, rows
