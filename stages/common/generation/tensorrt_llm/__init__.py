"""The TensorRT-LLM backend: checkpoint conversion and resharding (checkpoint.py, torch only) and the engine (engine.py).

Importing this package never imports tensorrt_llm; only building or loading an engine does.
"""
