"""alignflow: the torch-free core the flows and stages share (config, storage, manifests, tracking, CLI)."""

__version__ = "0.1.0"
