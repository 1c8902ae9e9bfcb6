"""The RL stage (PPO and GRPO) and its parts: the stage (stage.py), its losses as pure tensor functions
(losses.py), the experience record, KL controllers, reward functions, and the rollout workers.

Import the submodules directly; this package imports nothing so `kl_control` stays torch-free.
"""
