"""engine.gpu_decode_kernels: triton: the static (CUDA-graph) decode step on kernels/decode_step.py's fused
ops generates what the eager step does. Captured as CUDA graphs under --device cuda; under --device cpu the
same static step runs eagerly with the kernels in Triton's interpreter."""

from __future__ import annotations

import pytest
from engine_test_models import ARCHITECTURES, assert_generates_alike, engine_config, random_prompts

from alignflow.config import GPU_FUSED_OPS, EngineConfig
from alignflow.kernels import decode_step
from alignflow.stages.common.generation import SamplingParams
from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native import engine as native_engine
from alignflow.stages.common.generation.native.engine import fused_ops_path
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


@pytest.mark.parametrize(
    "fused_ops", [[], ["live_attention"], ["rope_cache_write", "add_rms_norm", "silu_mul"]]
)
def test_a_subset_of_fused_ops_generates_what_the_eager_step_does(tiny_checkpoints, device, fused_kernels,
                                                                   fused_ops):
    """engine.gpu_fused_ops: the ops left out run as their torch references inside the fused step."""
    path = tiny_checkpoints["llama_gqa_tied_llama3"]
    fused = NativeEngine.build(
        path, engine_config(gpu_decode_kernels="triton", gpu_fused_ops=fused_ops), device=device
    )
    fused._use_graphs = True
    eager = NativeEngine.build(path, engine_config(), device=device)
    assert fused.model.fused_impl == {
        op: "triton" if op in fused_ops else "torch" for op in decode_step.FUSED_OPS
    }
    assert_generates_alike(fused, eager, random_prompts(3, seed=4), SAMPLED)


def test_the_fused_step_calls_each_op_with_its_configured_impl(tiny_checkpoints, monkeypatch):
    """The routing alone, without Triton: each op of every layer runs the impl engine.gpu_fused_ops gives."""
    calls: dict[str, set[str]] = {op: set() for op in decode_step.FUSED_OPS}
    for op in decode_step.FUSED_OPS:
        reference = getattr(decode_step, op)

        def recording(*args, _op=op, _reference=reference, impl="auto", **kwargs):
            calls[_op].add(impl)
            return _reference(*args, impl="torch", **kwargs)

        monkeypatch.setattr(decode_step, op, recording)
    engine = NativeEngine.build(
        tiny_checkpoints["llama_gqa_tied_llama3"],
        engine_config(gpu_decode_kernels="triton", gpu_fused_ops=["live_attention", "silu_mul"]),
    )
    engine._use_graphs = True
    engine.generate(random_prompts(2, seed=5), SAMPLED)
    assert calls == {"rope_cache_write": {"torch"}, "live_attention": {"triton"}, "add_rms_norm": {"torch"},
                     "silu_mul": {"triton"}}


def test_execution_paths_name_the_fused_and_the_reference_ops():
    assert tuple(native_engine._FUSED_OP_WORDS) == decode_step.FUSED_OPS  # a word for every op, in its order
    assert fused_ops_path(list(decode_step.FUSED_OPS)) == (
        ", fused Triton ops (RoPE + cache write, attention over the live length, add + RMSNorm, SiLU x up: "
        "kernels/decode_step.py)"
    )
    assert fused_ops_path(["silu_mul"]) == (
        ", fused Triton ops (SiLU x up: kernels/decode_step.py), torch references for RoPE + cache write, "
        "attention over the live length, add + RMSNorm"
    )
    assert "fused Triton ops (none" in fused_ops_path([])


def test_the_config_names_the_kernels_fused_ops():
    assert GPU_FUSED_OPS == decode_step.FUSED_OPS
    assert EngineConfig().gpu_fused_ops == list(decode_step.FUSED_OPS)
    with pytest.raises(ValueError, match="live_attention more than once"):
        EngineConfig(gpu_fused_ops=["live_attention", "silu_mul", "live_attention"])
    with pytest.raises(ValueError, match="gpu_fused_ops"):
        EngineConfig(gpu_fused_ops=["flash_attention"])
