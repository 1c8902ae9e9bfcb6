"""`python -m alignflow.stages.data --spec SPEC`: the data stage's entry point."""

from alignflow.stages.common.runtime import run_program
from alignflow.stages.data.stage import main

if __name__ == "__main__":
    run_program(main)
