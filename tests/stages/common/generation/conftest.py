"""Fixtures of the engine tests: tiny checkpoints of every architecture variant, few threads."""

from __future__ import annotations

from pathlib import Path

import pytest
from engine_test_models import ARCHITECTURES, save_tiny_model


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {name: save_tiny_model(root / name, name) for name in ARCHITECTURES}


@pytest.fixture(autouse=True)
def _few_threads(one_torch_thread):
    yield
