"""Every torch.load in the repository unpickles with weights_only=True (tensors and plain containers only):
an audit of the source, so a new weights_only=False, or a call that leaves it to torch's default, fails here.

The one exception is tests/malicious_pickle.py, which unpickles its crafted file on purpose to show the file
is a working attack (the positive control of the refusal tests).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
AUDITED = ("alignflow", "flows", "stages", "kernels", "scripts", "benchmarks", "tests")
ON_PURPOSE = {"tests/malicious_pickle.py"}


def unsafe_loads(path: Path, root: Path = REPO) -> list[str]:
    """'file:line' of each torch.load call without weights_only=True, and of each `from torch import load`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            found += [f"{path.relative_to(root)}:{node.lineno} (imports load)"
                      for alias in node.names if alias.name == "load"]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if node.func.attr == "load" and isinstance(owner, ast.Name) and owner.id == "torch":
            safe = any(
                k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
                for k in node.keywords
            )
            if not safe:
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    return found


def test_every_torch_load_passes_weights_only_true():
    files = sorted(p for d in AUDITED for p in (REPO / d).rglob("*.py"))
    assert len(files) > 100, "the audit found the source tree"
    offenders = [hit for p in files if str(p.relative_to(REPO)) not in ON_PURPOSE for hit in unsafe_loads(p)]
    assert offenders == []


def test_the_audit_catches_an_unsafe_call(tmp_path):
    source = tmp_path / "bad.py"
    source.write_text(
        "import torch\nfrom torch import load\n"
        "torch.load('a')\ntorch.load('b', weights_only=False)\ntorch.load('c', weights_only=True)\n"
    )
    assert unsafe_loads(source, tmp_path) == ["bad.py:2 (imports load)", "bad.py:3", "bad.py:4"]
