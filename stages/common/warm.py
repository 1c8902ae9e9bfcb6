"""`python -m alignflow.stages.common.warm`: a stage process that imports the ML stack, then runs a stage.

What it is for: start-up. A stage process spends seconds importing torch, transformers and the stage's
modules before it reads its spec (docs/performance.md#start-up); the flow starts this process while it
is still importing Prefect and starting Prefect's server, so that time is spent in parallel. When a
stage is launched, the flow writes one JSON line to its stdin, `{"stage": name, "argv": [...], "env":
{...}}` (variables to set, or unset when null, before the stage runs: those the flow set after this
process started, and ALIGNFLOW_LAUNCHED_AT),
and the process runs the stage program's `main(argv)` (alignflow.contract.STAGE_PROGRAMS) exactly as
`python -m alignflow.stages <name>` would: same stdout, stderr, exit code. What it is not: a
long-lived server; it runs one stage and exits, and if its environment differs from the one the
flow launches with, the flow starts a cold process instead (flows/launch.py).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

from alignflow import console
from alignflow.contract import STAGE_PROGRAMS, stage_program
from alignflow.import_gc import imports_without_gc
from alignflow.stages.common import forking

# The heavy imports every ML stage makes (all but the data stage's), in the order they come; after torch and
# transformers, the costly ones are transformers' weight-loading machinery and the tokenizer classes
# (`python -X importtime` shows each one's share). Most come lazily, in a stage's setup (transformers' first
# use).
ML_STACK = ("torch", "transformers", "safetensors.torch", "alignflow.stages.common.runtime",
            "alignflow.stages.common.models.loading", "alignflow.stages.common.generation.interface",
            "transformers.core_model_loading", "transformers.models.auto.modeling_auto",
            "transformers.models.llama.modeling_llama",
            "transformers.models.auto.tokenization_auto", "transformers.tokenization_utils_tokenizers")
STAGES = tuple(STAGE_PROGRAMS)


def import_all(names: tuple[str, ...]) -> None:
    """Import these modules (one another version of a library lacks is skipped: it only costs time)."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            continue


def warm_up() -> None:
    """Import what the stages will: the ML stack, MLflow with its SQL store, every stage program."""
    import_all((*ML_STACK, "alignflow.tracking", *(stage_program(stage) for stage in STAGES)))
    from alignflow import tracking

    tracking.preload()


def run_request(line: str) -> int:
    """Run the stage a request line names; returns its exit code."""
    try:
        request = json.loads(line)
        stage, argv = request["stage"], list(request["argv"])
        env_changes = dict(request.get("env") or {})
    except (ValueError, KeyError, TypeError) as exc:
        print(f"error: warm stage process: bad request {line[:200]!r} ({exc})", file=sys.stderr, flush=True)
        return 2
    if stage not in STAGES:
        print(
            f"error: warm stage process: unknown stage '{stage}'; stages: {', '.join(STAGES)}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    for name, value in env_changes.items():  # variables read at run time (flows/launch.py decides which)
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(value)
    module = importlib.import_module(stage_program(stage))
    sys.argv = [stage_program(stage), *argv]
    return int(module.main(argv) or 0)


def main() -> int:
    console.quiet()  # before the imports: some libraries read their switches then
    with imports_without_gc():  # and their objects out of every later collection (alignflow/import_gc.py)
        warm_up()
    forking.mark_clean()  # nothing has computed: a stage may fork torch workers (stages/common/forking.py)
    line = sys.stdin.readline()
    if not line.strip():  # the flow ended without using this process
        return 0
    return run_request(line)


if __name__ == "__main__":
    exit_code = main()
    # Imported here, not above: main quiets the libraries before their first import.
    from alignflow.process_exit import end_process

    end_process(exit_code)
