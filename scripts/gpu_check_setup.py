"""Set a bare machine up for scripts/gpu_check.sh: carried wheels into a private folder, alignflow importable.

    python scripts/gpu_check_setup.py --target DIR [--wheels .whl] [--device cuda] [--result FILE]

Then `PYTHONPATH=DIR` gives every process of the check the wheels and the package names. Standard library
only: it runs before anything is installed.

- Wheels: each wheel in --wheels is installed into DIR only where this interpreter lacks its package (a
  package the machine has is never replaced; torch is never carried), plus any package that a wheel being
  installed pins to exactly the carried version (pydantic pins pydantic-core). `pip install --no-index
  --no-deps --target DIR` when pip is there, else the wheels are unzipped into DIR (what pip does for pure and
  platform wheels alike).
- alignflow: the distribution maps alignflow.flows, .stages and .kernels to the top-level folders flows/,
  stages/ and kernels/ (pyproject.toml's package-dir). Where this checkout is not installed
  (`pip install -e .`), DIR gets a sitecustomize.py with an import finder that maps those names onto this
  checkout, which is all an editable install adds. Chosen over
  `pip install --no-build-isolation -e . --target`: that needs setuptools and wheel in the interpreter,
  builds metadata, and a --target editable install is not something pip promises to support; the finder
  needs nothing and leaves no trace outside DIR.
- Checks, in a fresh interpreter with PYTHONPATH=DIR: torch >= 2.4 (and a GPU under --device cuda),
  alignflow's config and contract (pydantic), and that every module the steps need is found (trl only for the
  RL step).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import zipfile
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"alignflow": "alignflow", "alignflow.flows": "flows", "alignflow.stages": "stages",
                "alignflow.kernels": "kernels"}
# What the steps import (found, not imported: importing deepspeed alone takes seconds). trl and datasets: the
# RL step's baseline, which reports "not run" without them.
NEEDED = (
    "torch",
    "transformers",
    "tokenizers",
    "safetensors",
    "yaml",
    "pydantic",
    "pyarrow",
    "numpy",
    "rich",
    "pytest",
    "deepspeed",
    "psutil",
    "peft",
    "accelerate",
    "matplotlib",
)
OPTIONAL = ("trl", "datasets", "triton")

SITECUSTOMIZE = '''"""Written by scripts/gpu_check_setup.py: alignflow's package-dir mapping onto {repo}
(what an editable install adds).

Maps {names} to their folders in that checkout, then runs any other sitecustomize this one shadows.
"""

import importlib.machinery
import importlib.util
import os
import sys

_DIRS = {dirs!r}


class _AlignflowFinder:
    """Finds alignflow and its mapped packages in the checkout; submodules come from their __path__ as
    usual."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        folder = _DIRS.get(name)
        if folder is None:
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(folder, "__init__.py"),
                                                      submodule_search_locations=[folder])


sys.meta_path.insert(0, _AlignflowFinder)

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
'''

CHECK = r"""
import importlib.util, json, sys
out = {"python": sys.version.split()[0]}
try:
    import torch
    out["torch"] = torch.__version__
    out["cuda"] = torch.cuda.is_available()
    out["gpu"] = torch.cuda.get_device_name(0) if out["cuda"] else None
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    import alignflow.config, alignflow.contract
    out["alignflow"] = importlib.util.find_spec("alignflow.stages").origin
except Exception as exc:
    out["alignflow_error"] = f"{type(exc).__name__}: {exc}"
def found(name):
    try:
        return importlib.util.find_spec(name) is not None
    except Exception:
        return False
out["found"] = {name: found(name) for name in sys.argv[1:]}
print(json.dumps(out))
"""


def wheel_name(path: Path) -> tuple[str, str]:
    """(normalised distribution name, version) from a wheel's file name."""
    dist, version = path.name.split("-")[:2]
    return normalise(dist), version


def fits_this_python(path: Path) -> bool:
    """Whether a wheel's Python and ABI tags fit this interpreter (a .whl/ made for the GPU machine's Python
    may hold wheels this one cannot install; the platform tag is taken on trust: Linux x86-64)."""
    python_tags, abi = path.name[: -len(".whl")].split("-")[-3:-1]
    version = f"{sys.version_info.major}{sys.version_info.minor}"
    return any(
        tag in ("py3", f"py{version}", f"cp{version}")
        or (abi == "abi3" and tag.startswith("cp3") and int(tag[3:] or 0) <= sys.version_info.minor)
        for tag in python_tags.split(".")
    )


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def exact_pins(path: Path) -> dict[str, str]:
    """Requirements of a wheel pinned to one version ('pydantic-core==2.50.5'),
    extras and markers left out."""
    with zipfile.ZipFile(path) as wheel:
        name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        text = wheel.read(name).decode()
    pins = {}
    for line in text.splitlines():
        match = re.match(r"Requires-Dist:\s*([A-Za-z0-9_.\-]+)\s*\(?==\s*([^,;\s)]+)\)?\s*$", line)
        if match:
            pins[normalise(match.group(1))] = match.group(2)
    return pins


def choose(wheels: list[Path]) -> tuple[list[Path], dict[str, str]]:
    """The wheels to install, and for each one kept out the version the machine has."""
    by_name = {wheel_name(w)[0]: w for w in wheels}
    install = {name for name in by_name if installed_version(name) is None}
    changed = True
    while changed:  # a wheel being installed that pins another carried one exactly takes that one too
        changed = False
        for name in sorted(install):
            for pinned, version in exact_pins(by_name[name]).items():
                if pinned in by_name and pinned not in install and installed_version(pinned) != version:
                    install.add(pinned)
                    changed = True
    kept = {name: installed_version(name) for name in by_name if name not in install}
    return sorted(by_name[n] for n in install), kept


def install(wheels: list[Path], target: Path) -> str:
    """Install `wheels` into `target` (pip if this interpreter has it, else unzip); returns the method."""
    if not wheels:
        return "nothing to install"
    if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
        unzip(wheels, target)
        return "unzip (no pip here)"
    # The user's pip configuration (an index, constraints) has no say here: the wheels are all there is.
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-index",
        "--no-deps",
        "--no-compile",
        "--no-cache-dir",
        "--upgrade",
        "--target",
        str(target),
        *map(str, wheels),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"pip install --target {target} failed:\n{done.stderr[-2000:]}")
    return "pip"


def unzip(wheels: list[Path], target: Path) -> None:
    """What `pip install --target` does with a wheel, for an interpreter without pip: its files into `target`;
    a <name>.data/{purelib,platlib} folder's contents beside the packages (scripts and headers are not
    needed)."""
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(target)
        for data in target.glob("*.data"):
            for lib in ("purelib", "platlib"):
                for item in (data / lib).glob("*") if (data / lib).is_dir() else []:
                    item.rename(target / item.name)


def needs_finder() -> bool:
    """Whether this interpreter lacks alignflow.stages from this checkout."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("alignflow.stages")
    except ImportError:
        return True
    return (
        spec is None or spec.origin is None or Path(spec.origin).resolve() != REPO / "stages" / "__init__.py"
    )


def write_finder(target: Path) -> Path:
    dirs = {name: str(REPO / folder) for name, folder in PACKAGE_DIRS.items()}
    path = target / "sitecustomize.py"
    path.write_text(SITECUSTOMIZE.format(repo=REPO, names=", ".join(PACKAGE_DIRS), dirs=dirs))
    return path


def check(target: Path) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [sys.executable, "-c", CHECK, *NEEDED, *OPTIONAL], capture_output=True, text=True, env=env, cwd=REPO
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip()[-1000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text.split("+")[0])[:2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--target", type=Path, required=True, help="private folder for the wheels (PYTHONPATH)"
    )
    parser.add_argument("--wheels", type=Path, default=REPO / ".whl")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--result", type=Path, default=None, help="write this step's JSON object here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    args.target.mkdir(parents=True, exist_ok=True)
    carried = sorted(args.wheels.glob("*.whl")) if args.wheels.is_dir() else []
    wheels = [w for w in carried if fits_this_python(w)]
    for wheel in sorted(set(carried) - set(wheels)):
        print(f"  skip {wheel.name}: built for another Python than {sys.version.split()[0]}")
    chosen, kept = choose(wheels)
    print(
        f"{len(carried)} carried wheels ({sum(w.stat().st_size for w in carried) / 2**20:.1f} MiB) in "
        f"{args.wheels}, {len(wheels)} for this Python; installing {len(chosen)} into {args.target}"
    )
    for name, version in sorted(kept.items()):
        print(f"  kept {name} {version} (the machine's)")
    for wheel in chosen:
        print(f"  install {wheel.name}")
    problems = []
    try:
        method = install(chosen, args.target)
    except RuntimeError as exc:
        method, problems = "failed", [str(exc)]
    finder = needs_finder()
    if finder:
        print(
            f"alignflow is not installed here: {write_finder(args.target)} maps {', '.join(PACKAGE_DIRS)} "
            f"onto {REPO}"
        )
    found = check(args.target)
    print(json.dumps(found, indent=2))
    if "error" in found:
        problems.append(f"the check interpreter failed: {found['error']}")
    else:
        if "torch_error" in found:
            problems.append(f"torch does not import: {found['torch_error']}")
        elif version_tuple(found["torch"]) < (2, 4):
            problems.append(f"torch {found['torch']} is older than 2.4")
        elif args.device == "cuda" and not found.get("cuda"):
            problems.append(f"--device cuda, but torch {found['torch']} sees no GPU")
        if "alignflow_error" in found:
            problems.append(f"alignflow does not import: {found['alignflow_error']}")
        missing = [name for name in NEEDED if not found["found"].get(name)]
        if missing:
            problems.append(
                f"not found: {', '.join(missing)} (make gpu-wheels carries the missing ones but pyarrow)"
            )
    optional_missing = [name for name in OPTIONAL if not found.get("found", {}).get(name)]
    status = "fail" if problems else "pass"
    summary = (
        "; ".join(problems)
        if problems
        else (
            f"torch {found['torch']}"
            + (f" on {found['gpu']}" if found.get("gpu") else "")
            + f", {len(chosen)} wheels installed ({method}), {len(kept)} kept"
            + (", alignflow via import finder" if finder else "")
            + (f"; optional missing: {', '.join(optional_missing)}" if optional_missing else "")
        )
    )
    print(f"setup: {status}: {summary}")
    result = {
        "step": "setup",
        "status": status,
        "summary": summary,
        "seconds": round(time.perf_counter() - started, 1),
        "figures": {
            "wheels": len(carried),
            "wheels_mib": round(sum(w.stat().st_size for w in carried) / 2**20, 1),
            "other_python": len(carried) - len(wheels),
            "installed": [wheel_name(w)[0] for w in chosen],
            "kept": kept,
            "method": method,
            "import_finder": finder,
            "torch": found.get("torch"),
            "gpu": found.get("gpu"),
            "optional_missing": optional_missing,
        },
    }
    if args.result is not None:
        args.result.write_text(json.dumps(result))
    return 0 if status == "pass" else 1


if __name__ == "__main__":
    raise SystemExit(main())
