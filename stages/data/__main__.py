"""`python -m alignflow.stages.data --spec SPEC`: the data stage's entry point."""

import sys

from alignflow.stages.data.stage import main

if __name__ == "__main__":
    sys.exit(main())
