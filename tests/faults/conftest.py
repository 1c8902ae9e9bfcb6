"""Fixtures of the fault-injection suite: a fault proxy in front of the session's moto S3 server, and checks
that every published output in a bucket is whole."""

from __future__ import annotations

import pytest

from tests.faults.clean_run import clean_pipeline
from tests.faults.s3_fault_proxy import FaultPlan, FaultProxy


@pytest.fixture
def fault_proxy(s3_server):
    """A FaultProxy (no faults until a test sets its plan) in front of the local S3 server."""
    with FaultProxy(s3_server, FaultPlan()) as proxy:
        yield proxy


@pytest.fixture(autouse=True)
def fixed_code_version(monkeypatch):
    """Output locations hash the code version, which in a checkout includes uncommitted edits: a test that
    re-runs a pipeline must find the same locations even if someone edits the tree in between."""
    monkeypatch.setenv("ALIGNFLOW_CODE_VERSION", "0.0.0+faults")


@pytest.fixture(scope="session")
def clean(tmp_path_factory, prefect_harness):
    """(workdir, rows by key, spec by key) of one clean run of every stage (the kill and disk-full tests')."""
    return clean_pipeline(tmp_path_factory.mktemp("clean"))
