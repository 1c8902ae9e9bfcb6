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


def test_every_stage_but_data_starts_with_the_ml_stack_imported_and_the_collector_on(tmp_path):
    """The dispatcher imports what a model stage's setup would (stages/common/warm.py ML_STACK) with the
    collector off; the program's run_program turns it on (seen at exit, after the bad-input result line)."""
    script = (
        "import atexit, gc, runpy, sys\n"
        "atexit.register(lambda: print('llama' if 'transformers.models.llama.modeling_llama' in sys.modules "
        "else 'no-llama', gc.isenabled()))\n"
        "sys.argv = ['alignflow.stages', *sys.argv[1:]]\n"
        "runpy.run_module('alignflow.stages', run_name='__main__', alter_sys=True)\n"
    )
    for stage, imported in (("data", "no-llama"), ("sft", "llama")):
        done = subprocess.run([sys.executable, "-c", script, stage, "--spec", str(tmp_path / "missing.json")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stdout.split()[-2:] == [imported, "True"], (stage, done.stdout, done.stderr[-1000:])
