"""The ML programs: one module per stage (`main(argv) -> int`, `run(spec) -> StageResult`) and their library."""
