"""The data stage and its layer: dataset formats (SFT, preferences, prompts), the demo task; torch-free."""
