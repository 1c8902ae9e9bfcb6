"""`python -m alignflow.stages.dpo --spec SPEC`: the DPO stage's entry point."""

import sys

from alignflow.stages.dpo.stage import main

if __name__ == "__main__":
    sys.exit(main())
