"""The vLLM backend: vLLM's offline `LLM` behind the Engine interface (engine.py).

Importing this package never imports vllm; only building or loading an engine does. The trainer never
imports it: the engine stage and the RL stage's rollout worker processes do.
"""
