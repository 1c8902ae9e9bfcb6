"""save/load, unload/reload, interrupted generation, the build-time parity check, the compiled decode step."""

from __future__ import annotations

import json

import pytest
import torch
from engine_test_models import (
    TOLERANCES,
    assert_generates_alike,
    engine_config,
    perturbed_checkpoint,
    random_prompts,
)

from alignflow.stages.common.generation import (
    EngineError,
    SamplingParams,
    build_engine,
    check_greedy_parity,
    load_engine,
)
from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native.weights import checkpoint_tensors

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=16, seed=5)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_save_load_round_trip_gives_identical_output(tiny_checkpoints, tmp_path, backend, device):
    source = tiny_checkpoints["llama_gqa_tied_llama3"]
    (source / "tokenizer.json").write_text('{"stand-in": true}')  # the engine carries tokenizer files along
    engine = build_engine(source, engine_config(backend=backend, max_seq_len=48), device=device)
    prompts = random_prompts(5, seed=1)
    saved = engine.save(tmp_path / "engine")

    meta = json.loads((saved / "engine_config.json").read_text())
    assert (
        meta["backend"] == backend
        and meta["layout_version"] == 1
        and meta["engine_config"]["max_seq_len"] == 48
    )
    assert meta["tokenizer"] == "tokenizer" and (saved / "tokenizer" / "tokenizer.json").is_file()
    if backend == "native":  # weights are stored in the inference layout
        from safetensors import safe_open

        with safe_open(str(saved / "weights.safetensors"), framework="pt") as f:
            assert "qkv_w" in f.keys() and "gate_up_w" in f.keys() and "lm_head" not in f.keys()  # tied

    loaded = load_engine(saved, device=device)
    assert type(loaded) is type(engine) and loaded.eos_token_ids == engine.eos_token_ids
    for sampling in (GREEDY, SAMPLED):
        a, b = engine.generate(prompts, sampling), loaded.generate(prompts, sampling)
        assert a.response_token_ids == b.response_token_ids and a.logprobs == b.logprobs


def test_load_rejects_what_is_not_an_engine(tmp_path, tiny_checkpoints, device):
    with pytest.raises(FileNotFoundError, match="not a saved engine"):
        load_engine(tiny_checkpoints["llama_mha_untied"], device=device)
    saved = build_engine(tiny_checkpoints["llama_mha_untied"], engine_config(), device=device).save(
        tmp_path / "e"
    )
    meta = json.loads((saved / "engine_config.json").read_text())
    meta["layout_version"] = 99
    (saved / "engine_config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match="layout_version 99 but this code reads version 1; rebuild"):
        load_engine(saved, device=device)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_unload_reload_keeps_output_and_guards_generate(tiny_checkpoints, backend, device):
    path = tiny_checkpoints["mistral_linear_window"]
    engine = build_engine(path, engine_config(backend=backend), device=device)
    prompts = random_prompts(4, seed=2)
    want = engine.generate(prompts, SAMPLED)

    engine.unload()
    assert not engine.loaded
    if backend == "native":
        assert engine.cache is None  # the KV cache is freed
    with pytest.raises(EngineError, match=r"unloaded; call reload\(\)"):
        engine.generate(prompts, SAMPLED)
    engine.reload()
    assert engine.loaded
    assert engine.generate(prompts, SAMPLED).response_token_ids == want.response_token_ids

    # Discarding the weights: reload gives empty buffers, generate refuses until a full refit.
    engine.unload(keep_weights=False)
    with pytest.raises(EngineError, match=r"reload\(\) before refit"):
        engine.refit(checkpoint_tensors(path))
    engine.reload()
    with pytest.raises(EngineError, match="no valid weights"):
        engine.generate(prompts, SAMPLED)
    engine.refit(checkpoint_tensors(path))
    assert engine.generate(prompts, SAMPLED).response_token_ids == want.response_token_ids


def test_native_unload_frees_weights_when_asked(tiny_checkpoints, device):
    engine = NativeEngine.build(tiny_checkpoints["llama_mha_untied"], engine_config(), device=device)
    size = engine.weights.nbytes()
    engine.unload(keep_weights=False)
    assert engine.weights.nbytes() == 0 < size and engine.cache is None


def test_interrupted_generation_leaves_the_engine_usable(tiny_checkpoints, device):
    engine = NativeEngine.build(tiny_checkpoints["qwen2_bias_window"], engine_config(), device=device)
    prompts = random_prompts(3, seed=3)
    want = engine.generate(prompts, SAMPLED)

    decode, calls = engine._decode, []

    def interrupted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt  # what Ctrl-C mid-decode looks like
        return decode(*args, **kwargs)

    engine._decode = interrupted
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, SAMPLED)
    engine._decode = decode
    again = engine.generate(prompts, SAMPLED)
    assert again.response_token_ids == want.response_token_ids and again.logprobs == want.logprobs


def test_build_time_parity_check_against_hf(tiny_checkpoints, device):
    path = tiny_checkpoints["llama_bias_yarn"]
    report = check_greedy_parity(
        build_engine(path, engine_config(), device=device),
        build_engine(path, engine_config(backend="hf"), device=device),
        random_prompts(8, seed=4),
        max_new_tokens=12,
    )
    assert report.ok and report.sequences == 8 and report.first_mismatch is None


def test_padded_view_of_a_generation(tiny_checkpoints, device):
    engine = NativeEngine.build(tiny_checkpoints["llama_mha_untied"], engine_config(), device=device)
    gen = engine.generate(
        [[5, 6], [7]], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[0])
    )
    tokens, logprobs, lengths = gen.padded(pad_token_id=-1)
    assert tokens.shape == logprobs.shape == (2, max(gen.lengths))
    for b in range(2):
        assert tokens[b, : lengths[b]].tolist() == gen.response_token_ids[b]
        assert (tokens[b, lengths[b] :] == -1).all() and (logprobs[b, lengths[b] :] == 0).all()


@pytest.mark.slow
@pytest.mark.heavy
def test_compiled_decode_step_matches_eager_and_survives_refit(tiny_checkpoints, tmp_path, device):
    """torch.compile of the decode step and sampler (engine.compile) changes speed, not results; the
    compiled graphs read the weight buffers as inputs, so an in-place refit needs no recompile."""
    path = tiny_checkpoints["qwen2_bias_window"]
    prompts = random_prompts(3, seed=5)
    eager = NativeEngine.build(path, engine_config(), device=device).generate(
        prompts, SAMPLED, return_logits=True
    )
    engine = NativeEngine.build(path, engine_config(compile=True), device=device)
    compiled = engine.generate(prompts, SAMPLED, return_logits=True)
    assert compiled.response_token_ids == eager.response_token_ids
    worst = max((a - b).abs().max().item() for a, b in zip(compiled.logits, eager.logits, strict=True))
    assert worst <= TOLERANCES["logits_fp32"]
    # top-k with top-p: the compiled engine takes the thresholds from the eager top-k prefix.
    top_k = SAMPLED.model_copy(update={"top_k": 12})
    want = NativeEngine.build(path, engine_config(), device=device).generate(prompts, top_k)
    assert engine.generate(prompts, top_k).response_token_ids == want.response_token_ids

    perturbed = perturbed_checkpoint(path, tmp_path / "p")
    engine.refit(checkpoint_tensors(perturbed))
    want = NativeEngine.build(perturbed, engine_config(), device=device).generate(prompts, SAMPLED)
    assert want.response_token_ids != compiled.response_token_ids  # the refit has something to show
    assert engine.generate(prompts, SAMPLED).response_token_ids == want.response_token_ids


@pytest.mark.parametrize("arch", ["mistral_linear_window", "qwen2_bias_window", "llama_gqa_tied_llama3"])
def test_static_shape_decode_path_matches_eager(tiny_checkpoints, arch, device):
    """The CUDA-graph path's static buffers, tensor slot, full-length masks and batch buckets: captured as
    CUDA graphs under --device cuda, run eagerly under --device cpu (only the graph capture itself needs a
    GPU)."""
    path = tiny_checkpoints[arch]
    static = NativeEngine.build(path, engine_config(), device=device)
    static._use_graphs = True
    eager = NativeEngine.build(path, engine_config(), device=device)
    for batch, seed in ((3, 1), (5, 2), (1, 3), (3, 4)):  # buckets 4, 8, 1, then 4 again (reused)
        prompts = random_prompts(batch, seed=seed)
        b = assert_generates_alike(static, eager, prompts, SAMPLED)
    assert sorted(static._graphs) == [1, 4, 8]
    static.refit(checkpoint_tensors(path))  # in place: the static buffers and steps stay valid
    assert static.generate(prompts, SAMPLED).response_token_ids == b.response_token_ids


@pytest.mark.cuda_only("CUDA graphs need a GPU")
def test_cuda_graph_decode_matches_eager_on_gpu(tiny_checkpoints, device):
    path = tiny_checkpoints["mistral_linear_window"]
    prompts = random_prompts(5, seed=6)
    graphed = NativeEngine.build(path, engine_config(cuda_graphs=True), device=device)
    eager = NativeEngine.build(path, engine_config(cuda_graphs=False), device=device)
    a = graphed.generate(prompts, SAMPLED, return_logits=True)
    b = eager.generate(prompts, SAMPLED, return_logits=True)
    assert graphed._graphs, "no CUDA graph was captured"
    assert a.response_token_ids == b.response_token_ids
    worst = max((x - y).abs().max().item() for x, y in zip(a.logits, b.logits, strict=True))
    assert worst <= TOLERANCES["logits_fp32"]
    graphed.refit(checkpoint_tensors(path))  # in-place refit keeps the captured graphs valid
    assert graphed.generate(prompts, SAMPLED).response_token_ids == a.response_token_ids


def test_engine_dtype_comes_from_the_config_unless_given(tiny_checkpoints, device):
    path = tiny_checkpoints["llama_mha_untied"]
    assert build_engine(path, engine_config(dtype="bfloat16"), device=device).dtype == torch.bfloat16
    assert (
        build_engine(path, engine_config(dtype="bfloat16"), dtype="float32", device=device).dtype
        == torch.float32
    )
    assert build_engine(path, engine_config(), device=device).dtype == torch.float32


@pytest.mark.cpu_only("the warning is about CPUs that emulate bf16 arithmetic")
@pytest.mark.parametrize("backend", ["native", "hf"])
def test_bfloat16_on_a_cpu_without_bf16_arithmetic_warns(tiny_checkpoints, monkeypatch, backend):
    import warnings

    path = tiny_checkpoints["llama_mha_untied"]
    config = engine_config(dtype="bfloat16", backend=backend)
    for avx512_bf16, amx, warned in [(False, False, True), (True, False, False), (False, True, False)]:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda value=avx512_bf16: value)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda value=amx: value)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # On the CPU explicitly: the default device is the GPU wherever there is one.
            build_engine(path, config, device="cpu")
            build_engine(path, engine_config(backend=backend), device="cpu")  # float32: never a warning
        messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
        assert len(messages) == int(warned), (avx512_bf16, amx, messages)
        if warned:
            assert "engine.dtype: float32" in messages[0] and "AVX512-BF16 or AMX" in messages[0]
