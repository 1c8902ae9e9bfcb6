"""Import boundaries (README.md "Layout"), enforced: flows/ and alignflow/ torch-free; boto3, mlflow once."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ML_LIBRARIES = {"torch", "transformers", "deepspeed", "triton", "safetensors", "tokenizers"}
SOURCE_DIRS = ("alignflow", "flows", "stages", "kernels")


def imported_modules(path: Path) -> set[str]:
    """Top-level names of every module imported anywhere in the file (inside functions too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def python_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (REPO / d).rglob("*.py"))


def _roots(names: set[str]) -> set[str]:
    return {n.split(".")[0] for n in names}


@pytest.mark.parametrize("layer", ["flows", "alignflow"])
def test_orchestration_and_core_are_torch_free(layer):
    offenders = {
        str(p.relative_to(REPO)): sorted(_roots(imported_modules(p)) & ML_LIBRARIES)
        for p in python_files(layer)
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_flows_do_not_import_stages():
    offenders = [
        str(p.relative_to(REPO))
        for p in python_files("flows")
        if any(n.startswith("alignflow.stages") for n in imported_modules(p))
    ]
    assert offenders == []


@pytest.mark.parametrize(
    ("library", "allowed"),
    [
        ("boto3", ["alignflow/storage.py"]),
        ("botocore", ["alignflow/storage.py"]),
        # Run tracking and the registry; apart from it, the server's user administration (its auth API), which
        # only the stack's one-shot `mlflow-users` service runs.
        ("mlflow", ["alignflow/mlflow_access.py", "alignflow/tracking.py"]),
    ],
)
def test_one_module_owns_each_service_client(library, allowed):
    users = sorted(
        str(p.relative_to(REPO)) for p in python_files(*SOURCE_DIRS) if library in _roots(imported_modules(p))
    )
    assert users == allowed


def test_importing_the_flow_loads_no_ml_library():
    """The runtime check behind the static one: a worker image without torch can run the flow."""
    code = (
        "import sys, alignflow.flows.pipeline, alignflow.cli, alignflow.flows.plan; "
        f"print(sorted(m for m in {sorted(ML_LIBRARIES)!r} if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


def test_the_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    import torch.nn\n    from transformers import AutoModel\n")
    assert _roots(imported_modules(bad)) & ML_LIBRARIES == {"torch", "transformers"}


def test_only_the_vllm_backend_imports_vllm():
    """The trainer never loads vLLM: only the engine module does,
    in the engine stage or a rollout worker process."""
    users = sorted(
        str(p.relative_to(REPO)) for p in python_files(*SOURCE_DIRS) if "vllm" in _roots(imported_modules(p))
    )
    assert users == ["stages/common/generation/vllm/engine.py"]
