"""`python -m alignflow.stages.ppo --spec SPEC`: the RL stage's entry point (PPO or GRPO: ppo.algorithm)."""

import sys

from alignflow.stages.ppo.stage import main

if __name__ == "__main__":
    sys.exit(main())
