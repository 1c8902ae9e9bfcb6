"""The DPO stage (stage.py) and its preference losses as pure functions (losses.py): preference optimisation
without a reward model."""
