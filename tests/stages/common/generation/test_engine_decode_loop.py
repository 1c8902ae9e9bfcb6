"""The native engine's C++ decode loop (engine.cpu_decode_loop) against its torch step: same tokens, stops."""

from __future__ import annotations

import pytest
import torch
from engine_test_models import (
    TOLERANCES,
    engine_config,
    perturbed_checkpoint,
    random_prompts,
    save_tiny_model,
)

from alignflow.kernels import _cpu_extension
from alignflow.kernels import decode_loop as kernel
from alignflow.stages.common.generation import SamplingParams
from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native import decode_loop as engine_loop
from alignflow.stages.common.generation.native import prepack as prepack_module
from alignflow.stages.common.generation.native.prepack import current_blocked
from alignflow.stages.common.generation.native.weights import checkpoint_tensors

pytestmark = pytest.mark.cpu_only("the C++ decode loop is the CPU engine's")


@pytest.fixture(autouse=True)
def _loop_builds_here():
    # A fixture, not a skipif at import: a --device cuda run (which skips this module) never builds the C++
    # kernels.
    if not kernel.available():
        pytest.skip(f"no C++ decode loop here: {kernel.unavailable_reason()}")


# Stop tokens common enough (9 of the 256-token vocabulary) that rows finish at different steps, and some do
# not.
STOPPING = SamplingParams(temperature=1.0, max_new_tokens=20, seed=11, stop_token_ids=list(range(3, 12)))


def _engines(path, **overrides) -> tuple[NativeEngine, NativeEngine]:
    """(the engine with the C++ loop, the same model on the torch step)."""
    fast = NativeEngine.build(path, engine_config(cpu_decode_loop=True, **overrides), device="cpu")
    reference = NativeEngine.build(path, engine_config(**overrides), device="cpu")
    assert fast._decode_loop is not None and reference._decode_loop is None
    return fast, reference


def _assert_same_generation(got, want) -> None:
    assert got.response_token_ids == want.response_token_ids
    assert got.finish_reasons == want.finish_reasons
    assert got.metrics["perf/decode_steps"] == want.metrics["perf/decode_steps"]
    for a, b in zip(got.logprobs, want.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=TOLERANCES["logprobs_fp32"])
    if want.logits is not None:
        worst = max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits, strict=True))
        assert worst <= TOLERANCES["logits_fp32"]


@pytest.mark.parametrize("arch", ["llama_mha_untied", "llama_gqa_tied_llama3", "qwen2_bias"])
def test_the_loop_generates_what_the_torch_step_does(tiny_checkpoints, tmp_path, arch):
    """Multi-head and grouped-query attention, tied and untied heads, llama3 RoPE, Qwen2's QKV bias (nonzero
    here); left-padded prompts of mixed lengths; rows stopping at different steps; each step's logits."""
    # the fixture's Qwen2 has a sliding window, which the loop leaves to the torch step
    if arch == "qwen2_bias":
        path = save_tiny_model(tmp_path / arch, "qwen2_bias_window", bias_std=0.5, use_sliding_window=False)
    else:
        path = tiny_checkpoints[arch]
    fast, reference = _engines(path)
    prompts = random_prompts(7, seed=3)
    got = fast.generate(prompts, STOPPING, return_logits=True)
    want = reference.generate(prompts, STOPPING, return_logits=True)
    lengths = {len(r) for r in want.response_token_ids}
    # it has to show
    assert len(lengths) > 2 and "stop" in want.finish_reasons and "length" in want.finish_reasons
    _assert_same_generation(got, want)
    # The logits of each step are those of the model run over prompt + response (the prefill path,
    # parity-tested against transformers in test_engine_parity.py): the loop's cache, positions and masks are
    # right.
    full = reference.forward_logits([p + r for p, r in zip(prompts, got.response_token_ids, strict=True)])
    for prompt, response, step_logits, whole in zip(
        prompts, got.response_token_ids, got.logits, full, strict=True
    ):
        n = len(response)
        torch.testing.assert_close(
            step_logits, whole[len(prompt) - 1 : len(prompt) - 1 + n], rtol=0, atol=TOLERANCES["logits_fp32"]
        )


def test_greedy_rows_early_stop_and_a_repeated_prompt(tiny_checkpoints):
    """Greedy decoding, a batch that finishes before max_new_tokens (the loop ends at the same step), and rows
    sharing a prompt (the prefill's shared rows are copied into the cache the loop reads)."""
    fast, reference = _engines(tiny_checkpoints["llama_gqa_tied_llama3"])
    prompts = random_prompts(3, seed=4)
    prompts = prompts + prompts[:2]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    _assert_same_generation(fast.generate(prompts, greedy), reference.generate(prompts, greedy))
    everything_stops = SamplingParams(
        temperature=1.0, max_new_tokens=24, seed=2, stop_token_ids=list(range(3, 128))
    )
    got, want = fast.generate(prompts, everything_stops), reference.generate(prompts, everything_stops)
    assert want.metrics["perf/decode_steps"] < 24
    _assert_same_generation(got, want)


@pytest.mark.parametrize("arch", ["llama_mha_untied", "llama_gqa_tied_llama3"])
def test_the_avx2_build_generates_what_the_torch_step_does(tiny_checkpoints, monkeypatch, arch):
    """CPUs without AVX-512 run the loop's AVX2 build (its skinny_linear, sampler and attention body); that
    build runs on AVX-512 CPUs too, so it is checked here wherever it builds."""
    avx2 = _cpu_extension.logprob_kernels()  # the AVX2 extension, on any CPU with AVX2 and FMA
    if avx2 is None:
        pytest.skip(f"no AVX2 build here: {_cpu_extension.logprob_kernels_unavailable_reason()}")
    fast, reference = _engines(tiny_checkpoints[arch])
    monkeypatch.setattr(kernel, "_module", lambda: avx2)
    assert kernel.isa() == "AVX2"
    prompts = random_prompts(7, seed=3)
    got = fast.generate(prompts, STOPPING, return_logits=True)
    _assert_same_generation(got, reference.generate(prompts, STOPPING, return_logits=True))
    full = reference.forward_logits([p + r for p, r in zip(prompts, got.response_token_ids, strict=True)])
    for prompt, response, step_logits, whole in zip(
        prompts, got.response_token_ids, got.logits, full, strict=True
    ):
        torch.testing.assert_close(
            step_logits,
            whole[len(prompt) - 1 : len(prompt) - 1 + len(response)],
            rtol=0,
            atol=TOLERANCES["logits_fp32"],
        )


def test_the_result_does_not_depend_on_the_thread_count(tiny_checkpoints):
    """Each row's arithmetic is one thread's and each linear's pieces are whole (tile, 8 rows) blocks, so
    1 and 2 threads give the same bits (the critic's process and the rollout workers run with other thread
    counts)."""
    fast, _ = _engines(tiny_checkpoints["llama_mha_untied"])
    prompts = random_prompts(8, seed=6)  # 8 rows: both threads get rows and linear pieces
    one = fast.generate(prompts, STOPPING)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = fast.generate(prompts, STOPPING)
    finally:
        torch.set_num_threads(previous)
    assert two.response_token_ids == one.response_token_ids
    assert two.logprobs == one.logprobs


@pytest.mark.parametrize("prepack", [True, False], ids=["prepack's copies", "its own copies"])
def test_a_refit_reaches_the_loops_blocked_weights(tiny_checkpoints, tmp_path, prepack, monkeypatch):
    path = tiny_checkpoints["llama_mha_untied"]
    # The AVX2 build packs only weights of 256 KiB and more, which the tiny model has none of: without a
    # floor, prepack blocks its weights on every CPU, so the sharing below is tested on AVX2 too.
    monkeypatch.setitem(prepack_module.MIN_PACKED_BYTES, "blocked-avx2", 0)
    fast, _ = _engines(path, cpu_prepack=prepack)
    # With prepack on, the loop reads prepack's blocked copies (one copy of each weight, one rewrite per
    # refit); with it off, copies of its own.
    assert (fast._prepacked is not None) == prepack
    loop = fast._decode_loop
    shared = [current_blocked(fast.weights[name][layer]) is loop._blocked[name, layer]
              for name, layer in loop._blocked]
    assert shared and all(shared) == prepack and any(shared) == prepack
    prompts = random_prompts(4, seed=7)
    before = fast.generate(prompts, STOPPING)
    perturbed = perturbed_checkpoint(path, tmp_path / "p")
    fast.refit(checkpoint_tensors(perturbed))
    want = NativeEngine.build(perturbed, engine_config(), device="cpu").generate(prompts, STOPPING)
    assert want.response_token_ids != before.response_token_ids  # the refit has something to show
    _assert_same_generation(fast.generate(prompts, STOPPING), want)
    # Weights discarded and reloaded: the blocked copies are dropped with them and rebuilt by the next refit.
    fast.unload(keep_weights=False)
    assert fast._decode_loop._lm_head is None
    fast.reload()
    fast.refit(checkpoint_tensors(perturbed))
    _assert_same_generation(fast.generate(prompts, STOPPING), want)
    assert (current_blocked(fast.weights["lm_head"]) is fast._decode_loop._lm_head) == prepack


def test_top_k_and_top_p_sampling_take_the_torch_step(tiny_checkpoints, monkeypatch):
    fast, reference = _engines(tiny_checkpoints["llama_mha_untied"])
    calls = []
    run = engine_loop.CppDecodeLoop.run
    monkeypatch.setattr(
        engine_loop.CppDecodeLoop, "run", lambda self, *a, **k: calls.append(1) or run(self, *a, **k)
    )
    prompts = random_prompts(3, seed=8)
    for update in ({"top_k": 10}, {"top_p": 0.8}):
        sampling = STOPPING.model_copy(update=update)
        _assert_same_generation(fast.generate(prompts, sampling), reference.generate(prompts, sampling))
    assert calls == []
    fast.generate(prompts, STOPPING)
    assert calls == [1]
    assert (
        fast.execution_paths()["decode_step"] == f"C++ decode loop ({kernel.isa()}, kernels/decode_loop.py); "
        "with top-k/top-p sampling eager"
    )


def test_models_and_settings_the_loop_leaves_to_the_torch_step(tiny_checkpoints):
    cases = [
        ("qwen2_bias_window", "float32", {}, "no sliding-window attention"),
        ("llama_bias_yarn", "float32", {}, "no o_proj bias"),
        ("mistral_linear_window", "float32", {}, "no sliding-window attention"),
        ("llama_mha_untied", "bfloat16", {}, "float32 on CPU only, not bfloat16 on cpu"),
        ("llama_mha_untied", "float32", {"cpu_kernels": False}, "off (engine.cpu_kernels: false)"),
        ("llama_mha_untied", "float32", {"cpu_decode_loop": False}, "off (engine.cpu_decode_loop: false)"),
    ]
    for arch, dtype, overrides, reason in cases:
        config = engine_config(**{"cpu_decode_loop": True, **overrides})
        engine = NativeEngine.build(tiny_checkpoints[arch], config, dtype=dtype, device="cpu")
        assert engine._decode_loop is None
        assert engine.execution_paths()["decode_loop"] == f"not used: {reason}", arch


def test_bad_arguments_name_what_is_wrong(tiny_checkpoints):
    fast, _ = _engines(tiny_checkpoints["llama_mha_untied"])
    loop, cache = fast._decode_loop, fast.cache
    B, V = 2, fast.vocab_size
    args = dict(
        first_logits=torch.zeros(B, V),
        k_cache=cache.k,
        v_cache=cache.v,
        cos=fast.model.cos,
        sin_signed=fast.model.sin,
        mask=torch.zeros(B, 64),
        positions=torch.tensor([3, 4]),
        first_slot=4,
        temperature=torch.ones(B),
        seeds=torch.tensor([1, 2]),
        ends=torch.zeros(V, dtype=torch.bool),
        max_new_tokens=8,
    )
    with pytest.raises(RuntimeError, match=r"ends must be a contiguous Bool CPU tensor \[256\]"):
        loop.run(**{**args, "ends": torch.zeros(V)})
    with pytest.raises(RuntimeError, match="slots 60..126 do not fit the cache's 64"):
        loop.run(**{**args, "first_slot": 60, "max_new_tokens": 68, "mask": torch.zeros(B, 128)})
    with pytest.raises(RuntimeError, match="position 60 of row 0 runs past the RoPE table's 64 positions"):
        loop.run(**{**args, "positions": torch.tensor([60, 4])})

    def call(layers, lm_head):
        kernel.decode_loop(
            args["first_logits"],
            layers,
            fast.weights["embed"],
            fast.weights["norm"],
            lm_head,
            cache.k,
            cache.v,
            fast.model.cos,
            fast.model.sin,
            args["mask"],
            args["positions"],
            4,
            args["temperature"],
            args["seeds"],
            args["ends"],
            8,
            4,
            4,
            1e-6,
        )

    layers = list(loop._layers)
    layers[1] = layers[1][:, :-1].contiguous()  # qkv of layer 0, one input column short
    with pytest.raises(RuntimeError, match=r"qkv of layer 0 must be blocked as \[\d+, 64, 16\]"):
        call(layers, loop._lm_head)
    with pytest.raises(RuntimeError, match=r"decode_loop: lm_head must be blocked as \[16, 64, 16\]"):
        call(loop._layers, fast.weights["lm_head"])  # the plain [V, H] weight instead of its blocked copy
