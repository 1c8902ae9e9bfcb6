"""`make gpu-check` (scripts/gpu_check.sh) in its CPU mode, so that it cannot rot between GPU runs: every step
runs at tiny sizes and leaves its JSON line, and the summary table comes last; plus its setup and bookkeeping
alone."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import gpu_check_setup  # noqa: E402  (a script beside gpu_check.sh, not a package)

STEPS = ["setup", "tests", "engine", "pipeline", "rl", "fusions"]
# One quick test file: the step's mechanics (pytest under --device, its JUnit counts), not the suite again.
TESTS = "tests/stages/dpo/test_dpo_losses.py"


# Heavy (2 min): each step's script has its own test (tests/test_benchmarks.py, the pipeline's); this one
# checks the glue. Before a session with a GPU: make heavy-test PYTEST_ARGS=tests/test_gpu_check.py
@pytest.mark.heavy
def test_cpu_mode_runs_every_step_and_prints_the_summary(tmp_path):
    out, work, wheels = tmp_path / "out", tmp_path / "work", tmp_path / "wheels"
    # none: what a `make gpu-wheels` left in .whl/ (for the GPU machine's Python) stays out of it
    wheels.mkdir()
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    command = [
        "bash",
        str(REPO / "scripts/gpu_check.sh"),
        "--device",
        "cpu",
        "--out",
        str(out),
        "--workdir",
        str(work),
        "--tests",
        TESTS,
        "--wheels",
        str(wheels),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    lines = {line["step"]: line for line in map(json.loads, (out / "figures.jsonl").read_text().splitlines())}
    assert list(lines) == STEPS
    assert all((out / f"{step}.log").is_file() and lines[step]["seconds"] > 0 for step in STEPS)
    assert "gpu-check on cpu" in done.stdout and all(f"│ {step}" in done.stdout for step in STEPS)
    assert done.stdout.rstrip().splitlines()[-1].startswith("figures: ")

    assert lines["setup"]["status"] == "pass" and lines["setup"]["figures"]["torch"]
    tests = lines["tests"]["figures"]
    assert (
        lines["tests"]["status"] == "pass"
        and tests["passed"] > 0
        and tests["failures"] == tests["errors"] == 0
    )

    engine = lines["engine"]["figures"]
    assert lines["engine"]["status"] == "pass" and engine["device"] == "cpu" and engine["bandwidth_gbs"] > 0
    rows = {(r["engine"], r["batch"]) for r in engine["rows"]}
    assert {("native", 1), ("native", 8), ("hf", 1), ("hf", 8)} <= rows
    assert all(0 < r["roofline_pct"] < 100 and r["tokens_per_s"] > 0 for r in engine["rows"])

    pipeline = lines["pipeline"]["figures"]
    assert lines["pipeline"]["status"] == "pass", lines["pipeline"]["summary"]
    assert set(pipeline["stages"]) == {
        "data",
        "base",
        "sft",
        "reward-rm",
        "engine",
        "ppo",
        "evaluate",
        "ppo (grpo)",
        "evaluate (grpo)",
    }
    assert all(s["status"] in ("ok", "skipped") for s in pipeline["stages"].values())
    assert all(isinstance(pipeline["gold_gain"][run]["gold_delta"], float) for run in ("ppo", "grpo"))
    if pipeline["devices_recorded"]:  # StageResult.devices: where each role computed
        assert set(pipeline["stages"]["ppo"]["devices"].values()) == {"cpu"}

    fusions = lines["fusions"]
    assert fusions["status"] == "pass", fusions["summary"]
    cells = {(r["row"], r["batch"]): r for r in fusions["figures"]["rows"]}
    assert {("eager ops", 1), ("+ silu_mul", 2), ("+ sampler in graph", 2)} <= set(cells)
    assert cells["eager ops", 1]["bought_ms"] is None and cells["+ silu_mul", 2]["ms_per_token_step"] > 0

    rl = lines["rl"]
    assert rl["figures"]["alignflow"]["completions_per_s"] > 0
    # The stage's model TFLOP/s; no MFU on a CPU (no data-sheet peak), nor in the summary.
    perf = rl["figures"]["alignflow"]["perf"]
    assert perf["tflops/train"] > 0 and perf["tflops/generate"] > 0 and "mfu/train" not in perf
    assert "MFU" not in rl["summary"]
    if importlib.util.find_spec("trl") is None:
        assert rl["status"] == "not run" and "not run: trl not installed" in rl["summary"]
        assert "not run: rl" in done.stdout
    else:
        assert rl["status"] == "pass" and rl["figures"]["ratio"] > 0


def test_setup_installs_only_what_is_missing_and_maps_alignflow(tmp_path):
    """A carried wheel of an installed package is kept out unless a wheel being installed pins it exactly; the
    import finder maps alignflow.stages (and its subpackages) onto this checkout and runs a shadowed
    sitecustomize."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()

    def wheel(name: str, version: str, requires: tuple[str, ...] = ()) -> Path:
        path = wheels / f"{name}-{version}-py3-none-any.whl"
        info = f"{name}-{version}.dist-info"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"{name}/__init__.py", f"VERSION = {version!r}\n")
            archive.writestr(
                f"{info}/METADATA",
                "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
                    name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)
                ),
            )
            archive.writestr(
                f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
            )
            archive.writestr(f"{info}/RECORD", "")
        return path

    wheel("gpucheck_probe", "1.0", ("pyyaml==0.1", "rich>=1"))
    wheel("pyyaml", "0.1")  # pinned by the probe, and the machine's differs: installed too
    wheel("rich", "0.1")  # the machine has rich: kept
    chosen, kept = gpu_check_setup.choose(sorted(wheels.glob("*.whl")))
    assert [p.name.split("-")[0] for p in chosen] == ["gpucheck_probe", "pyyaml"]
    assert set(kept) == {"rich"}

    target = tmp_path / "site"
    target.mkdir()
    assert gpu_check_setup.install(chosen[:1], target) in ("pip", "unzip (no pip here)")
    assert (target / "gpucheck_probe" / "__init__.py").is_file()
    gpu_check_setup.unzip(chosen[:1], tmp_path / "unzipped")  # a machine without pip
    assert (tmp_path / "unzipped" / "gpucheck_probe" / "__init__.py").read_text() == "VERSION = '1.0'\n"
    gpu_check_setup.write_finder(target)
    shadowed = tmp_path / "other"
    shadowed.mkdir()
    (shadowed / "sitecustomize.py").write_text(
        "import builtins\nbuiltins.SHADOWED_SITECUSTOMIZE_RAN = True\n"
    )
    # -S: no site-packages, so no editable install of alignflow; the finder alone must find it.
    code = (
        "import sys; sys.path[:0] = [sys.argv[1], sys.argv[2]]; import sitecustomize, builtins, "
        "importlib.util; print(importlib.util.find_spec('alignflow.stages.common.generation').origin); "
        "print(getattr(builtins, 'SHADOWED_SITECUSTOMIZE_RAN', False))"
    )
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(target), str(shadowed)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(REPO / "stages" / "common" / "generation" / "__init__.py"), "True"]


def test_summary_fails_on_a_timed_out_or_failed_step(tmp_path):
    figures, junit = tmp_path / "figures.jsonl", tmp_path / "junit.xml"
    junit.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="t" name="a"><failure/></testcase></testsuite></testsuites>'
    )
    steps = REPO / "scripts" / "gpu_check_steps.py"

    def record(step: str, rc: int, *extra: str) -> None:
        subprocess.run(
            [
                sys.executable,
                str(steps),
                "record",
                step,
                "--rc",
                str(rc),
                "--seconds",
                "1.5",
                "--budget",
                "10",
                "--figures",
                str(figures),
                *extra,
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )

    record("tests", 1, "--result", str(junit))
    record("pipeline", 124)
    lines = [json.loads(line) for line in figures.read_text().splitlines()]
    assert lines[0]["summary"] == "1 passed, 1 skipped, 1 failed, 0 errors" and lines[0]["status"] == "fail"
    assert lines[0]["figures"]["failed_tests"] == ["t::a"]
    assert lines[1]["status"] == "timeout" and lines[1]["summary"].startswith("over its 10 s budget")
    done = subprocess.run(
        [sys.executable, str(steps), "summary", "--figures", str(figures)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "FAILED: tests, pipeline" in done.stdout


def test_fusions_line_fails_a_row_that_left_its_graph_or_its_kernels(tmp_path):
    """A capture that failed makes the engine decode eagerly: that row measured something its label is not."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check_steps
    finally:
        sys.path.remove(str(REPO / "scripts"))
    graph = "CUDA graph per batch bucket"
    fused = ", fused Triton ops (RoPE + cache write: kernels/decode_step.py)"

    def line(tmp_path, paths: dict[str, str]):
        rows = [{"batch": 1, "row": label, "ms_per_token_step": 1.0, "roofline_pct": 50.0, "bought_ms": None,
                 "decode_step": path} for label, path in paths.items()]
        result = tmp_path / "fusions.json"
        result.write_text(json.dumps({"model": "llama-1b", "device": "cuda", "bandwidth_gbs": 4300.0,
                                      "rows": rows}))
        return gpu_check_steps.fusions_line(result, 0)

    good = line(tmp_path, {"eager ops": graph, "+ rope_cache_write": graph + fused})
    assert good["status"] == "pass" and good["summary"].startswith("llama-1b b1: eager ops 1.000 ms 50.0%")
    fell_back = line(tmp_path, {"eager ops": graph, "+ rope_cache_write": "eager"})
    assert fell_back["status"] == "fail"
    assert fell_back["summary"].startswith("rows not on the step they name: + rope_cache_write b1")
    unfused = line(tmp_path, {"eager ops": graph, "+ rope_cache_write": graph})
    assert unfused["status"] == "fail"

