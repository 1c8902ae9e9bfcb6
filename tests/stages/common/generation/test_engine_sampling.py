"""Sampling parameters, finish reasons, early stop, seeds, and the errors a user sees for bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from engine_test_models import EOS_ID, TOLERANCES, engine_config, random_prompts
from pydantic import ValidationError

from alignflow.config import EngineConfig
from alignflow.kernels import rng
from alignflow.stages.common.generation import (
    ENGINE_BACKENDS,
    SamplingParams,
    UnsupportedArchitectureError,
    build_engine,
    engine_class,
)
from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native import engine as native_engine


@pytest.fixture
def native(tiny_checkpoints, device):
    return NativeEngine.build(tiny_checkpoints["llama_mha_untied"], engine_config(), device=device)


# -- bad values are errors that name them -------------------------------------------------------------

@pytest.mark.parametrize(("kwargs", "names"), [
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -1.0}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"seeds": [1, -2]}, "seeds"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"temperature": 0.0, "top_p": 0.9}, "top_p=0.9"),
    ({"temprature": 1.0}, "temprature"),
])
def test_bad_sampling_values_raise_naming_them(kwargs, names):
    with pytest.raises(ValidationError, match=names):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_generation_beyond_the_cache_is_an_error_not_a_clamp(tiny_checkpoints, backend, device):
    engine = build_engine(
        tiny_checkpoints["llama_mha_untied"], engine_config(backend=backend, max_seq_len=32), device=device
    )
    with pytest.raises(
        ValueError,
        match=r"longest prompt \(10 tokens\) \+ max_new_tokens=23 = 33 exceeds "
        r"the engine's max_seq_len=32; lower max_new_tokens to <= 22",
    ):
        engine.generate([[5] * 10, [6] * 3], SamplingParams(max_new_tokens=23))
    assert len(engine.generate([[5] * 10], SamplingParams(max_new_tokens=22)).response_token_ids[0]) <= 22


def test_bad_prompts_raise(native):
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\): \[256\]"):
        native.generate([[5, 256]], SamplingParams())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        native.generate([[5], []], SamplingParams())
    with pytest.raises(ValueError, match="sampling.seeds has 1 entries for 2 prompts"):
        native.generate([[5], [6]], SamplingParams(seeds=[1]))
    with pytest.raises(ValueError, match=r"stop_token_ids \[999\] are outside the vocabulary"):
        native.generate([[5]], SamplingParams(stop_token_ids=[999]))


def test_unknown_backend_lists_the_valid_ones(tiny_checkpoints, device):
    with pytest.raises(
        ValueError, match="unknown engine backend 'trt'; valid backends: native, hf, vllm, tensorrt-llm"
    ):
        engine_class("trt")
    with pytest.raises(ValueError, match="unknown engine backend"):
        build_engine(
            tiny_checkpoints["llama_mha_untied"], EngineConfig.model_construct(backend="vlm"), device=device
        )
    with pytest.raises(ValidationError, match="native"):  # the config schema itself lists them too
        EngineConfig(backend="trt")
    assert set(ENGINE_BACKENDS) == {"native", "hf", "vllm", "tensorrt-llm"}


def test_unsupported_architecture_suggests_hf_which_runs_it(tmp_path, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    GPT2LMHeadModel(
        GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=128, n_positions=64)
    ).save_pretrained(tmp_path / "gpt2")
    with pytest.raises(UnsupportedArchitectureError, match=r"model_type='gpt2'.*engine.backend: hf"):
        build_engine(tmp_path / "gpt2", engine_config(), device=device)
    # The fallback really works for it.
    gen = build_engine(tmp_path / "gpt2", engine_config(backend="hf"), device=device).generate(
        [[1, 2, 3]], SamplingParams(temperature=0.0, max_new_tokens=4)
    )
    assert len(gen.response_token_ids[0]) == 4


def test_batch_dependent_rope_is_unsupported_not_wrong(tiny_checkpoints, tmp_path, device):
    path = tmp_path / "dynamic"
    shutil.copytree(tiny_checkpoints["llama_mha_untied"], path)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    config["max_position_embeddings"] = 32
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        UnsupportedArchitectureError, match=r"'dynamic' with engine.max_seq_len=64 > max_position"
    ):
        build_engine(path, engine_config(max_seq_len=64), device=device)
    # within the trained length: the default RoPE
    build_engine(path, engine_config(max_seq_len=32), device=device)


# -- finish reasons and early stop ---------------------------------------------------------------------


def _checkpoint_with_eos(source, dest, eos: int):
    shutil.copytree(source, dest)
    for name in ("config.json", "generation_config.json"):
        file = dest / name
        if file.is_file():
            data = json.loads(file.read_text())
            data["eos_token_id"] = eos
            file.write_text(json.dumps(data))
    return dest


def test_stop_tokens_eos_and_length_give_their_finish_reasons(tiny_checkpoints, tmp_path, device):
    path = tiny_checkpoints["llama_mha_untied"]
    prompts = random_prompts(4, seed=7)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    plain = NativeEngine.build(path, engine_config(), device=device).generate(prompts, greedy)
    assert plain.finish_reasons == ["length"] * 4 and all(len(r) == 12 for r in plain.response_token_ids)
    assert EOS_ID not in {t for r in plain.response_token_ids for t in r}

    row = plain.response_token_ids[0]
    stop = row[4]
    cut = row.index(stop) + 1  # the first occurrence ends the sequence, stop token included
    stopped = NativeEngine.build(path, engine_config(), device=device).generate(
        prompts, greedy.model_copy(update={"stop_token_ids": [stop]})
    )
    assert stopped.response_token_ids[0] == row[:cut]
    assert stopped.finish_reasons[0] == "stop"
    assert len(stopped.logprobs[0]) == cut
    assert stopped.logprobs[0] == pytest.approx(plain.logprobs[0][:cut], abs=0)

    # The same token as the model's EOS: reason "eos"; ignore_eos runs to the length limit.
    eos_engine = NativeEngine.build(
        _checkpoint_with_eos(path, tmp_path / "eos", stop), engine_config(), device=device
    )
    assert eos_engine.eos_token_ids == (stop,)
    ended = eos_engine.generate(prompts, greedy)
    assert ended.response_token_ids[0] == row[:cut] and ended.finish_reasons[0] == "eos"
    ignored = eos_engine.generate(prompts, greedy.model_copy(update={"ignore_eos": True}))
    assert ignored.response_token_ids == plain.response_token_ids
    assert ignored.finish_reasons == ["length"] * 4

    # The hf backend agrees on all of it.
    hf = build_engine(tmp_path / "eos", engine_config(backend="hf"), device=device)
    hf_ended = hf.generate(prompts, greedy)
    assert hf_ended.response_token_ids == ended.response_token_ids
    assert hf_ended.finish_reasons == ended.finish_reasons


def test_decoding_stops_early_once_every_sequence_is_done(tiny_checkpoints, tmp_path, device):
    path = tiny_checkpoints["llama_mha_untied"]
    prompts = random_prompts(3, seed=7)
    long_run = NativeEngine.build(path, engine_config(), device=device).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=40)
    )
    # Make every row's 3rd token a stop token: all sequences finish within a few steps.
    stops = sorted({r[2] for r in long_run.response_token_ids})
    engine = NativeEngine.build(path, engine_config(), device=device)
    calls = []
    decode = engine._decode
    engine._decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
    gen = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=stops))
    assert all(reason == "stop" for reason in gen.finish_reasons)
    longest = max(len(r) for r in gen.response_token_ids)
    assert longest <= 3
    # The CPU checks for "all done" after every step; CUDA every GPU_STOP_CHECK_EVERY steps (one host sync
    # each), so it stops at the first multiple of that at or after the longest sequence's end.
    every = native_engine.GPU_STOP_CHECK_EVERY if device == "cuda" else 1
    steps = -(-longest // every) * every
    assert steps < 40  # the check has something to show: decoding still stops long before max_new_tokens
    assert len(calls) == steps - 1 == gen.metrics["perf/decode_steps"] - 1  # not 39 decode steps


# -- seeds ----------------------------------------------------------------------------------------------


def test_same_seed_same_output_and_batch_position_does_not_matter(native):
    prompts = random_prompts(5, seed=8)
    sampling = SamplingParams(temperature=1.0, top_k=50, max_new_tokens=20, seeds=[11, 12, 13, 14, 15])
    first = native.generate(prompts, sampling)
    again = native.generate(prompts, sampling)
    assert first.response_token_ids == again.response_token_ids and first.logprobs == again.logprobs

    # Reverse the batch (and drop one prompt): each prompt keeps its seed, so its sample is unchanged.
    order = [4, 3, 1, 0]
    moved = native.generate(
        [prompts[i] for i in order], sampling.model_copy(update={"seeds": [sampling.seeds[i] for i in order]})
    )
    for got, i in zip(moved.response_token_ids, order, strict=True):
        assert got == first.response_token_ids[i]
    for got, i in zip(moved.logprobs, order, strict=True):
        assert got == pytest.approx(first.logprobs[i], abs=TOLERANCES["logprobs_across_batches_fp32"])

    # Seeds change the sample; the batch seed gives distinct per-row seeds (GRPO groups of one prompt).
    other = native.generate(prompts, sampling.model_copy(update={"seeds": [21, 22, 23, 24, 25]}))
    assert other.response_token_ids != first.response_token_ids
    group = native.generate([prompts[0]] * 4, SamplingParams(temperature=1.0, max_new_tokens=20, seed=3))
    assert len({tuple(r) for r in group.response_token_ids}) == 4


@pytest.mark.parametrize("name", ["llama_mha_untied", "qwen2_bias_window"])
def test_rows_with_one_prompt_prefill_it_once_with_every_rows_own_result(tiny_checkpoints, name, device):
    """GRPO's groups (each prompt n times, rows interleaved, prompts of different lengths so rows are
    left-padded): the prefill of the distinct prompts, copied to their rows' cache, samples what every
    row's own prefill samples. A cache row copied from the wrong prompt changes the tokens."""
    engine = NativeEngine.build(tiny_checkpoints[name], engine_config(), device=device)
    distinct = random_prompts(3, seed=12)
    prompts = [distinct[i] for i in (0, 1, 2, 0, 2, 1, 0, 2)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    shared = engine.generate(prompts, sampling)
    engine.share_prompt_prefill = False
    own = engine.generate(prompts, sampling)
    assert shared.response_token_ids == own.response_token_ids
    for got, want in zip(shared.logprobs, own.logprobs, strict=True):
        assert got == pytest.approx(want, abs=TOLERANCES["logprobs_across_batches_fp32"])


def test_more_prompts_than_cache_rows_run_in_chunks_with_the_same_result(tiny_checkpoints, device):
    path = tiny_checkpoints["qwen2_bias_window"]
    prompts = random_prompts(11, seed=9)
    sampling = SamplingParams(temperature=0.9, max_new_tokens=10, seed=4)
    small = NativeEngine.build(path, engine_config(max_batch_size=4), device=device).generate(
        prompts, sampling
    )
    large = NativeEngine.build(path, engine_config(max_batch_size=16), device=device).generate(
        prompts, sampling
    )
    assert small.response_token_ids == large.response_token_ids
    assert len(small) == 11 and small.metrics["perf/generated_tokens"] == 110


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        (
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 8,
                    "long_factor": [1.0] * 8,
                    "original_max_position_embeddings": 64,
                }
            },
            "rope_type 'longrope'",
        ),
    ],
)
def test_llama_variants_the_native_engine_does_not_run_are_rejected(overrides, reason):
    from engine_test_models import tiny_config

    from alignflow.stages.common.generation.native.spec import spec_from_hf_config

    with pytest.raises(UnsupportedArchitectureError, match=f"{reason}.*engine.backend: hf"):
        spec_from_hf_config(tiny_config("llama_mha_untied", **overrides), max_seq_len=64)


@pytest.mark.cpu_only("the chunked sampler is the eager CPU engine's (CUDA samples with the Triton kernel)")
def test_noise_windows_cross_window_boundaries_with_the_same_noise_and_samples(tiny_checkpoints, monkeypatch):
    """Windows of 3 steps (an eager engine on the chunked sampler gets one window per generate call) give
    every step the per-step noise, and the engine the same tokens and log-probs as with one window for all
    steps."""
    native = NativeEngine.build(
        tiny_checkpoints["llama_mha_untied"], engine_config(cpu_kernels=False), device="cpu"
    )
    assert native._sample_impl == "chunked"  # the C++ samplers hash their own noise
    seeds = torch.tensor([3, 17, 40])
    monkeypatch.setattr(native_engine, "NOISE_WINDOW_ELEMENTS", 3 * 3 * 256)
    windows = native_engine.NoiseWindows(seeds, 10, 256)
    assert windows.width == 3
    k1, k2 = rng.row_keys_per_step(seeds, 10)
    for step in range(10):
        assert torch.equal(windows.at(step), rng.gumbel_noise(k1, k2[:, step], 256)), step
    prompts = random_prompts(3, seed=5)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seeds=[3, 17, 40], ignore_eos=True)
    small = native.generate(prompts, sampling)
    monkeypatch.setattr(native_engine, "NOISE_WINDOW_ELEMENTS", 1 << 20)
    whole = native.generate(prompts, sampling)
    assert small.response_token_ids == whole.response_token_ids
    assert small.logprobs == whole.logprobs
