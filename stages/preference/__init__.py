"""Preference optimisation without a reward model: DPO and its variants (losses as pure functions, the stage in stages/dpo.py)."""
