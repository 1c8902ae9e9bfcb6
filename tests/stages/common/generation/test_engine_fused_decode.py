"""engine.gpu_decode_kernels: triton: the static (CUDA-graph) decode step on kernels/decode_step.py's fused
ops generates what the eager step does. Captured as CUDA graphs under --device cuda; under --device cpu the
same static step runs eagerly with the kernels in Triton's interpreter."""

from __future__ import annotations

import pytest
from engine_test_models import ARCHITECTURES, assert_generates_alike, engine_config, random_prompts

from alignflow.stages.common.generation import SamplingParams
from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native.weights import checkpoint_tensors

SAMPLED = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11)


@pytest.fixture
def fused_kernels(device):
    """On CPU the kernels run in Triton's interpreter, which tests/conftest.py turns on before triton is
    first imported (a kernel module imported without it cannot run on CPU tensors)."""
    if device == "cpu":
        from alignflow.kernels._triton_dispatch import interpreter_requested

        assert interpreter_requested(), "TRITON_INTERPRET=1 must be set before triton is imported"


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_fused_static_decode_step_generates_what_the_eager_step_does(tiny_checkpoints, arch, device,
                                                                    fused_kernels):
    path = tiny_checkpoints[arch]
    fused = NativeEngine.build(path, engine_config(gpu_decode_kernels="triton"), device=device)
    fused._use_graphs = True  # on CPU: the static step without the capture (test_engine_lifecycle.py)
    eager = NativeEngine.build(path, engine_config(), device=device)
    if device == "cuda":
        assert "fused Triton ops" in fused.execution_paths()["decode_step"]
    for batch, seed in ((3, 1), (1, 2)):
        prompts = random_prompts(batch, seed=seed)
        b = assert_generates_alike(fused, eager, prompts, SAMPLED)
    fused.refit(checkpoint_tensors(path))  # the weights are read through the same buffers after a refit
    assert fused.generate(prompts, SAMPLED).response_token_ids == b.response_token_ids
