"""The native generation engine for the Llama family (Llama, Qwen2, Mistral); see engine.py."""

from alignflow.stages.common.generation.native.engine import NativeEngine
from alignflow.stages.common.generation.native.spec import LlamaFamilySpec, spec_from_hf_config

__all__ = ["LlamaFamilySpec", "NativeEngine", "spec_from_hf_config"]
