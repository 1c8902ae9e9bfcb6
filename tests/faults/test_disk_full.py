"""Disk full in the output folder: a small tmpfs (we are root here; elsewhere the test skips) filled so that
half of a stage's output fits. What must hold: the stage fails with a message naming the output, the free
space and what to do; nothing is published (no manifest, no temp file); once there is room the same spec
publishes the whole output, with nothing left of the failed attempt."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from alignflow.contract import StageResult, StageSpec, stage_program
from alignflow.manifest import MANIFEST_NAME, find_published, materialize
from tests.conftest import REPO

DATA = {"data": {"demo": {"n_sft": 1000, "n_preferences": 1000, "n_prompts": 64, "n_eval_prompts": 16},
                 "eval_fraction": 0.1}}


@contextlib.contextmanager
def small_disk(path: Path, size_kib: int):
    """A tmpfs of `size_kib` mounted at `path` for the duration."""
    path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(disk: Path, leave_bytes: int) -> Path:
    """Write a filler file so that about `leave_bytes` stay free on `disk`."""
    filler = disk / "filler"
    with open(filler, "wb") as fh:
        fh.write(b"\0" * max(shutil.disk_usage(disk).free - leave_bytes, 0))
    return filler


def run_stage(spec: StageSpec, workdir: Path) -> tuple[int, str, str]:
    path = spec.dump(workdir / f"spec-{spec.stage}.json")
    proc = subprocess.run([sys.executable, "-m", stage_program(spec.stage), "--spec", str(path)],
                          capture_output=True, text=True, cwd=workdir, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    return proc.returncode, proc.stdout, proc.stderr


def output_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.slow
def test_disk_full_in_the_output_folder_fails_clearly_and_publishes_nothing(tmp_path):
    clean = StageSpec(
        stage="data", config=DATA, output_uri=f"file://{tmp_path}/clean/data", workdir=str(tmp_path)
    )
    code, _, stderr = run_stage(clean, tmp_path)
    assert code == 0, stderr[-3000:]
    needed = output_bytes(tmp_path / "clean" / "data")
    with small_disk(tmp_path / "disk", size_kib=4 * needed // 1024 + 256) as disk:
        filler = fill(disk, needed // 2)
        spec = clean.model_copy(update={"output_uri": f"file://{disk}/out/data"})
        code, stdout, stderr = run_stage(spec, tmp_path)
        assert code == 1, stderr[-3000:]
        result = StageResult.from_output(stdout)
        assert result.status == "failed"
        assert result.message.startswith(f"no space left on device while writing {spec.output_uri} ("), (
            result.message
        )
        assert f"bytes free in {disk}/out/data; free space there or point storage.root" in result.message
        assert "Traceback" not in stderr, "a full disk is not a bug: no traceback"
        out = disk / "out" / "data"
        assert 0 < output_bytes(out) < needed, "the disk filled up part-way through the output"
        assert find_published(spec.output_uri) is None
        assert not (out / MANIFEST_NAME).exists()
        assert not [p for p in out.rglob(".*") if p.is_file()], "temp files of failed atomic writes"

        filler.unlink()
        code, stdout, stderr = run_stage(spec, tmp_path)
        assert code == 0, stderr[-3000:]
        assert StageResult.from_output(stdout).status == "ok"
        folder, manifest = materialize(spec.output_uri, tmp_path / "cache")
        on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        assert on_disk == sorted([MANIFEST_NAME, *(f.path for f in manifest.files)])


@pytest.mark.slow
@pytest.mark.faults
def test_disk_full_while_sft_writes_its_checkpoint(clean, tmp_path):
    """The same on the SFT stage, whose checkpoint (safetensors) is most of its output."""
    workdir, rows, specs = clean
    needed = output_bytes(Path(rows["sft"]["output_uri"].removeprefix("file://")))
    with small_disk(tmp_path / "disk", size_kib=4 * needed // 1024 + 256) as disk:
        filler = fill(disk, needed // 2)
        spec = specs["sft"].model_copy(update={"output_uri": f"file://{disk}/out/sft", "tracking": None})
        code, stdout, stderr = run_stage(spec, workdir)
        assert code == 1, stderr[-3000:]
        message = StageResult.from_output(stdout).message
        assert message.startswith(f"no space left on device while writing {spec.output_uri} ("), message
        assert "Traceback" not in stderr
        out = disk / "out" / "sft"
        assert 0 < output_bytes(out) < needed, "the disk filled up part-way through the output"
        assert find_published(spec.output_uri) is None
        assert not [p for p in out.rglob(".*") if p.is_file()], "temp files of failed atomic writes"

        filler.unlink()
        code, stdout, stderr = run_stage(spec, workdir)
        assert code == 0, stderr[-3000:]
        folder, manifest = materialize(spec.output_uri, tmp_path / "cache")
        on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
        assert on_disk == sorted([MANIFEST_NAME, *(f.path for f in manifest.files)])
        assert manifest.summary["metrics"]["train/steps"] == rows["sft"]["metrics"]["train/steps"]
