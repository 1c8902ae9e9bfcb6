"""`python -m alignflow.stages.dpo --spec SPEC`: the DPO stage's entry point."""

from alignflow.stages.common.runtime import run_program
from alignflow.stages.dpo.stage import main

if __name__ == "__main__":
    run_program(main)
