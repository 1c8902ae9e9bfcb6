"""Packaging: every module imports from the editable install and from a wheel installed into a fresh venv."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"alignflow": "alignflow", "flows": "alignflow.flows", "stages": "alignflow.stages",
                "kernels": "alignflow.kernels"}

IMPORT_ALL = """
import importlib, pkgutil, sys
names = []
# The four import names live in different folders (package-dir), so walk each one.
for top in ("alignflow", "alignflow.flows", "alignflow.stages", "alignflow.kernels"):
    package = importlib.import_module(top)
    names.append(top)
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        if not info.name.endswith("__main__") and info.name not in names:
            names.append(info.name)
for name in names:
    importlib.import_module(name)
print(len(names), sys.modules["alignflow.stages.sft"].__file__)
"""


def source_modules() -> set[str]:
    """Dotted names of every .py module in the source folders, as installed."""
    names = set()
    for folder, package in PACKAGE_DIRS.items():
        for path in (REPO / folder).rglob("*.py"):
            rel = path.relative_to(REPO / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            names.add(".".join([package, *parts]))
    return names


def test_editable_install_imports_every_module():
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL], capture_output=True, text=True, timeout=300, cwd="/"
    )
    assert out.returncode == 0, out.stderr[-3000:]
    count, sft_file = out.stdout.split()
    assert int(count) == len({m for m in source_modules() if not m.endswith("__main__")})
    assert sft_file == str(REPO / "stages" / "sft.py")


@pytest.mark.slow
def test_wheel_in_a_fresh_venv_imports_every_module(tmp_path):
    wheel_dir = tmp_path / "dist"
    built = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheel_dir),
            str(REPO),
        ],
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    # `make` prints no build warnings: setuptools warns when pyproject's package list and the folders
    # disagree.
    assert "Warning" not in built.stderr, built.stderr[-3000:]
    wheel = next(wheel_dir.glob("alignflow-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        in_wheel = {
            n[:-3].replace("/", ".").removesuffix(".__init__") for n in zf.namelist() if n.endswith(".py")
        }
    assert in_wheel == source_modules(), "pyproject's packages list is missing or has extra packages"
    with zipfile.ZipFile(wheel) as zf:
        sources = {n for n in zf.namelist() if n.endswith((".cpp", ".h"))}
    csrc = REPO / "kernels" / "csrc"
    expected = {
        f"alignflow/kernels/csrc/{p.relative_to(csrc)}" for p in csrc.rglob("*") if p.suffix in (".cpp", ".h")
    }
    # Headers too: without kernels.h no .cpp of an installed wheel compiled.
    assert len(expected) >= 4 and sources == expected, (
        "the C++ kernel sources and headers, compiled on first use, ship"
    )

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = Path(
        subprocess.run(
            [str(venv / "bin/python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    # Dependencies come from the dev venv's site-packages appended as a plain path: its .pth files
    # (the editable install's finder among them) are not processed, so only the wheel provides alignflow.
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
        check=True,
        timeout=300,
        capture_output=True,
    )
    out = subprocess.run(
        [str(venv / "bin/python"), "-c", IMPORT_ALL],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    count, sft_file = out.stdout.split()
    assert sft_file.startswith(str(site)), f"imported from {sft_file}, not the wheel"
    assert (site / "bin" / "alignflow").exists() or any(site.glob("alignflow-*.dist-info/entry_points.txt"))
