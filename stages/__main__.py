"""`python -m alignflow.stages <stage> --spec SPEC [--force]`: run a stage by its name (the containers' and
Kubernetes jobs' entry point, and the flow's for a stage process it starts cold), exactly as its program's
`python -m` would, with its imports made faster: the ML stack a stage's setup imports (torch, transformers'
model and tokenizer classes: stages/common/warm.py) is imported first, and the collector is off until the
program's run_program (next after its imports) freezes what they made and turns it on again
(alignflow/import_gc.py: ~18% of the imports' time)."""

import gc
import runpy
import sys

from alignflow.contract import STAGE_PROGRAMS, stage_program

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in STAGE_PROGRAMS:
        print(
            "usage: python -m alignflow.stages <stage> --spec SPEC [--force] [--rollout-node I (ppo)]; "
            "stages: "
            f"{', '.join(STAGE_PROGRAMS)}",
            file=sys.stderr,
        )
        sys.exit(2)
    stage, program = sys.argv[1], stage_program(sys.argv[1])
    sys.argv = [program, *sys.argv[2:]]
    gc.disable()
    if stage != "data":  # the one stage without models; the others' setup would import this lazily
        from alignflow.stages.common.warm import ML_STACK, import_all

        import_all(ML_STACK)
    runpy.run_module(program, run_name="__main__", alter_sys=True)
