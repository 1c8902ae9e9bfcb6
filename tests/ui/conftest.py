"""Browser tests' shared pieces: the real servers of tests/flows/test_production.py, the screenshot folder
(printed at the end of the run), and each test's outcome for the failure screenshot."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# The real servers (Prefect server + process worker, `mlflow server` with proxied artifacts): one copy of
# them.
from tests.flows.test_production import mlflow_server, prefect_server  # noqa: F401

SCREENSHOTS: list[Path] = []


@pytest.fixture(scope="session")
def screenshots_dir() -> Path:
    """Where the screenshots go: $ALIGNFLOW_UI_SCREENSHOTS, else tests/ui/screenshots/ (git-ignored)."""
    folder = Path(
        os.environ.get("ALIGNFLOW_UI_SCREENSHOTS") or Path(__file__).parent / "screenshots"
    ).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    SCREENSHOTS.append(folder)
    return folder


def pytest_terminal_summary(terminalreporter):
    for folder in SCREENSHOTS:
        terminalreporter.write_line(f"browser test screenshots: {folder}")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call":
        item.rep_call = report
    return report
