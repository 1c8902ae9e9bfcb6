"""Write containers/constraints.txt: the exact versions of the `[ml]` dependency closure, from a tested venv.

Run it in the environment the test suite passed in (`.venv/bin/python containers/make_constraints.py
> containers/constraints.txt`). torch and its CUDA/Triton wheels are left out on purpose: each
Dockerfile pins torch itself (TORCH_VERSION) and picks CPU or CUDA wheels with TORCH_INDEX_URL, and
a `+cpu` local version from a CPU venv would break a CUDA build. Not a requirements file: pip only
applies a constraint to a package something else asks for.
"""

from __future__ import annotations

import importlib.metadata as md
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# Chosen per image (TORCH_VERSION / TORCH_INDEX_URL build args), or build tools pip manages itself.
EXCLUDED_PREFIXES = ("torch", "triton", "nvidia-", "cuda-", "setuptools", "pip", "wheel", "alignflow")


def closure(root: str, extras: tuple[str, ...]) -> dict[str, str]:
    """Canonical name -> installed version for `root[extras]` and everything it needs, transitively."""
    found: dict[str, str] = {}
    pending: list[tuple[str, tuple[str, ...]]] = [(root, extras)]
    expanded: set[tuple[str, str]] = set()
    while pending:
        name, wanted = pending.pop()
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue  # an optional dependency for another platform or Python
        key = canonicalize_name(dist.metadata["Name"])
        found[key] = dist.version
        for extra in ("",) + wanted:
            if (key, extra) in expanded:
                continue
            expanded.add((key, extra))
            for raw in dist.requires or []:
                req = Requirement(raw)
                if (
                    req.marker is None
                    and extra == ""
                    or req.marker is not None
                    and req.marker.evaluate({"extra": extra})
                ):
                    pending.append((req.name, tuple(req.extras)))
    return found


def main() -> int:
    pins = closure("alignflow", ("ml",))
    if "alignflow" not in pins:
        print(
            "error: alignflow is not installed in this environment; run with the project venv "
            "(.venv/bin/python containers/make_constraints.py)",
            file=sys.stderr,
        )
        return 2
    print("# Versions the alignflow test suite passed with (alignflow[ml] closure, torch excluded).")
    print("# Regenerate: .venv/bin/python containers/make_constraints.py > containers/constraints.txt")
    for name in sorted(pins):
        if not name.startswith(EXCLUDED_PREFIXES):
            print(f"{name}=={pins[name]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
