"""The TensorRT-LLM backend: checkpoint conversion and resharding (checkpoint.py, torch only), the engine.

Importing this package never imports tensorrt_llm; only building or loading an engine does.
"""
