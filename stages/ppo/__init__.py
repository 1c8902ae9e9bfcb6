"""The RL stage (PPO and GRPO) and its parts, one module each; the package itself imports nothing.

The stage (stage.py), its losses as pure tensor functions (losses.py), scoring and advantages, the experience
record and its passes, the training loop, where the critic runs, checkpoints, KL controllers, reward
functions, and generation (rollout client, workers, writer).

Import the submodules directly; this package imports nothing so `kl_control` stays torch-free.
"""
