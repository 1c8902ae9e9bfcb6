"""alignflow: the torch-free core shared by the flows and the stages (config, storage, manifests, tracking, CLI)."""

__version__ = "0.1.0"
