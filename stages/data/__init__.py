"""The data layer: dataset file formats (SFT, preferences, prompts) and the synthetic demo task; torch-free."""
