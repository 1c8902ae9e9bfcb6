"""`python -m alignflow.stages.ppo --spec SPEC`: the RL stage's entry point (PPO or GRPO: ppo.algorithm)."""

from alignflow.stages.common.runtime import run_program
from alignflow.stages.ppo.stage import main

if __name__ == "__main__":
    run_program(main)
