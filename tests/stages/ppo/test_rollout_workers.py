"""Rollout workers in their own processes: the in-process engine's tokens from any chunking, refit over the
gloo group equal to a fresh engine, a worker's error re-raised with its message, a SIGKILLed worker named in
seconds.

Each RolloutWorkers start spawns 2 processes that import torch and load the engine (~12 s on 2 cores), so
one pair serves the parity, refit and error tests (each sets the weights it needs first), and each death
test, which breaks its pair, starts its own.

The workers and the in-process engines are CPU ones (device="cpu" explicitly: the default device is the GPU
wherever there is one); the module is cpu_only, since workers are not pinned to GPUs of their own yet.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch

from alignflow.stages.common.generation.interface import SamplingParams, build_engine
from alignflow.stages.common.generation.native.tensor_parallel import sharding_rule
from alignflow.stages.common.generation.native.weights import checkpoint_tensors
from alignflow.stages.ppo.rollout_client import RolloutRequest
from alignflow.stages.ppo.rollout_workers import (
    BUCKET_BYTES,
    RolloutWorkerError,
    RolloutWorkers,
    cut_chunks,
    describe_exit,
)
from tests.stages.common.generation.engine_test_models import (
    TOLERANCES,
    engine_config,
    perturbed_checkpoint,
    random_prompts,
    save_tiny_model,
)

pytestmark = pytest.mark.cpu_only(
    "rollout workers are CPU processes here: GPU workers are not pinned to GPUs of "
    "their own yet (stages/ppo/rollout_workers.py)"
)

WORKERS = 2
PROMPTS = random_prompts(11, seed=4)  # 11 = chunks of 3, 3, 3, 2: a short last chunk
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
SAMPLED = (
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9, max_new_tokens=12, seed=3),
    SamplingParams(temperature=0.8, max_new_tokens=12, seeds=[1000 + 7 * i for i in range(len(PROMPTS))]),
)
# Sampled sequences are generated in other batches than in one in-process call (other sizes, other
# neighbours): GEMM blocking changes fp32 rounding (measured ~1.4e-6 here); the per-sequence seeds make
# the tokens identical. The same bound as the engine's batch-position test (engine_test_models).
LOGPROB_TOL = TOLERANCES["logprobs_across_batches_fp32"]


def request(prompts: list[list[int]], sampling: SamplingParams, iteration: int = 1) -> RolloutRequest:
    return RolloutRequest(iteration, list(range(len(prompts))), list(range(len(prompts))), prompts, sampling)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(base checkpoint, perturbed checkpoint, saved engine dir of the base)."""
    root = tmp_path_factory.mktemp("rollout_workers")
    base = save_tiny_model(root / "base", "llama_mha_untied")
    moved = perturbed_checkpoint(base, root / "moved")
    engine = build_engine(base, engine_config(backend="native"), device="cpu")
    engine.save(root / "engine")
    return base, moved, root / "engine"


@pytest.fixture(scope="module")
def workers(checkpoints):
    with RolloutWorkers(
        checkpoints[2], WORKERS, chunk_size=3, threads=1, timeout_s=30, device="cpu"
    ) as client:
        yield client


def in_process(checkpoint):
    torch.set_num_threads(1)
    return build_engine(checkpoint, engine_config(backend="native"), device="cpu")


def assert_same(got, want, tol: float) -> None:
    assert got.response_token_ids == want.response_token_ids
    assert got.finish_reasons == want.finish_reasons
    worst = max(
        abs(a - b)
        for x, y in zip(got.logprobs, want.logprobs, strict=True)
        for a, b in zip(x, y, strict=True)
    )
    assert worst <= tol, worst


def test_chunks_cover_every_sequence_once():
    assert cut_chunks(11, 3) == [(0, 3), (3, 6), (6, 9), (9, 11)]
    assert cut_chunks(2, 8) == [(0, 2)]
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        cut_chunks(4, 0)
    assert describe_exit(-9) == "killed by signal SIGKILL" and describe_exit(3) == "exit code 3"


def test_workers_generate_the_in_process_engines_tokens_from_any_chunking(workers, checkpoints):
    base, _, _ = checkpoints
    workers.refit(checkpoint_tensors(base))
    reference = in_process(base)
    for chunk_size in (3, 1, len(PROMPTS)):
        workers.chunk_size = chunk_size
        greedy = workers.result(workers.submit(request(PROMPTS, GREEDY))).generation
        assert_same(greedy, reference.generate(PROMPTS, GREEDY), LOGPROB_TOL)
        for sampling in SAMPLED:
            got = workers.result(workers.submit(request(PROMPTS, sampling)))
            assert_same(got.generation, reference.generate(PROMPTS, sampling), LOGPROB_TOL)
        if chunk_size == 1:  # 11 one-sequence chunks: both workers took some
            assert set(workers.last_chunks) == {0, 1}
    workers.chunk_size = 3
    metrics = got.generation.metrics
    assert metrics["perf/rollout_chunks"] == 1 and metrics["perf/rollout_workers"] == WORKERS
    assert metrics["perf/rollout_imbalance"] == pytest.approx(2.0)  # one chunk: one worker did it all


def test_two_requests_in_flight_come_back_each_in_order(workers, checkpoints):
    base, _, _ = checkpoints
    workers.refit(checkpoint_tensors(base))
    reference = in_process(base)
    first = workers.submit(request(PROMPTS[:5], SAMPLED[0], iteration=1))
    second = workers.submit(request(PROMPTS[5:], SAMPLED[0], iteration=2))
    b, a = workers.result(second), workers.result(first)
    assert_same(a.generation, reference.generate(PROMPTS[:5], SAMPLED[0]), LOGPROB_TOL)
    assert_same(b.generation, reference.generate(PROMPTS[5:], SAMPLED[0]), LOGPROB_TOL)


# 1 KiB: the norms (256 B) are packed, every matrix (>= 16 KiB) travels alone, interleaved; 16 MiB: one
# bucket.
@pytest.mark.parametrize("bucket_bytes", [1024, BUCKET_BYTES], ids=["mostly-alone", "one-bucket"])
def test_refit_over_the_group_equals_a_fresh_engine_of_the_new_weights(
    workers, checkpoints, bucket_bytes, monkeypatch
):
    base, moved, _ = checkpoints
    monkeypatch.setattr(workers, "bucket_bytes", bucket_bytes)
    workers.refit(checkpoint_tensors(base))
    version = workers.weights_version
    stats = workers.refit(checkpoint_tensors(moved))
    assert workers.weights_version == version + 1
    expected = [(name, t) for name, t in checkpoint_tensors(moved)]
    assert stats.tensors == len(expected)
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in expected)
    assert stats.bytes_sent == WORKERS * stats.bytes
    assert [w.bytes for w in stats.workers] == [stats.bytes] * WORKERS
    fresh = in_process(moved)
    for sampling in (GREEDY, *SAMPLED):
        got = workers.result(workers.submit(request(PROMPTS, sampling)))
        assert got.weights_version == version + 1
        assert_same(got.generation, fresh.generate(PROMPTS, sampling), LOGPROB_TOL)

    # Partial: two matrices of the base model into the moved engine, in the workers and in process alike.
    subset = [
        (n, t)
        for n, t in checkpoint_tensors(base)
        if n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight")
    ]
    stats = workers.refit(iter(subset), partial=True)
    assert stats.tensors == 2
    fresh.refit(iter(subset), partial=True)
    got = workers.result(workers.submit(request(PROMPTS, SAMPLED[0]))).generation
    assert_same(got, fresh.generate(PROMPTS, SAMPLED[0]), LOGPROB_TOL)
    assert got.response_token_ids != in_process(moved).generate(PROMPTS, SAMPLED[0]).response_token_ids

    # The header carries the dtype and the bytes travel as they are: a bf16 trainer's tensors arrive as bf16
    # (half the bytes) and each engine casts them as it copies, as the in-process refit does.
    half = [(n, t.to(torch.bfloat16)) for n, t in subset]
    stats = workers.refit(iter(half), partial=True)
    assert stats.bytes == sum(t.numel() * 2 for _, t in half)
    fresh.refit(iter(half), partial=True)
    got = workers.result(workers.submit(request(PROMPTS, SAMPLED[0]))).generation
    assert_same(got, fresh.generate(PROMPTS, SAMPLED[0]), LOGPROB_TOL)


def test_a_refit_that_does_not_fit_is_reraised_and_the_group_survives(workers, checkpoints):
    base, _, _ = checkpoints
    tensors = list(checkpoint_tensors(base))
    with pytest.raises(
        RolloutWorkerError,
        match=r"rollout worker \d \(pid \d+\) failed refitting: RefitError: "
        r"refit did not cover 1 of",
    ):
        workers.refit(iter(tensors[1:]))  # not partial, one parameter missing
    wrong = [("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3)), *tensors]
    with pytest.raises(
        RolloutWorkerError, match=r"RefitError: 'model.layers.0.mlp.up_proj.weight': shape \(3, 3\)"
    ):
        workers.refit(iter(wrong))  # the engine stops at the first tensor; the worker drains the rest

    def failing():
        yield tensors[0]
        raise OSError("gather failed")

    with pytest.raises(OSError, match="gather failed"):
        workers.refit(failing())  # the trainer's own stream: its error, and the workers told to stop waiting
    workers.refit(iter(tensors))  # every collective above ended cleanly: the group still works
    got = workers.result(workers.submit(request(PROMPTS, GREEDY))).generation
    assert_same(got, in_process(base).generate(PROMPTS, GREEDY), LOGPROB_TOL)


def test_an_error_in_a_worker_is_reraised_with_its_message(workers, checkpoints):
    workers.refit(checkpoint_tensors(checkpoints[0]))
    too_long = SamplingParams(temperature=0.0, max_new_tokens=60)  # + a 13-token prompt > max_seq_len 64
    with pytest.raises(
        RolloutWorkerError,
        match=r"rollout worker \d \(pid \d+\) failed generating iteration 1, "
        r"chunk \d: ValueError: longest prompt .* exceeds the engine's "
        r"max_seq_len=64",
    ) as caught:
        workers.result(workers.submit(request(PROMPTS, too_long)))
    assert caught.value.remote_type == "ValueError"
    assert any("Traceback" in note for note in caught.value.__notes__)
    with pytest.raises(RolloutWorkerError, match=r"outside the vocabulary \[0, 256\)"):
        workers.result(workers.submit(request([[5, 999]], GREEDY)))
    # still serving
    assert len(workers.result(workers.submit(request(PROMPTS, GREEDY))).generation) == len(PROMPTS)


def test_unload_frees_every_workers_kv_cache_and_reload_restores_it(workers, checkpoints):
    workers.refit(checkpoint_tensors(checkpoints[0]))
    kv_bytes = in_process(checkpoints[0]).cache.nbytes()  # 2 layers x (K, V) x [8, 4, 64, 16] fp32 = 512 KiB
    freed = workers.unload()
    # Each worker's allocator gives back its whole cache (malloc hands buffers this size out by mmap).
    assert WORKERS * kv_bytes <= freed["perf/engine_freed_bytes"] < WORKERS * kv_bytes * 1.1
    with pytest.raises(RolloutWorkerError, match=r"EngineError: the engine is unloaded; call reload\(\)"):
        workers.result(workers.submit(request(PROMPTS, GREEDY)))
    assert workers.reload()["timing/engine_reload"] > 0
    got = workers.result(workers.submit(request(PROMPTS, GREEDY))).generation
    assert_same(got, in_process(checkpoints[0]).generate(PROMPTS, GREEDY), LOGPROB_TOL)


# Tensor-parallel replicas: 1 replica x 2 ranks (the same 2 processes as above: on 2 cores, 1 thread each).
TP = 2
# The bound for TP parity. A rank's partial sums over half the heads / intermediate rows, added by an
# all_reduce, round differently from one device's GEMM; the native TP test measured ~1e-6 on these models.
TP_LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tp_workers(checkpoints):
    with RolloutWorkers(
        checkpoints[2], 1, tensor_parallel_size=TP, chunk_size=3, threads=1, timeout_s=30, device="cpu"
    ) as client:
        yield client


def test_a_tensor_parallel_replica_loads_its_shards_and_generates_the_one_device_tokens(
    tp_workers, checkpoints
):
    """R=1 x k=2: each rank loaded its half of the saved engine (no process holds the whole model), and the
    replica's greedy tokens equal the in-process TP=1 engine's, sampled ones too with log-probs within
    1e-4."""
    base, _, engine_dir = checkpoints
    assert [(w.replica, w.tp_rank) for w in tp_workers.workers] == [(0, 0), (0, 1)]
    reference = in_process(base)
    whole = reference.weights.nbytes()
    replicated = sum(
        t.numel() * t.element_size()
        for n, t in checkpoint_tensors(base)
        if sharding_rule(n).kind == "replicated"
    )
    for w in tp_workers.workers:  # each rank's buffers: half of every split tensor, every norm whole
        assert w.info["weight_bytes"] == (whole - replicated) // TP + replicated < 0.6 * whole
    worst = 0.0
    for chunk_size in (3, len(PROMPTS)):
        tp_workers.chunk_size = chunk_size
        got = tp_workers.result(tp_workers.submit(request(PROMPTS, GREEDY))).generation
        assert got.response_token_ids == reference.generate(PROMPTS, GREEDY).response_token_ids
        for sampling in SAMPLED:
            got = tp_workers.result(tp_workers.submit(request(PROMPTS, sampling))).generation
            assert_same(got, reference.generate(PROMPTS, sampling), TP_LOGPROB_TOL)
            worst = max(
                worst,
                max(
                    abs(a - b)
                    for x, y in zip(got.logprobs, reference.generate(PROMPTS, sampling).logprobs, strict=True)
                    for a, b in zip(x, y, strict=True)
                ),
            )
    print(f"TP={TP} replica vs one device: sampled log-probs max |diff| {worst:.2e}")
    assert got.metrics["perf/rollout_workers"] == 1 and got.metrics["perf/rollout_tensor_parallel"] == TP
    tp_workers.chunk_size = 3


def test_a_tensor_parallel_refit_sends_each_rank_its_shard_and_equals_a_fresh_build(tp_workers, checkpoints):
    base, moved, _ = checkpoints
    tp_workers.refit(checkpoint_tensors(base))
    stats = tp_workers.refit(checkpoint_tensors(moved))
    sent = list(checkpoint_tensors(moved))
    assert stats.bytes == sum(t.numel() * t.element_size() for _, t in sent)
    # Each rank received and copied only its slice: the split tensors' halves plus the replicated norms.
    kept = [
        sum(
            t.numel() * t.element_size() // (1 if sharding_rule(n).kind == "replicated" else TP)
            for n, t in sent
        )
        for _ in range(TP)
    ]
    assert [w.bytes for w in stats.workers] == kept and kept[0] < 0.6 * stats.bytes
    fresh = in_process(moved)
    for sampling in (GREEDY, *SAMPLED):
        got = tp_workers.result(tp_workers.submit(request(PROMPTS, sampling))).generation
        assert_same(got, fresh.generate(PROMPTS, sampling), TP_LOGPROB_TOL)
    # Partial (LoRA's stream): two matrices back to the base values, on the replica and in process.
    subset = [
        (n, t)
        for n, t in checkpoint_tensors(base)
        if n in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight")
    ]
    tp_workers.refit(iter(subset), partial=True)
    fresh.refit(iter(subset), partial=True)
    got = tp_workers.result(tp_workers.submit(request(PROMPTS, SAMPLED[0]))).generation
    assert_same(got, fresh.generate(PROMPTS, SAMPLED[0]), TP_LOGPROB_TOL)
    # unload / reload reach both ranks (each frees its half of the KV cache).
    freed = tp_workers.unload()
    assert freed["perf/engine_freed_bytes"] > 0
    tp_workers.reload()
    got = tp_workers.result(tp_workers.submit(request(PROMPTS, GREEDY))).generation
    assert got.response_token_ids == fresh.generate(PROMPTS, GREEDY).response_token_ids

    # The trainer's stream failing halfway: both ranks' refit groups are told (each rank raises, holding a
    # mix), and a full refit over them works after.
    def failing():
        yield from subset
        raise OSError("gather failed")

    with pytest.raises(OSError, match="gather failed"):
        tp_workers.refit(failing())
    tp_workers.refit(checkpoint_tensors(moved))
    got = tp_workers.result(tp_workers.submit(request(PROMPTS, GREEDY))).generation
    assert got.response_token_ids == in_process(moved).generate(PROMPTS, GREEDY).response_token_ids


# 1 KiB: every split matrix's slice (>= 8 KiB) travels alone, the norms in buckets of 512 B; 16 MiB: one
# bucket per rank.
@pytest.mark.parametrize("bucket_bytes", [1024, BUCKET_BYTES], ids=["mostly-alone", "one-bucket"])
def test_a_tensor_parallel_refit_sends_the_split_tensors_once_not_k_times(
    tp_workers, checkpoints, bucket_bytes, monkeypatch
):
    """The bytes that leave the trainer, from the checkpoint's shapes and the sharding rules alone: a split
    tensor's k slices tile it (R x its bytes in all), a replicated one goes to every rank (R x k x its
    bytes); a broadcast of the stream to every process would send R x k x all of it."""
    base, moved, _ = checkpoints
    monkeypatch.setattr(tp_workers, "bucket_bytes", bucket_bytes)
    replicas = tp_workers.replicas
    split = replicated = 0
    for name, tensor in checkpoint_tensors(moved):
        rule = sharding_rule(name)
        nbytes = tensor.numel() * tensor.element_size()
        if rule.kind == "replicated":
            replicated += nbytes
        else:  # k equal slices of dim `rule.dim` (256 vocab rows, 4 heads, 64 MLP rows: all split in 2)
            assert tensor.shape[rule.dim] % TP == 0
            split += nbytes
    assert split > 0 and replicated > 0
    stats = tp_workers.refit(checkpoint_tensors(moved))
    assert stats.bytes == split + replicated
    assert stats.bytes_sent == replicas * (split + TP * replicated)
    broadcast = replicas * TP * (split + replicated)
    assert broadcast - stats.bytes_sent == replicas * (TP - 1) * split
    assert stats.bytes_sent < 0.55 * broadcast  # the split matrices are nearly all the model
    # Each rank got half of every split tensor and every replicated one whole.
    assert [w.bytes for w in stats.workers] == [split // TP + replicated] * TP
    print(
        f"TP={TP} refit, R={replicas}: {stats.bytes_sent} bytes sent, a broadcast would send {broadcast} "
        f"({stats.bytes_sent / broadcast:.3f})"
    )
    got = tp_workers.result(tp_workers.submit(request(PROMPTS, GREEDY))).generation
    assert got.response_token_ids == in_process(moved).generate(PROMPTS, GREEDY).response_token_ids


def test_a_replica_split_the_model_refuses_is_a_clear_error_before_any_process_starts(checkpoints):
    with pytest.raises(
        ValueError,
        match=r"engine.tensor_parallel_size=3 cannot split this llama model: .*valid "
        r"tensor_parallel_size values for this model are 1, 2, 4",
    ):
        RolloutWorkers(checkpoints[2], 1, tensor_parallel_size=3, device="cpu")


def test_workers_under_an_explicit_interpreter_generate_and_refit_like_the_in_process_engine(checkpoints):
    """engine.worker_python = this venv under another name: the workers start through the foreign-interpreter
    path (its own sys.path, no __main__ re-run) and behave as ever: the in-process tokens, a refit equal to a
    fresh build."""
    from tests.stages.common.generation.test_worker_python import same_venv_other_path

    base, moved, engine_dir = checkpoints
    python = same_venv_other_path()
    with RolloutWorkers(
        engine_dir, 1, chunk_size=4, threads=1, timeout_s=30, worker_python=python, device="cpu"
    ) as client:
        assert client.interpreter is not None and client.interpreter.python == python
        got = client.result(client.submit(request(PROMPTS, SAMPLED[1]))).generation
        assert_same(got, in_process(base).generate(PROMPTS, SAMPLED[1]), LOGPROB_TOL)
        client.refit(checkpoint_tensors(moved))
        got = client.result(client.submit(request(PROMPTS, GREEDY))).generation
        assert_same(got, in_process(moved).generate(PROMPTS, GREEDY), LOGPROB_TOL)


def test_workers_under_an_interpreter_that_cannot_host_them_fail_before_any_process_starts(
    checkpoints, tmp_path
):
    from alignflow.stages.common.generation.worker_python import WorkerPythonError

    with pytest.raises(
        WorkerPythonError, match=rf"^engine.worker_python={tmp_path}/python: no executable there"
    ):
        RolloutWorkers(checkpoints[2], 1, worker_python=str(tmp_path / "python"), device="cpu")


def vllm_python() -> str:
    """The python of the vLLM venv named by ALIGNFLOW_VLLM_VENV. scripts/vllm_tests.sh makes that venv,
    installs this checkout into it and runs this test with ALIGNFLOW_REQUIRE_VLLM_VENV=1, which turns every
    skip into a failure; the main suite skips it (it would run the same ~2.5-4 min twice per CI run)."""
    from alignflow.stages.common.generation.worker_python import WorkerPythonError, resolve

    if not os.environ.get("ALIGNFLOW_VLLM_VENV"):
        pytest.skip("ALIGNFLOW_VLLM_VENV is not set: scripts/vllm_tests.sh runs this test with its vLLM venv")
    python = Path(os.environ["ALIGNFLOW_VLLM_VENV"]) / "bin" / "python"
    required = os.environ.get("ALIGNFLOW_REQUIRE_VLLM_VENV") == "1"
    try:
        resolve(str(python), "vllm")
    except WorkerPythonError as exc:
        if required:
            raise
        pytest.skip(f"no usable vLLM venv here ({exc}); scripts/vllm_tests.sh makes one and runs this test")
    return str(python)


@pytest.mark.timeout(900)
def test_workers_under_the_vllm_venv_serve_and_refit_a_vllm_engine_the_trainer_never_imports(tmp_path):
    """The pipeline's shape with engine.backend vllm: the engine stage's build (build_and_check: vllm build,
    parity with hf, save) in a child under the vLLM venv's python, then a rollout worker under it, refit over
    gloo by this process (the main venv's torch); greedy tokens equal hf's before and after the refit.
    Measured on the loaded 2-core box: ~2.5 min (vLLM's import and start, ~45 s per process)."""
    import sys

    from alignflow.config import EngineConfig
    from alignflow.stages.common.generation.worker_python import call_in, resolve
    from alignflow.stages.engine import build_and_check

    python = vllm_python()
    wide = {"hidden_size": 256, "intermediate_size": 512}  # head_dim 64: vLLM's CPU attention has no 16
    base = save_tiny_model(tmp_path / "base", "llama_mha_untied", **wide)
    moved = save_tiny_model(tmp_path / "moved", "llama_mha_untied", seed=3, **wide)
    prompts = random_prompts(4, seed=8)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    config = EngineConfig(
        backend="vllm", max_batch_size=16, max_seq_len=64, parity_new_tokens=8, worker_python=python
    )
    (tmp_path / "engine").mkdir()
    report = call_in(
        resolve(python, "vllm"),
        build_and_check,
        base,
        config,
        "float32",
        prompts,
        tmp_path / "engine",
        what="the vllm engine build",
    )
    assert report["parity"]["ok"] and report["parity"]["greedy_matching_sequences"] == 4
    assert report["execution_paths"]["backend"] == "vllm" and report["execution_paths"]["python"] == python
    hf = EngineConfig(backend="hf", max_batch_size=16, max_seq_len=64)
    with RolloutWorkers(
        tmp_path / "engine", 1, chunk_size=4, threads=1, timeout_s=300, worker_python=python, device="cpu"
    ) as w:
        assert w.workers[0].info["backend"] == "vllm"
        got = w.result(w.submit(request(prompts, greedy))).generation.response_token_ids
        assert got == build_engine(base, hf, device="cpu").generate(prompts, greedy).response_token_ids
        stats = w.refit(checkpoint_tensors(moved))
        assert stats.tensors == 21
        got = w.result(w.submit(request(prompts, greedy))).generation.response_token_ids
        assert got == build_engine(moved, hf, device="cpu").generate(prompts, greedy).response_token_ids
    assert "vllm" not in sys.modules


def test_a_sigkilled_tensor_parallel_rank_fails_result_within_seconds_naming_it(tp_workers, checkpoints):
    """Last user of tp_workers: its follower rank is killed mid-generate (the leader is then stuck in an
    all_reduce); the trainer names the dead rank at once, not after the collective's timeout."""
    tp_workers.refit(checkpoint_tensors(checkpoints[0]))
    long = SamplingParams(temperature=1.0, max_new_tokens=48, seed=1)
    ticket = tp_workers.submit(request(random_prompts(32, seed=1), long))
    time.sleep(0.3)
    victim = tp_workers.workers[1]
    os.kill(victim.pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(
        RolloutWorkerError,
        match=rf"rollout worker 1 \(replica 0, tensor-parallel rank 1 of 2, pid "
        rf"{victim.pid}\) died \(killed by signal SIGKILL\) while generating "
        r"iteration 1",
    ):
        tp_workers.result(ticket)
    assert time.monotonic() - killed < 5.0
    tp_workers.close()
    _assert_all_gone(tp_workers)


def _assert_all_gone(client: RolloutWorkers) -> None:
    assert all(w.process.exitcode is not None for w in client.workers)
    for w in client.workers:
        assert (
            not os.path.exists(f"/proc/{w.pid}") or "zombie" in open(f"/proc/{w.pid}/status").read().lower()
        )


def test_a_sigkilled_worker_fails_result_within_seconds_naming_it(checkpoints):
    client = RolloutWorkers(checkpoints[2], WORKERS, chunk_size=2, threads=1, timeout_s=30, device="cpu")
    try:
        long = SamplingParams(temperature=1.0, max_new_tokens=48, seed=1)
        # 256 prompts: on the Intel Xeon with AMX two workers finished 32 of them within the 0.3 s below, so
        # the kill came after the work; the error must surface without the rest of it being awaited.
        ticket = client.submit(request(random_prompts(256, seed=1), long))
        time.sleep(0.3)  # both workers are generating
        victim = client.workers[1]
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(
            RolloutWorkerError,
            match=rf"rollout worker 1 \(pid {victim.pid}\) died \(killed by signal "
            r"SIGKILL\) while generating iteration 1",
        ) as caught:
            client.result(ticket)
        assert time.monotonic() - killed < 5.0
        assert caught.value.worker == 1 and caught.value.pid == victim.pid
        with pytest.raises(RolloutWorkerError, match=r"rollout worker 1 .* died"):
            client.refit(checkpoint_tensors(checkpoints[0]))  # broken for good, and says why at once
    finally:
        client.close()
    client.close()  # twice is fine
    _assert_all_gone(client)


def test_a_worker_killed_mid_refit_fails_the_refit_within_seconds_naming_it(checkpoints):
    client = RolloutWorkers(checkpoints[2], WORKERS, chunk_size=4, threads=1, timeout_s=30, device="cpu")
    try:
        victim = client.workers[0]
        killed: list[float] = []

        def stream():
            for i, item in enumerate(checkpoint_tensors(checkpoints[1])):
                if i == 3:  # a worker dies between two broadcasts of the weight stream
                    os.kill(victim.pid, signal.SIGKILL)
                    killed.append(time.monotonic())
                yield item

        with pytest.raises(
            RolloutWorkerError,
            match=rf"rollout worker 0 \(pid {victim.pid}\) died \(killed by "
            r"signal SIGKILL\) while refitting",
        ):
            client.refit(stream())
        assert time.monotonic() - killed[0] < 5.0
    finally:
        client.close()
    _assert_all_gone(client)


def _worker_pids(stage_pid: int) -> list[int]:
    """The rollout worker processes a stage spawned (its multiprocessing children, not the resource
    tracker)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = open(f"/proc/{entry}/stat").read()
            cmdline = open(f"/proc/{entry}/cmdline").read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == stage_pid and "spawn_main" in cmdline:
            pids.append(int(entry))
    return sorted(pids)


@pytest.mark.slow
def test_rl_stage_on_two_workers_fails_in_seconds_when_one_is_killed_and_the_rerun_resumes(upstream):
    """Acceptance: the RL stage with engine.rollout_workers=2 (and unload_during_training); SIGKILL of a
    worker after the iteration-1 checkpoint fails the stage within seconds naming the worker; the re-run
    resumes and keeps engine == actor (fp32, autocast off: the check compares the workers' log-probs with the
    actor's)."""
    import json
    from pathlib import Path

    from tests.stages.ppo.test_ppo import finish, local, ppo_spec, start_stage

    workdir, _, _ = upstream
    # 10 iterations: the kill must land while the stage still runs, and an iteration of this model is quick
    # (a tenth of a second), so with 3 the stage can finish the two after the first checkpoint before the kill
    # lands.
    spec = ppo_spec(
        upstream,
        "workers",
        algorithm="grpo",
        group_size=4,
        prompts_per_iteration=4,
        minibatch_size=16,
        iterations=10,
        checkpoint_every=1,
        autocast="off",
    )
    spec = spec.model_copy(
        update={
            "config": {
                **spec.config,
                "engine": {
                    **spec.config["engine"],
                    "rollout_workers": 2,
                    "queue_chunk": 4,
                    "unload_during_training": True,
                },
            }
        }
    )
    first_checkpoint = local(spec.output_uri) / "checkpoints" / "iter_00001" / "manifest.json"
    proc = start_stage(spec, workdir)
    deadline = time.time() + 600
    while not first_checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert first_checkpoint.exists(), (
        proc.communicate()[1][-3000:] if proc.poll() is not None else "timed out"
    )
    pids = _worker_pids(proc.pid)
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    code, result, stderr = finish(proc)
    assert time.monotonic() - killed < 15, "the stage noticed the dead worker within seconds"
    assert code != 0
    assert re.search(
        rf"rollout worker \d \(pid {pids[1]}\) died \(killed by signal SIGKILL\) while", result.message
    ), result.message
    assert all(not Path(f"/proc/{pid}").exists() for pid in pids), "no worker outlives the stage"

    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    assert "2 rollout worker processes" in stderr
    assert result.metrics["iterations"] == 10
    history = [
        json.loads(line) for line in (local(result.output_uri) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["iteration"] for m in history] == list(range(1, 11))
    resumed = history[-1]
    assert resumed["refit/bytes_sent"] == 2 * resumed["refit/bytes"] > 0
    assert resumed["perf/rollout_workers"] == 2 and resumed["perf/rollout_chunks"] == 4
    assert resumed["perf/rollout_imbalance"] >= 1.0
    assert resumed["timing/engine_reload"] >= 0 and resumed["timing/engine_unload"] >= 0
    assert resumed["perf/engine_freed_bytes"] > 0, (
        "the workers' KV caches were freed while the trainer trained"
    )
    assert resumed["rollout/logprob_engine_vs_actor_max"] < 1e-4, (
        "the resumed run refit the workers to the actor"
    )


def test_the_rl_stage_refuses_a_tensor_parallel_engine_without_rollout_workers(tmp_path):
    """Tensor-parallel engines run in rollout workers only: the stage says so before it loads anything."""
    from alignflow.contract import StageSpec
    from alignflow.stages.common.runtime import StageInputError
    from alignflow.stages.ppo import stage as ppo

    spec = StageSpec(
        stage="ppo",
        config={"ppo": {}, "model": {}, "engine": {"tensor_parallel_size": 2}},
        inputs={"reward_rm": f"file://{tmp_path}/none"},
        output_uri=f"file://{tmp_path}/out",
    )
    with pytest.raises(
        StageInputError,
        match=r"engine.tensor_parallel_size=2 with engine.rollout_workers=0: "
        r"tensor-parallel engines run in rollout workers; set "
        r"engine.rollout_workers >= 1",
    ):
        ppo.run(spec)


def test_the_rl_stage_runs_a_vllm_engine_in_rollout_workers_only(tmp_path):
    """The trainer never imports vLLM: with engine.backend vllm the stage asks for rollout workers first."""
    from alignflow.contract import StageSpec
    from alignflow.stages.common.runtime import StageInputError
    from alignflow.stages.ppo import stage as ppo

    spec = StageSpec(
        stage="ppo",
        config={"ppo": {}, "model": {}, "engine": {"backend": "vllm"}},
        inputs={"reward_rm": f"file://{tmp_path}/none"},
        output_uri=f"file://{tmp_path}/out",
    )
    with pytest.raises(
        StageInputError,
        match=r"engine.backend: vllm with engine.rollout_workers=0: the vLLM engine "
        r"runs in rollout worker processes.*set engine.rollout_workers >= 1",
    ):
        ppo.run(spec)
