"""What the stage programs share: the stage runtime and ranks, devices, the profiler, the warm stage process,
tokenization, the rollout table, reward scoring, and the generation/, models/ and training/ libraries."""
