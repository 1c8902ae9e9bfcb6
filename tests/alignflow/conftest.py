"""Fixtures of the core package's tests."""

from __future__ import annotations

import pytest

from alignflow import cli


@pytest.fixture
def main(monkeypatch):
    """cli.main in this process, without its process-wide switches (library log levels, warning filters)."""
    monkeypatch.setattr(cli.console, "quiet", lambda: None)
    monkeypatch.setattr(cli, "set_offline_defaults", lambda: None)
    return cli.main
