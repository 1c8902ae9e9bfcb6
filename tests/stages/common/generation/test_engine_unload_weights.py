"""unload() that frees the weights too (the RL stage's engine.unload_during_training on a GPU): after reload
and a refit, full or partial (LoRA's: a subset of names), the engine generates what a fresh build of those
weights does.

On a GPU an engine offloads its weights by default; on a CPU it keeps them (host memory is where they are), so
the tests set `offload_weights` there to run the GPU's path: the weights copied out, the device buffers freed,
new buffers at reload. keep_weights=False (discarded, a full refit must follow) is the same on every device.
"""

from __future__ import annotations

import pytest
from engine_test_models import TOLERANCES, engine_config, perturbed_checkpoint, random_prompts

from alignflow.stages.common.generation import RefitError, SamplingParams, build_engine
from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native.weights import checkpoint_tensors

SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=10, seed=7)
ARCH = "llama_bias_yarn"  # untied embeddings and every bias: each kind of buffer must come back
# The partial refit (LoRA's shape): the adapted modules' merged weights only, q/v of layer 0 and the MLP of
# layer 1.
ADAPTED = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.v_proj.weight",
           "model.layers.1.mlp.gate_proj.weight", "model.layers.1.mlp.down_proj.weight")


@pytest.fixture(scope="module")
def moved(tiny_checkpoints, tmp_path_factory):
    """The architecture's checkpoint after 'a PPO step' (every weight moved)."""
    return perturbed_checkpoint(tiny_checkpoints[ARCH], tmp_path_factory.mktemp("unload") / "moved")


def weight_bytes(engine) -> int:
    if isinstance(engine, NativeEngine):
        return engine.weights.nbytes()
    return sum(p.numel() * p.element_size() for p in engine.model.parameters())


def assert_same(got, want):
    assert got.response_token_ids == want.response_token_ids
    worst = max(
        abs(a - b)
        for x, y in zip(got.logprobs, want.logprobs, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert worst <= TOLERANCES["logprobs_fp32"]


@pytest.mark.parametrize("refit", ["full", "partial"])
@pytest.mark.parametrize("backend", ["native", "hf"])
def test_a_refit_after_offloading_the_weights_equals_a_fresh_build(
    tiny_checkpoints, moved, device, backend, refit
):
    base = tiny_checkpoints[ARCH]
    prompts = random_prompts(5, seed=3)
    engine = build_engine(base, engine_config(backend=backend), device=device)
    engine.offload_weights = True  # the default on a GPU; on a CPU it runs the GPU's path
    engine.generate(prompts, SAMPLED)
    size = weight_bytes(engine)

    stats = engine.unload()
    assert stats.weights == "offloaded" and stats.weight_bytes == size > 0
    # 2 layers x (K, V) x [8 rows, 2 KV heads, 64 slots, 16] fp32; hf: none
    assert stats.kv_cache_bytes == (
        engine_config().max_batch_size * 2 * 2 * 2 * 64 * 16 * 4 if backend == "native" else 0
    )
    assert engine.unload().weight_bytes == 0  # unloaded already: nothing more leaves the device
    engine.reload()

    if refit == "full":
        engine.refit(checkpoint_tensors(moved))
        want = build_engine(moved, engine_config(backend=backend), device=device).generate(prompts, SAMPLED)
    else:  # the rest of the weights must have come back from the host copy
        subset = [(n, t) for n, t in checkpoint_tensors(moved) if n in ADAPTED]
        engine.refit(iter(subset), partial=True)
        fresh = build_engine(base, engine_config(backend=backend), device=device)
        fresh.refit(iter(subset), partial=True)
        want = fresh.generate(prompts, SAMPLED)
    assert_same(engine.generate(prompts, SAMPLED), want)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_discarded_weights_take_a_full_refit_only(tiny_checkpoints, moved, device, backend):
    base = tiny_checkpoints[ARCH]
    prompts = random_prompts(5, seed=4)
    engine = build_engine(base, engine_config(backend=backend), device=device)
    size = weight_bytes(engine)
    stats = engine.unload(keep_weights=False)
    assert stats.weights == "discarded" and stats.weight_bytes == size
    engine.reload()
    subset = [(n, t) for n, t in checkpoint_tensors(moved) if n in ADAPTED]
    with pytest.raises(RefitError, match="partial refit into discarded weights"):
        engine.refit(iter(subset), partial=True)
    engine.refit(checkpoint_tensors(moved))
    assert_same(
        engine.generate(prompts, SAMPLED),
        build_engine(moved, engine_config(backend=backend), device=device).generate(prompts, SAMPLED),
    )


@pytest.mark.cpu_only("the default of a CPU engine; on a GPU the default offloads")
def test_a_cpu_engine_keeps_its_weights_in_place_by_default(tiny_checkpoints):
    engine = NativeEngine.build(tiny_checkpoints[ARCH], engine_config(), device="cpu")
    before = dict(engine.weights.buffers)
    kv = engine.cache.nbytes()
    stats = engine.unload()
    assert (stats.weights, stats.weight_bytes, stats.kv_cache_bytes) == ("kept", 0, kv)
    engine.reload()
    assert all(engine.weights.buffers[name] is t for name, t in before.items())


def test_captured_decode_steps_are_captured_again_after_reload(tiny_checkpoints, moved, device):
    """The CUDA-graph path's steps replay against the weights and cache of their capture (on CPU the stand-in
    does the same). reload() allocates both anew, so a step captured before must not be replayed after it:
    here it would decode with the old weights, and the tokens would differ from a fresh build's."""
    base = tiny_checkpoints[ARCH]
    prompts = random_prompts(5, seed=5)
    engine = NativeEngine.build(base, engine_config(cuda_graphs=True), device=device)
    engine._use_graphs = True  # on CPU: the static-shape step, eagerly
    engine.offload_weights = True
    engine.generate(prompts, SAMPLED)
    captured = dict(engine._graphs)
    assert captured
    engine.unload()
    assert not engine._graphs  # their memory goes with the KV cache
    engine.reload()
    engine.refit(checkpoint_tensors(moved))
    got = engine.generate(prompts, SAMPLED)
    assert all(engine._graphs[b] is not step for b, step in captured.items() if b in engine._graphs)
    assert_same(got, NativeEngine.build(moved, engine_config(), device=device).generate(prompts, SAMPLED))

    # The steps also check their capture against the current storage: one that survived a reload is captured
    # again.
    engine._graphs = dict(captured)
    assert_same(engine.generate(prompts, SAMPLED), got)


@pytest.mark.cpu_only("the packed weight copies and the C++ decode loop are the CPU engine's")
def test_the_cpu_engines_derived_weights_follow_the_offloaded_ones(tiny_checkpoints, tmp_path, monkeypatch):
    """The packed copies (keyed by the buffers' addresses) and the C++ loop's blocked ones are made again from
    the restored buffers at reload, before any refit: a generate right after reload uses them, not stale
    ones."""
    from alignflow.kernels import decode_loop as kernel
    from alignflow.stages.common.generation.native import prepack

    if not kernel.available():
        pytest.skip(f"no C++ decode loop here: {kernel.unavailable_reason()}")
    monkeypatch.setattr(prepack, "MIN_PACKED_BYTES", {"onednn": 0, "blocked": 0, "blocked-avx2": 0})
    path = tiny_checkpoints["llama_mha_untied"]  # the loop takes no o_proj bias
    config = engine_config(cpu_decode_loop=True)
    prompts = random_prompts(5, seed=6)
    engine = NativeEngine.build(path, config, device="cpu")
    assert engine._decode_loop is not None and engine._prepacked is not None
    engine.offload_weights = True
    want = engine.generate(prompts, SAMPLED)
    engine.unload()
    engine.reload()
    fallbacks = prepack.calls["fallback"]
    assert_same(engine.generate(prompts, SAMPLED), want)
    # the packed copies are current
    assert engine.forward_logits(prompts) and prepack.calls["fallback"] == fallbacks

    subset = [
        (n, t) for n, t in checkpoint_tensors(perturbed_checkpoint(path, tmp_path / "moved")) if n in ADAPTED
    ]
    engine.unload()
    engine.reload()
    engine.refit(iter(subset), partial=True)
    fresh = NativeEngine.build(path, config, device="cpu")
    fresh.refit(iter(subset), partial=True)
    assert_same(engine.generate(prompts, SAMPLED), fresh.generate(prompts, SAMPLED))
