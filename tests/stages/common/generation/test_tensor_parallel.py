"""Tensor-parallel native engine: 2 gloo ranks on CPU equal one device, and refit reshards as it streams.

One spawn of 2 ranks does all the distributed work of this module (building, generating, refitting
every variant) and saves what each rank returned; the tests compare that, in the parent, with a
tensor_parallel_size 1 engine on the same checkpoints: logits at prefill and decode steps, greedy
tokens, sampled tokens and their log-probs, and a refit from a perturbed checkpoint against a fresh
TP=2 build of it. The sharding rules themselves are checked as pure functions.

The ranks are CPU processes over gloo, and their one-device reference is a CPU engine (device="cpu"
explicitly: the default device is the GPU wherever there is one); those tests are cpu_only. The others run on
--device.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from engine_test_models import (
    TOLERANCES,
    engine_config,
    heap_in_use,
    perturbed_checkpoint,
    random_prompts,
    save_tiny_model,
)

from alignflow.stages.common.generation import EngineError, SamplingParams
from alignflow.stages.common.generation.interface import Generation
from alignflow.stages.common.generation.native import NativeEngine
from alignflow.stages.common.generation.native.tensor_parallel import (
    SHARDING,
    TensorParallelError,
    check_tensor_parallel,
    hf_parameter_shape,
    rank_spec,
    shard_of,
    shard_shape,
    sharding_rule,
    valid_sizes,
    vocab_range,
)
from alignflow.stages.common.generation.native.weights import checkpoint_tensors, saved_engine_tensors

WORLD = 2
NEW_TOKENS = 16  # past both sliding windows (6, 8) for prompts of 2-13 tokens
# The parity variants (engine_test_models.ARCHITECTURES) with what each checks under TP=2.
TP_VARIANTS: dict[str, dict] = {
    # MHA: 2 of 4 KV heads per rank; untied LM head.
    "llama_mha_untied": {},
    # GQA, 1 KV head per rank; tied embedding and head; vocab 255 is odd: rank 1's shard ends in a padding
    # row.
    "llama_gqa_tied_llama3": {"vocab_size": 255},
    # Qwen2 QKV bias sharded with its columns, a sliding-window layer. 2 KV heads: the parity variant's
    # single KV head cannot be split (test_indivisible_kv_heads_is_a_clear_error).
    "qwen2_bias_window": {"num_key_value_heads": 2},
    # head_dim 32 != hidden / heads, sliding window.
    "mistral_linear_window": {},
    # o_proj bias: replicated, added once after the all_reduce.
    "llama_bias_yarn": {},
}
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
SAMPLED = (SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=NEW_TOKENS, seed=1),
           SamplingParams(temperature=1.3, max_new_tokens=NEW_TOKENS, seed=2))


def _prompts(name: str) -> list[list[int]]:
    vocab = TP_VARIANTS[name].get("vocab_size", 256)
    return random_prompts(5, seed=7, vocab=vocab)


def _run_engine(engine: NativeEngine, prompts: list[list[int]]) -> dict:
    """Everything compared between TP=1 and TP=2: greedy tokens and logits, prefill logits, samples."""
    greedy = engine.generate(prompts, GREEDY, return_logits=True)
    sequences = [p + r for p, r in zip(prompts, greedy.response_token_ids, strict=True)]
    return {
        "greedy_tokens": greedy.response_token_ids,
        # [B, NEW_TOKENS, V]: the prefill's last position, then decode
        "decode_logits": torch.stack(greedy.logits),
        "prefill_logits": engine.forward_logits(sequences),  # [len_i, V] at every position
        "sampled": [
            (g.response_token_ids, g.logprobs) for g in (engine.generate(prompts, s) for s in SAMPLED)
        ],
    }


def _refit_memory(base: Path, perturbed: Path) -> dict:
    """Peak extra heap while a ~5M-parameter model streams into a TP rank, and what the rank holds."""
    engine = NativeEngine.build(base, engine_config(tensor_parallel_size=WORLD), device="cpu")
    baseline, peak = heap_in_use(), [0]

    def measured(stream):
        for item in stream:
            yield item
            now = heap_in_use()  # back here, the engine has copied its slice and kept whatever it keeps
            if now is not None and baseline is not None:
                peak[0] = max(peak[0], now - baseline)

    stats = engine.refit(measured(checkpoint_tensors(perturbed)))
    return {
        "peak": peak[0] if baseline is not None else None,
        "held_bytes": engine.weights.nbytes(),
        "copied_bytes": stats.bytes,
        "shapes": {k: tuple(t.shape) for k, t in engine.weights.buffers.items()},
    }


def _worker(rank: int, jobs: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    dist.init_process_group(
        "gloo",
        init_method=f"file://{out_dir}/rendezvous",
        rank=rank,
        world_size=WORLD,
        timeout=timedelta(seconds=120),
    )
    results: dict = {}
    try:
        config = engine_config(tensor_parallel_size=WORLD)
        for name, (base, perturbed) in jobs["variants"].items():
            engine = NativeEngine.build(base, config, device="cpu")
            prompts = _prompts(name)
            before = engine.generate(prompts, GREEDY).response_token_ids
            pointers = engine.weights.data_ptrs()
            result = {
                "base": _run_engine(engine, prompts),
                "shapes": {k: tuple(t.shape) for k, t in engine.weights.buffers.items()},
                "cache_shape": tuple(engine.cache.k[0].shape),
                "paths": engine.execution_paths(),
            }
            engine.refit(checkpoint_tensors(perturbed))
            result["refit_kept_buffers"] = engine.weights.data_ptrs() == pointers
            result["refit"] = _run_engine(engine, prompts)
            # A stream of this rank's slices, already cut (the rollout workers' trainer sends those): back
            # to the base and forward again must leave the buffers the full-tensor refit wrote.
            held = {k: t.clone() for k, t in engine.weights.buffers.items()}

            def sliced(checkpoint):
                for n, t in checkpoint_tensors(checkpoint):
                    yield n, shard_of(t, sharding_rule(n), rank, WORLD).clone()

            engine.refit(sliced(base))
            moved_back = any(not torch.equal(engine.weights.buffers[k], t) for k, t in held.items())
            engine.refit(sliced(perturbed))
            result["presliced_refit"] = moved_back and all(
                torch.equal(engine.weights.buffers[k], t) for k, t in held.items()
            )
            result["fresh"] = _run_engine(NativeEngine.build(perturbed, config, device="cpu"), prompts)
            result["before_refit_tokens"] = before
            results[name] = result
        # unload(keep_weights=False) -> reload -> full refit: fresh (zeroed) shard buffers filled again.
        name, (base, perturbed) = "llama_gqa_tied_llama3", jobs["variants"]["llama_gqa_tied_llama3"]
        engine = NativeEngine.build(base, config, device="cpu")
        engine.unload(keep_weights=False)
        engine.reload()
        engine.refit(checkpoint_tensors(perturbed))
        results["reloaded_refit"] = engine.generate(_prompts(name), GREEDY, return_logits=True)
        results["memory"] = _refit_memory(*jobs["medium"])
        errors = {}
        for key, call in {
            "group_size": lambda: NativeEngine.build(
                jobs["variants"]["llama_mha_untied"][0], engine_config(tensor_parallel_size=4), device="cpu"
            ),
            "save": lambda: engine.save(Path(out_dir) / f"saved{rank}"),
            # The stream carries full tensors: a wrong shape is reported against the full HF shape.
            "refit_shape": lambda: engine.refit(
                [("model.layers.1.self_attn.q_proj.weight", torch.zeros(64, 65))]
            ),
        }.items():
            try:
                call()
                errors[key] = None
            except Exception as exc:  # noqa: BLE001 - the parent checks type and message
                errors[key] = (type(exc).__name__, str(exc))
        results["errors"] = errors
    except Exception:  # noqa: BLE001 - report to the parent, which fails with the traceback
        results = {"traceback": traceback.format_exc()}
    finally:
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.destroy_process_group()


@contextmanager
def _one_thread() -> Iterator[None]:
    """Module fixtures run before conftest's per-test one-thread fixture: on the 2 shared cores, torch's
    default 2 threads make the TP=1 reference runs many times slower when the machine is busy."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tp_models")
    variants = {}
    with _one_thread():
        for name, overrides in TP_VARIANTS.items():
            base = save_tiny_model(root / name, name, bias_std=0.5, **overrides)
            variants[name] = (base, perturbed_checkpoint(base, root / f"{name}_perturbed"))
        medium = save_tiny_model(
            root / "medium",
            "llama_mha_untied",
            hidden_size=256,
            intermediate_size=688,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=4,
            vocab_size=1024,
        )
        medium_perturbed = perturbed_checkpoint(medium, root / "medium_perturbed")
    return {"variants": variants, "medium": (medium, medium_perturbed)}


# What the ranks' result files hold besides tensors and plain containers.
RESULT_TYPES = [Generation]


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("tp_ranks")
    mp.spawn(_worker, args=(checkpoints, str(out_dir)), nprocs=WORLD, join=True)
    with torch.serialization.safe_globals(RESULT_TYPES):  # weights_only, with the engine's record types
        results = [torch.load(out_dir / f"rank{r}.pt", weights_only=True) for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert "traceback" not in result, f"rank {rank} failed:\n{result['traceback']}"
    return results


@pytest.fixture(scope="module")
def one_device(checkpoints) -> dict:
    """The TP=1 engine's results on every variant (the reference) and after a refit."""
    out = {}
    with _one_thread():
        for name, (base, perturbed) in checkpoints["variants"].items():
            out[name] = {
                "base": _run_engine(NativeEngine.build(base, engine_config(), device="cpu"), _prompts(name)),
                "perturbed": _run_engine(
                    NativeEngine.build(perturbed, engine_config(), device="cpu"), _prompts(name)
                ),
            }
    return out


# The tests of the 2 ranks' results.
GLOO_RANKS = pytest.mark.cpu_only(
    "tensor parallel over 2 gloo ranks on the CPU (on CUDA it needs NCCL and a GPU per rank)"
)


def _max_diff(a, b) -> float:
    if isinstance(a, torch.Tensor):
        return (a - b).abs().max().item()
    return max(_max_diff(x, y) for x, y in zip(a, b, strict=True))


def _assert_matches(got: dict, want: dict, what: str) -> dict[str, float]:
    assert got["greedy_tokens"] == want["greedy_tokens"], f"{what}: greedy tokens differ"
    diffs = {
        "decode_logits": _max_diff(got["decode_logits"], want["decode_logits"]),
        "prefill_logits": _max_diff(got["prefill_logits"], want["prefill_logits"]),
    }
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got["sampled"], want["sampled"], strict=True):
        assert tokens == want_tokens, f"{what}: sampled tokens differ"
        diff = max(
            abs(x - y)
            for r, w in zip(logprobs, want_logprobs, strict=True)
            for x, y in zip(r, w, strict=True)
        )
        diffs["sampled_logprobs"] = max(diffs.get("sampled_logprobs", 0.0), diff)
    assert diffs["decode_logits"] <= TOLERANCES["tp_logits_fp32"], f"{what}: {diffs}"
    assert diffs["prefill_logits"] <= TOLERANCES["tp_logits_fp32"], f"{what}: {diffs}"
    assert diffs["sampled_logprobs"] <= TOLERANCES["tp_logprobs_fp32"], f"{what}: {diffs}"
    return diffs


@GLOO_RANKS
@pytest.mark.parametrize("name", list(TP_VARIANTS))
def test_two_ranks_match_one_device(ranks, one_device, name):
    for rank in ranks:
        diffs = _assert_matches(rank[name]["base"], one_device[name]["base"], f"{name} TP=2")
    print(f"{name}: max |TP=2 - TP=1| {diffs}")  # shown with -s; the README quotes these
    # Every rank returns the same thing, bit for bit (all_reduce and all_gather give every rank the same
    # bytes).
    a, b = ranks[0][name]["base"], ranks[1][name]["base"]
    assert a["greedy_tokens"] == b["greedy_tokens"] and a["sampled"] == b["sampled"]
    assert torch.equal(a["decode_logits"], b["decode_logits"])


@GLOO_RANKS
@pytest.mark.parametrize("name", list(TP_VARIANTS))
def test_each_rank_holds_its_shard_and_its_kv_heads(checkpoints, ranks, name):
    from transformers import AutoConfig

    from alignflow.stages.common.generation.native.spec import spec_from_hf_config
    from alignflow.stages.common.generation.native.weights import buffer_shapes

    spec = spec_from_hf_config(AutoConfig.from_pretrained(checkpoints["variants"][name][0]), 64)
    full = buffer_shapes(spec)
    for rank in ranks:
        shapes = rank[name]["shapes"]
        assert shapes == buffer_shapes(rank_spec(spec, WORLD))
        assert shapes["qkv_w"][1] * WORLD == full["qkv_w"][1] and shapes["o_w"][2] * WORLD == full["o_w"][2]
        assert shapes["gate_up_w"][1] * WORLD == full["gate_up_w"][1]
        assert shapes["down_w"][2] * WORLD == full["down_w"][2]
        assert shapes["embed"][0] == -(-spec.vocab_size // WORLD)
        assert rank[name]["cache_shape"][1] == spec.num_kv_heads // WORLD
        assert "tensor_parallel" in rank[name]["paths"] and rank[name]["paths"]["decode_step"] == "eager"


@GLOO_RANKS
@pytest.mark.parametrize("name", list(TP_VARIANTS))
def test_refit_equals_a_fresh_tp_build(ranks, one_device, name):
    for rank in ranks:
        result = rank[name]
        assert result["refit_kept_buffers"], "refit reallocated a weight buffer"
        assert result["presliced_refit"], "a stream of pre-cut slices placed other values than full tensors"
        refit, fresh = result["refit"], result["fresh"]
        # Same shard bytes in the same buffers: equal bit for bit, not just within tolerance.
        assert refit["greedy_tokens"] == fresh["greedy_tokens"] and refit["sampled"] == fresh["sampled"]
        assert torch.equal(refit["decode_logits"], fresh["decode_logits"])
        assert _max_diff(refit["prefill_logits"], fresh["prefill_logits"]) == 0
        assert result["before_refit_tokens"] != refit["greedy_tokens"], "the perturbation changed nothing"
        _assert_matches(refit, one_device[name]["perturbed"], f"{name} refit TP=2")


@GLOO_RANKS
def test_reload_after_discarding_weights_then_refit(ranks, one_device):
    want = one_device["llama_gqa_tied_llama3"]["perturbed"]
    for rank in ranks:
        got = rank["reloaded_refit"]
        assert got.response_token_ids == want["greedy_tokens"]
        assert _max_diff(torch.stack(got.logits), want["decode_logits"]) <= TOLERANCES["tp_logits_fp32"]


@GLOO_RANKS
def test_refit_keeps_no_full_copy(ranks, checkpoints):
    full_bytes = NativeEngine.build(checkpoints["medium"][0], engine_config(), device="cpu").weights.nbytes()
    for rank in ranks:
        memory = rank["memory"]
        # Every buffer but the norms (and o_proj bias) is split: a rank holds just over half the model.
        assert memory["held_bytes"] <= 0.51 * full_bytes
        assert memory["copied_bytes"] == memory["held_bytes"], "a rank copies exactly its shard"
        if memory["peak"] is None:
            pytest.skip("no glibc mallinfo2: peak memory not measured")
        # A rank that kept (or materialised) a full tensor would show at least the largest one, the
        # 1024 x 256 embedding (1 MiB, 8% of the 13 MiB model); measured: 0.05 MiB.
        print(
            f"rank refit peak extra memory {memory['peak'] / 2**20:.3f} MiB of a {full_bytes / 2**20:.1f} "
            "MiB model"
        )
        assert memory["peak"] < 0.04 * full_bytes, f"refit peak extra memory {memory['peak'] / 2**20:.2f} MiB"


@GLOO_RANKS
def test_tp_errors_name_the_setting(ranks):
    for rank in ranks:
        kind, message = rank["errors"]["group_size"]
        assert kind == "EngineError"
        assert "engine.tensor_parallel_size=4 but the process group has 2 ranks" in message
        kind, message = rank["errors"]["save"]
        assert kind == "EngineError" and "tensor-parallel engine" in message
        kind, message = rank["errors"]["refit_shape"]
        assert kind == "RefitError" and "shape (64, 65) but the engine expects (64, 64)" in message


def test_indivisible_kv_heads_is_a_clear_error(tiny_checkpoints, device):
    # Qwen2 parity variant: 4 query heads on 1 KV head; fails before any process group is needed.
    with pytest.raises(
        TensorParallelError,
        match=r"engine.tensor_parallel_size=2 cannot split this qwen2 model: "
        r"num_key_value_heads=1 is not divisible by it \(grouped-query "
        r"attention: 4 query heads on 1 KV heads.*valid tensor_parallel_size "
        r"values for this model are 1$",
    ):
        NativeEngine.build(
            tiny_checkpoints["qwen2_bias_window"], engine_config(tensor_parallel_size=2), device=device
        )


def test_tp_without_torch_distributed_is_a_clear_error(tiny_checkpoints, device):
    assert not dist.is_initialized()
    with pytest.raises(
        EngineError,
        match=r"engine.tensor_parallel_size=2 needs torch.distributed initialised "
        r"with 2 ranks",
    ):
        NativeEngine.build(
            tiny_checkpoints["llama_mha_untied"], engine_config(tensor_parallel_size=2), device=device
        )


@pytest.mark.parametrize(
    "name", ["llama_mha_untied", "llama_gqa_tied_llama3", "qwen2_bias_window", "llama_bias_yarn"]
)
def test_a_saved_engine_streams_back_as_its_checkpoints_tensors(tmp_path, name, device):
    """What a tensor-parallel rollout worker loads from (each rank cuts these as they arrive): the saved
    engine's fused buffers unfused, one layer at a time, give exactly the checkpoint's tensors under their HF
    names (biased models, drawn non-zero so a bias in the wrong rows shows; tied and untied heads)."""
    checkpoint = save_tiny_model(tmp_path / "checkpoint", name, bias_std=0.1)
    engine = NativeEngine.build(checkpoint, engine_config(), device=device)
    engine.save(tmp_path / "engine")
    streamed = dict(saved_engine_tensors(tmp_path / "engine" / "weights.safetensors", engine.spec))
    want = {
        n: t
        for n, t in checkpoint_tensors(checkpoint)
        if n != "lm_head.weight" or "lm_head.weight" in streamed
    }
    assert streamed.keys() == want.keys()
    for n, t in want.items():
        assert torch.equal(streamed[n], t), n


def test_one_device_calls_no_collective(tiny_checkpoints, monkeypatch, device):
    def refuse(*args, **kwargs):
        raise AssertionError("a tensor_parallel_size 1 engine called a collective")

    for op in ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, op, refuse)
    engine = NativeEngine.build(tiny_checkpoints["llama_bias_yarn"], engine_config(), device=device)
    assert engine.tp is None and engine.model.tp is None and engine.local_spec is engine.spec
    engine.generate(random_prompts(3), GREEDY)


# -- the sharding rules as pure functions --------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 4])
@pytest.mark.parametrize("rows", [8, 7, 1])
def test_shards_are_views_that_tile_the_full_tensor(size, rows):
    full = torch.randn(rows, 12)
    for param, rule in SHARDING.items():
        if rule.kind in ("column", "row") and (full.shape[rule.dim] % size):
            continue  # column/row splits need divisibility (check_tensor_parallel guarantees it)
        shards = [shard_of(full, rule, r, size) for r in range(size)]
        assert [shard_shape(tuple(full.shape), rule, r, size) for r in range(size)] == [
            tuple(s.shape) for s in shards
        ], param
        assert all(s is full or s._base is full for s in shards), f"{param}: a shard is a copy, not a view"
        if rule.kind == "replicated":
            assert all(s is full for s in shards), param
        else:
            assert torch.equal(torch.cat(shards, dim=rule.dim), full), param
    # Odd vocab: ceil-sized shards, the last one shorter; ids are owned by exactly one rank.
    assert [vocab_range(255, r, 2) for r in range(2)] == [(0, 128), (128, 255)]
    assert [vocab_range(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


def test_every_hf_parameter_has_a_rule_and_its_shape(tiny_checkpoints):
    from safetensors import safe_open
    from transformers import AutoConfig

    from alignflow.stages.common.generation.native.spec import spec_from_hf_config

    for path in tiny_checkpoints.values():
        spec = spec_from_hf_config(AutoConfig.from_pretrained(path), 64)
        with safe_open(str(path / "model.safetensors"), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118
                sharding_rule(name)
                assert hf_parameter_shape(name, spec) == tuple(handle.get_slice(name).get_shape()), name


def test_rank_spec_and_valid_sizes(tiny_checkpoints):
    from transformers import AutoConfig

    from alignflow.stages.common.generation.native.spec import spec_from_hf_config

    spec = spec_from_hf_config(AutoConfig.from_pretrained(tiny_checkpoints["llama_mha_untied"]), 64)
    local = rank_spec(spec, 4)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (1, 1, 32, 64)
    assert local.head_dim == spec.head_dim and local.hidden_size == spec.hidden_size
    assert rank_spec(spec, 1) is spec
    assert valid_sizes(spec) == [1, 2, 4]
    with pytest.raises(
        TensorParallelError,
        match=r"num_attention_heads=4 is not divisible by it; intermediate_size"
        r"=128 is not divisible by it.*are 1, 2, 4$",
    ):
        check_tensor_parallel(spec, 3)
