"""Stage processes killed (SIGKILL) at a seeded random point, then run again with the same spec.

One clean pipeline run (data -> base -> sft -> reward -> engine -> ppo -> evaluate on the small test config)
gives each stage's spec and its clean output. Each test starts one stage on that spec with a fresh output
location, kills it (SIGKILL) after a seeded delay within the run time of an unkilled run of the same spec,
and runs it again. What must hold: the killed attempt left no manifest (or, if it landed after publishing,
a whole one); the re-run finishes; its output verifies, holds exactly the clean output's files (no leftover,
no duplicate) and the configured number of steps / iterations.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignflow.contract import StageResult, StageSpec, stage_program
from alignflow.manifest import MANIFEST_NAME, find_published, materialize, output_uri, read_manifest
from tests.conftest import REPO
from tests.faults.clean_run import PPO_SMALL, STAGES

# The counts each stage's result must repeat after a kill: steps and iterations as configured.
COUNTS = {"data": ["data/sft_train_records", "data/preferences_train_records"], "sft": ["train/steps"],
          "reward-rm": ["train/steps"], "ppo": ["iterations"], "evaluate": ["eval/n_prompts"]}


def start(spec: StageSpec, workdir: Path) -> subprocess.Popen:
    path = spec.dump(workdir / f"spec-{spec.output_uri.rsplit('/', 1)[1]}.json")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", stage_program(spec.stage), "--spec", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir, env=env)


def local(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "seed", [0, pytest.param(1, marks=pytest.mark.faults), pytest.param(2, marks=pytest.mark.faults)]
)
def test_data_stage_killed_at_a_random_point_reruns_whole(tmp_path, seed):
    """The kill `make test` runs (seed 0; no upstream needed): the data stage on a demo set big enough to take
    seconds, killed anywhere in its life."""
    config = {
        "data": {
            "demo": {"n_sft": 10000, "n_preferences": 10000, "n_prompts": 256, "n_eval_prompts": 32},
            "eval_fraction": 0.1,
        }
    }
    spec = StageSpec(
        stage="data", config=config, output_uri=f"file://{tmp_path}/out/data", workdir=str(tmp_path)
    )
    _, exit_at = timing("data-10k", spec, tmp_path)
    spec = kill_somewhere(spec, tmp_path, random.Random(seed).uniform(0.5, exit_at), f"data seed {seed}")
    assert find_published(spec.output_uri) is None or materialize(spec.output_uri, tmp_path / "cache")
    proc = start(spec, tmp_path)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert StageResult.from_output(stdout).status in ("ok", "skipped")
    folder, manifest = materialize(spec.output_uri, tmp_path / "cache")
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert on_disk == sorted([MANIFEST_NAME, *(f.path for f in manifest.files)])
    metrics = manifest.summary["metrics"]
    assert (metrics["data/sft_train_records"], metrics["data/sft_eval_records"]) == (9000, 1000)
    assert (metrics["data/preferences_train_records"], metrics["data/preferences_eval_records"]) == (
        9000,
        1000,
    )


# key -> (seconds from launch to its output folder appearing, seconds to exit) of one unkilled run of its
# spec.
_TIMINGS: dict[str, tuple[float, float]] = {}


def timing(key: str, spec: StageSpec, workdir: Path) -> tuple[float, float]:
    if key not in _TIMINGS:
        reference = spec.model_copy(
            update={"output_uri": output_uri(f"file://{workdir}/timing", key, {}, {}, "t")}
        )
        started = time.time()
        proc = start(reference, workdir)
        out, folder_at = local(reference.output_uri), None
        while proc.poll() is None:
            if folder_at is None and out.exists():
                folder_at = time.time() - started
            time.sleep(0.02)
        exit_at = time.time() - started
        assert proc.returncode == 0, proc.communicate()[1][-3000:]
        _TIMINGS[key] = (folder_at if folder_at is not None else exit_at, exit_at)
    return _TIMINGS[key]


def killed_run(spec: StageSpec, workdir: Path, delay: float) -> bool:
    """Start the stage and SIGKILL it `delay` seconds after launch; False when it had finished before."""
    started = time.time()
    proc = start(spec, workdir)
    while time.time() - started < delay and proc.poll() is None:
        time.sleep(0.01)
    if proc.poll() is not None:
        proc.communicate()
        return False
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    return True


def kill_somewhere(spec: StageSpec, workdir: Path, delay: float, what: str) -> StageSpec:
    """Kill a run of `spec` `delay` s after launch, on a fresh output location; a kill that came too late (the
    process had finished: the machine ran faster than expected) is tried again 30% sooner. The spec that was
    killed."""
    for attempt in range(4):
        killed = spec.model_copy(update={"output_uri": f"{spec.output_uri}-killed{attempt}"})
        if killed_run(killed, workdir, delay):
            return killed
        delay *= 0.7
    pytest.fail(f"{what}: the stage finished before each of 4 kills (last delay {delay / 0.7:.2f}s)")


@pytest.mark.slow
@pytest.mark.faults
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("key", STAGES)
def test_stage_killed_at_a_random_point_reruns_to_the_clean_output(clean, key, seed):
    """Seeds 0 and 2 kill anywhere in the process's life (imports, inputs, training, writing); seed 1 while
    it writes its output (from the folder's appearance to exit), where a half-published output would come
    from. A kill that came too late is tried again sooner (kill_somewhere)."""
    workdir, rows, specs = clean
    folder_at, exit_at = timing(key, specs[key], workdir)
    rng = random.Random(f"{key}-{seed}")
    delay = folder_at + rng.uniform(0, exit_at - folder_at) if seed == 1 else rng.uniform(0.5, exit_at)
    base = specs[key].model_copy(
        update={"output_uri": output_uri(f"file://{workdir}/killed", key, {"seed": seed}, {}, "t")}
    )
    spec = kill_somewhere(base, workdir, delay, f"{key} seed {seed}")
    killed = find_published(spec.output_uri)
    if killed is not None:  # killed after publishing: then the output must be whole
        materialize(spec.output_uri, workdir / "cache")

    proc = start(spec, workdir)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"re-run after a kill at {delay:.2f}s failed:\n{stderr[-3000:]}"
    result = StageResult.from_output(stdout)
    assert result.status == ("skipped" if killed is not None else "ok")
    folder, manifest = materialize(spec.output_uri, workdir / "cache")  # every file there, sizes and sha256
    clean_manifest = read_manifest(rows[key]["output_uri"])
    assert sorted(f.path for f in manifest.files) == sorted(f.path for f in clean_manifest.files)
    on_disk = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert on_disk == sorted([MANIFEST_NAME, *(f.path for f in manifest.files)]), (
        "files in the output that its manifest does not list (leftovers of the killed attempt)"
    )
    for name in COUNTS.get(key, []):
        assert manifest.summary["metrics"][name] == rows[key]["metrics"][name], name
    if key == "ppo":
        history = [
            json.loads(line)["iteration"] for line in (folder / "metrics.jsonl").read_text().splitlines()
        ]
        assert history == list(range(1, PPO_SMALL["iterations"] + 1)), "an iteration lost or run twice"
        rollouts = sorted(p.name for p in (folder / "rollouts").iterdir())
        assert rollouts == [f"iter_{i:05d}.parquet" for i in range(1, PPO_SMALL["iterations"] + 1)]
