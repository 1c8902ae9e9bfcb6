"""RL library of the PPO/GRPO stage: pure tensor algorithms (algorithms.py) and KL controllers (kl_control.py).

Import the submodules directly; this package imports nothing so `kl_control` stays torch-free.
"""
