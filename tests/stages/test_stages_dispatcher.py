"""`python -m alignflow.stages <stage>`, the entry point of containers and Kubernetes jobs."""

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "alignflow.stages", *args], capture_output=True, text=True,
                          timeout=120)


def test_an_unknown_stage_exits_2_listing_the_stages():
    done = run("bogus", "--spec", "x.json")
    assert done.returncode == 2
    assert "stages: data, base, sft, reward, engine, ppo, dpo, evaluate" in done.stderr


def test_a_stage_name_runs_its_program_with_the_arguments(tmp_path):
    """The base stage's program is base_model: its own argument parser and its bad-input exit answer."""
    done = run("base", "--spec", str(tmp_path / "missing.json"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: base:") and "missing.json" in done.stderr
