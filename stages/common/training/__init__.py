"""Training plumbing shared by the SFT, reward and RL stages (DeepSpeed set-up, schedules, batching)."""
