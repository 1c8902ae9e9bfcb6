"""Generation engines: one interface (base.py), backends chosen by name (native, hf, vllm, tensorrt-llm).

    engine = build_engine(checkpoint_dir, engine_config)          # EngineConfig from alignflow.config
    gen = engine.generate(prompt_token_ids, SamplingParams(temperature=1.0, max_new_tokens=32, seeds=[...]))
    engine.refit(model.named_parameters())                        # stream of (HF name, tensor), in place
    engine.unload(); ...; engine.reload()                         # free memory between rollouts
    engine.save(dir); load_engine(dir)

Importing this package does not import torch; backends are imported when first built.
"""

from alignflow.stages.common.generation.interface import (
    ENGINE_BACKENDS,
    BackendUnavailableError,
    Engine,
    EngineError,
    FinishReason,
    Generation,
    ParityReport,
    RefitError,
    RefitStats,
    SamplingParams,
    UnsupportedArchitectureError,
    build_engine,
    check_greedy_parity,
    engine_class,
    load_engine,
)

__all__ = [
    "ENGINE_BACKENDS",
    "BackendUnavailableError",
    "Engine",
    "EngineError",
    "FinishReason",
    "Generation",
    "ParityReport",
    "RefitError",
    "RefitStats",
    "SamplingParams",
    "UnsupportedArchitectureError",
    "build_engine",
    "check_greedy_parity",
    "engine_class",
    "load_engine",
]
