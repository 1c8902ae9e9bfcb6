"""The RL stage as a program: alignment on the demo task, resume after SIGKILL, NaN guard, rollouts, refit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from alignflow.contract import StageResult, StageSpec, TrackingSpec, stage_program
from alignflow.manifest import find_published, output_uri, read_manifest
from alignflow.stages.common.rollouts import ROLLOUT_SCHEMA, read_rollouts
from alignflow.stages.ppo.iteration_flops import IterationShape, pass_flops, spec_of
from alignflow.tracking import ATTEMPT_KEY_TAG, SUPERSEDED_BY_TAG, attempt_key
from tests.conftest import REPO, small_config

pytestmark = pytest.mark.slow

PPO_TEST = {"iterations": 4, "prompts_per_iteration": 8, "minibatch_size": 8, "max_new_tokens": 16,
            "checkpoint_every": 2}


def ppo_spec(upstream, name: str, tracking: bool = False, reward_model: bool = True, **ppo) -> StageSpec:
    workdir, config, rows = upstream
    section = {"ppo": {**config.ppo.model_dump(mode="json"), **PPO_TEST, **ppo},
               "model": config.model.model_dump(mode="json"), "engine": config.engine.model_dump(mode="json")}
    inputs = {
        "engine": "engine",
        "sft": "sft",
        "data": "data",
        **({"reward_rm": "reward-rm"} if reward_model else {}),
    }
    tracking_spec = None
    if tracking:
        tracking_spec = TrackingSpec(uri=f"sqlite:///{workdir / 'mlflow.db'}", experiment="test")
    return StageSpec(
        stage="ppo",
        config=section,
        inputs={k: rows[v]["output_uri"] for k, v in inputs.items()},
        input_digests={k: rows[v]["manifest_digest"] for k, v in inputs.items()},
        output_uri=output_uri(f"file://{workdir}/tests", "ppo", {"name": name, **section}, {}, "t"),
        tracking=tracking_spec,
        code_version="test",
        workdir=str(workdir),
    )


def start_stage(spec: StageSpec, workdir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    path = spec.dump(workdir / f"spec-{spec.output_uri.rsplit('/', 1)[1]}-{spec.stage}.json")
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-m", stage_program(spec.stage), "--spec", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=workdir,
        env=environment,
    )


def finish(proc: subprocess.Popen) -> tuple[int, StageResult, str]:
    stdout, stderr = proc.communicate(timeout=900)
    return proc.returncode, StageResult.from_output(stdout), stderr


def local(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


def attempt_runs(client: MlflowClient, spec: StageSpec) -> list:
    """The MLflow runs of every attempt at the spec's output, oldest first."""
    experiment = client.get_experiment_by_name(spec.tracking.experiment)
    if experiment is None:
        return []
    runs = client.search_runs(
        [experiment.experiment_id],
        filter_string=f"tags.`{ATTEMPT_KEY_TAG}` = '{attempt_key(spec.output_uri)}'",
    )
    return sorted(runs, key=lambda run: run.info.start_time)


def wait_for_step(client: MlflowClient, spec: StageSpec, proc: subprocess.Popen, step: int) -> str:
    """Poll MLflow until the stage's (only) run has `step` of timing/iteration; the run's id. Fails if the
    stage ends first: the step must be there while it runs."""
    deadline = time.time() + 600
    while time.time() < deadline:
        assert proc.poll() is None, (
            f"the stage ended before step {step} was in MLflow: {proc.communicate()[1][-3000:]}"
        )
        runs = attempt_runs(client, spec)
        if runs and step in {
            m.step for m in client.get_metric_history(runs[-1].info.run_id, "timing/iteration")
        }:
            return runs[-1].info.run_id
        time.sleep(0.2)
    raise AssertionError(f"step {step} not in MLflow after 600 s")


def logged_history(client: MlflowClient, run_id: str, keys) -> dict[str, list[tuple[int, float]]]:
    """(step, value) pairs of each metric key, sorted by step, from step 1 (step 0 holds the stage's
    totals)."""
    return {
        key: sorted((m.step, m.value) for m in client.get_metric_history(run_id, key) if m.step >= 1)
        for key in keys
    }


def jsonl_history(path: Path) -> dict[str, list[tuple[int, float]]]:
    """The same, from a metrics.jsonl (one dict per iteration)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key != "iteration":
                out.setdefault(key, []).append((int(row["iteration"]), value))
    return out


def stage_device(request) -> str:
    """The device every stage of these tests must compute on (pytest --device): 'cpu' or 'cuda:0'."""
    import torch

    chosen = request.config.getoption("--device", default="cpu")
    if chosen == "auto":
        chosen = "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda:0" if chosen == "cuda" else "cpu"


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_rl_raises_held_out_gold_score_above_sft(upstream, algorithm, request):
    """With a fixed seed, the RL policy beats SFT on the gold score of held-out prompts (evaluate stage);
    every model of every stage computed on the test's device (a GPU check fails if one trained on the CPU
    beside it)."""
    workdir, config, rows = upstream
    where = stage_device(request)
    assert {key: rows[key]["devices"] for key in ("sft", "reward-rm", "engine")} == {
        "sft": {"train": where},
        "reward-rm": {"train": where},
        "engine": {"generate": where},
    }
    extra = {"group_size": 4, "prompts_per_iteration": 8, "minibatch_size": 16} if algorithm == "grpo" else {}
    spec = ppo_spec(
        upstream,
        f"align-{algorithm}",
        algorithm=algorithm,
        iterations=12,
        checkpoint_every=12,
        max_new_tokens=24,
        **extra,
    )
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    roles = {"train", "reference", "score", "generate"} | ({"critic"} if algorithm == "ppo" else set())
    assert result.devices == dict.fromkeys(roles, where), result.devices
    # Sampled at T=1 like the demo: greedy decoding of this tiny model collapses for SFT and policy alike.
    evaluate = {
        "evaluate": {
            **config.evaluate.model_dump(mode="json"),
            "n_prompts": 8,
            "max_new_tokens": 24,
            "temperature": 1.0,
        },
        "model": spec.config["model"],
        "engine": spec.config["engine"],
    }
    eval_spec = StageSpec(
        stage="evaluate",
        config=evaluate,
        inputs={
            "ppo": result.output_uri,
            "sft": spec.inputs["sft"],
            "data": spec.inputs["data"],
            "reward_rm": spec.inputs["reward_rm"],
        },
        output_uri=output_uri(
            f"file://{workdir}/tests", "evaluate", evaluate, {"ppo": result.manifest_digest}, "t"
        ),
        code_version="test",
        workdir=str(workdir),
    )
    code, evaluation, stderr = finish(start_stage(eval_spec, workdir))
    assert code == 0, stderr[-3000:]
    report = json.loads((local(evaluation.output_uri) / "eval.json").read_text())
    assert evaluation.devices == {"generate": where, "score": where, "reference": where}
    assert evaluation.metrics["eval/gold_delta"] > 0.1, report
    assert evaluation.metrics["eval/kl_to_ref"] < config.evaluate.kl_budget


def test_metrics_reach_mlflow_as_each_iteration_ends(upstream, tmp_path):
    """Live curves: iteration 1's metrics are in MLflow while the stage is still running (held in iteration 2
    by the reward function until the test releases it), long before the only checkpoint (iteration 3)."""
    workdir, _, _ = upstream
    spec = ppo_spec(
        upstream,
        "live",
        tracking=True,
        iterations=3,
        checkpoint_every=3,
        reward_functions=["tests.stages.reward_fixtures:stall_when_asked"],
    )
    release = tmp_path / "release"
    proc = start_stage(
        spec, workdir, env={"ALIGNFLOW_TEST_STALL_AT": "2", "ALIGNFLOW_TEST_RELEASE": str(release)}
    )
    client = MlflowClient(spec.tracking.uri)
    try:
        run_id = wait_for_step(client, spec, proc, 1)
        live = client.get_run(run_id)
        assert live.info.status == "RUNNING"
        assert not (local(spec.output_uri) / "checkpoints").exists(), "no checkpoint was written yet"
        during = logged_history(client, run_id, live.data.metrics)
    finally:
        release.touch()
    code, result, stderr = finish(proc)
    assert code == 0, stderr[-3000:]
    assert result.mlflow_run_id == run_id
    expected = jsonl_history(local(result.output_uri) / "metrics.jsonl")
    # Every key of iteration 1 was in MLflow during the run, with the value metrics.jsonl has.
    first = {k: [(step, value) for step, value in v if step == 1] for k, v in expected.items()}
    assert {k: v for k, v in during.items() if k in expected} == {k: v for k, v in first.items() if v}
    assert logged_history(client, run_id, expected) == expected, "each iteration once, as in metrics.jsonl"


def test_resume_after_sigkill_is_continuous(upstream):
    workdir, _, _ = upstream
    # The reward function holds iteration 4 of the first attempt: the kill lands after the iteration-2
    # checkpoint and after iteration 3 reached MLflow, however fast the iterations are. The resumed attempt
    # runs iteration 3 again (other timings at least), so the killed attempt's step 3 must not show.
    spec = ppo_spec(
        upstream, "resume", tracking=True, reward_functions=["tests.stages.reward_fixtures:stall_when_asked"]
    )
    first_checkpoint = local(spec.output_uri) / "checkpoints" / "iter_00002" / "manifest.json"
    proc = start_stage(spec, workdir, env={"ALIGNFLOW_TEST_STALL_AT": "4"})
    client = MlflowClient(spec.tracking.uri)
    killed_run = wait_for_step(client, spec, proc, 3)
    assert first_checkpoint.exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert find_published(spec.output_uri) is None, "a killed stage must not look finished"
    killed_step3 = logged_history(client, killed_run, ["timing/iteration"])["timing/iteration"][2]
    # What a kill in the middle of a write leaves, whether or not this kill landed in one: the temp files of
    # atomic writes and a checkpoint folder without its manifest. The resumed run must not publish them.
    killed_out = local(spec.output_uri)
    leftovers = [
        killed_out / "rollouts" / ".iter_00004.parquet.0123456789abcdef.tmp",
        killed_out / ".tmp-k1ll3d",
        killed_out / "checkpoints" / "iter_00004" / "rng.json",
    ]
    for path in leftovers:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half-written")

    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    assert "removed what an interrupted run left half-written" in stderr
    assert result.metrics["iterations"] == 4
    out = local(result.output_uri)
    files = sorted(p.name for p in (out / "rollouts").iterdir())
    assert files == [f"iter_{i:05d}.parquet" for i in range(1, 5)]
    published = {entry.path for entry in read_manifest(result.output_uri).files}
    assert not any(".tmp" in name for name in published), sorted(published)
    assert b"half-written" not in (out / "checkpoints" / "iter_00004" / "rng.json").read_bytes()
    for i, name in enumerate(files, start=1):
        assert set(pq.read_table(out / "rollouts" / name).column("iteration").to_pylist()) == {i}
    history = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert history == [1, 2, 3, 4]

    # MLflow: the run the stage reports is a fresh one that holds each step once, with the values of
    # metrics.jsonl (steps 1-2 copied from the checkpoint's history, 3-4 the resumed attempt's live ones).
    run_id = result.mlflow_run_id
    assert run_id != killed_run
    expected = jsonl_history(out / "metrics.jsonl")
    assert logged_history(client, run_id, expected) == expected
    assert expected["timing/iteration"][2] != killed_step3, (
        "the killed attempt's iteration 3 is not the one kept"
    )
    resumed = client.get_run(run_id)
    assert resumed.data.tags["alignflow.resumed_at_iteration"] == "2"
    assert resumed.data.tags["alignflow.resumed_from_run"] == killed_run
    # The killed attempt's run: ended (its process could not), and pointing at the run that replaces it.
    killed = client.get_run(killed_run)
    assert killed.info.status == "KILLED"
    assert killed.data.tags[SUPERSEDED_BY_TAG] == run_id
    assert killed.info.run_name == "ppo (superseded)"
    assert [r.info.run_id for r in attempt_runs(client, spec)] == [killed_run, run_id]


def test_nan_reward_stops_with_iteration_and_last_good_checkpoint(upstream, tmp_path):
    workdir, _, _ = upstream
    spec = ppo_spec(
        upstream,
        "nan",
        algorithm="grpo",
        group_size=2,
        minibatch_size=16,
        reward_functions=["tests.stages.reward_fixtures:nan_on_second_call"],
        reward_function_weights=[1.0],
    )
    code, result, stderr = finish(
        start_stage(spec, workdir, env={"ALIGNFLOW_TEST_COUNTER": str(tmp_path / "n")})
    )
    assert code == 1
    checkpoint = f"{spec.output_uri}/checkpoints/iter_00001"
    assert result.status == "failed"
    assert result.message == (
        "NonFiniteError: iteration 2: the reward is not finite (16 NaN/inf value(s)); "
        f"stopped. Last good checkpoint: {checkpoint} (iteration 1)"
    )
    assert find_published(checkpoint) is not None
    assert find_published(spec.output_uri) is None


def test_grpo_on_a_reward_function_alone_runs_without_reward_models_or_reference(upstream):
    workdir, _, _ = upstream
    spec = ppo_spec(
        upstream,
        "functions-only",
        reward_model=False,
        algorithm="grpo",
        group_size=4,
        prompts_per_iteration=4,
        minibatch_size=16,
        iterations=2,
        checkpoint_every=2,
        kl_coef=0.0,
        reward_functions=["alignflow.stages.ppo.reward_functions:letter_share"],
    )
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    assert "reference forward skipped (kl_coef 0)" in stderr
    frame = pd.read_parquet(local(result.output_uri) / "rollouts" / "iter_00002.parquet")
    assert all(
        set(rewards) == {"alignflow.stages.ppo.reward_functions:letter_share"}
        for rewards in frame["rewards"].map(dict)
    )
    assert frame["ref_logprobs"].isna().all() and frame["values"].isna().all()
    assert not any(key.startswith("kl/") for key in result.metrics)
    # What the run ran with, for its bottleneck advice (one rank, ZeRO 0: never "a lower ZeRO stage")
    facts = json.loads((local(result.output_uri) / "alignflow_run.json").read_text())["run_facts"]
    assert facts["minibatches"] == 1 and facts["generate_calls"] == 1  # 16 rollouts, minibatches of 16
    assert facts["zero_stage"] == 0
    assert "a lower ZeRO stage" not in result.message
    # Model FLOPs of what ran (no reward model, no reference): a training step an epoch over the file's rows.
    from transformers import AutoConfig

    from alignflow.config import PPOConfig

    last = json.loads((local(result.output_uri) / "metrics.jsonl").read_text().splitlines()[-1])
    assert {key for key in last if key.startswith("flops/")} == {"flops/generate", "flops/train"}
    shape = IterationShape.of(list(frame["prompt_id"]), [list(ids) for ids in frame["prompt_token_ids"]],
                              list(frame["length"]))
    actor = spec_of(AutoConfig.from_pretrained(local(spec.inputs["sft"])))
    epochs = PPOConfig(**spec.config["ppo"]).ppo_epochs
    assert last["flops/train"] == epochs * 3 * pass_flops(actor, shape)
    assert last["perf/tflops/train"] == pytest.approx(last["flops/train"] / last["timing/train"] / 1e12)


def test_async_rollouts_are_one_step_off_policy_and_trained_with_behaviour_weights(upstream):
    workdir, _, _ = upstream
    spec = ppo_spec(
        upstream,
        "async",
        algorithm="grpo",
        group_size=4,
        prompts_per_iteration=4,
        minibatch_size=16,
        iterations=3,
        checkpoint_every=3,
        async_rollouts=True,
    )
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    out = local(result.output_uri)
    versions = [
        set(pd.read_parquet(out / "rollouts" / f"iter_{i:05d}.parquet")["policy_version"]) for i in (1, 2, 3)
    ]
    assert versions == [{0}, {0}, {1}]  # iteration k+1 was generated while iteration k trained
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/policy_lag"] for m in history] == [0, 1, 1]
    assert "losses/behaviour_weight_mean" not in history[0]  # on-policy: no weights
    for m in history[1:]:
        # pi_prox / pi_behaviour, capped at async_weight_cap
        assert 0 < m["losses/behaviour_weight_mean"] <= 2.0


def test_rollouts_read_back_and_engine_refit_every_iteration(upstream):
    workdir, _, _ = upstream
    # fp32 training: the check below compares the engine with the actor, which bf16 autocast would blur (by
    # about 5e-3).
    spec = ppo_spec(upstream, "rollouts", iterations=3, checkpoint_every=3, autocast="off")
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    out = local(result.output_uri)
    paths = sorted((out / "rollouts").glob("*.parquet"))
    table = read_rollouts(paths)
    assert table.schema.equals(ROLLOUT_SCHEMA, check_metadata=False)
    assert table.num_rows == 3 * PPO_TEST["prompts_per_iteration"]
    frame = pd.read_parquet(paths[0])
    assert list(frame.columns) == ROLLOUT_SCHEMA.names and len(frame) == PPO_TEST["prompts_per_iteration"]
    assert (frame["length"] == frame["response_token_ids"].map(len)).all()
    assert pq.ParquetFile(paths[0]).metadata.row_group(0).column(0).compression == "ZSTD"
    import duckdb

    rows = duckdb.sql(
        f"SELECT iteration, count(*) FROM read_parquet('{out}/rollouts/*.parquet') "
        "GROUP BY iteration ORDER BY iteration"
    ).fetchall()
    assert rows == [(1, 8), (2, 8), (3, 8)]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["timing/refit"] > 0 for m in metrics), "the engine is refit every iteration"
    profile = (out / "profile.md").read_text()
    assert "| engine_load | 1 |" in profile, (
        "the engine is loaded once (built by the engine stage), not rebuilt"
    )
    assert "| refit | 3 |" in profile
    assert max(m["rollout/logprob_engine_vs_actor_max"] for m in metrics) < 1e-4, (
        "refit keeps engine == actor"
    )


def test_failed_pipeline_rerun_skips_finished_stages_and_ppo_continues(upstream, tmp_path, monkeypatch):
    from alignflow.flows.pipeline import alignflow_pipeline

    workdir, _, rows = upstream
    monkeypatch.setenv("ALIGNFLOW_TEST_COUNTER", str(tmp_path / "calls"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    config = small_config(
        workdir,
        stages=["data", "base", "sft", "reward", "engine", "ppo"],
        engine={"max_seq_len": 96, "max_batch_size": 32},
        ppo={
            **PPO_TEST,
            "reward_functions": ["tests.stages.reward_fixtures:fail_once_on_third_call"],
            "reward_function_weights": [0.0],
        },
        deployment={"stage_retries": 0},
    )
    with pytest.raises(Exception, match="stage 'ppo' failed: RuntimeError: injected failure at iteration 3"):
        alignflow_pipeline(config)
    again = {row["key"]: row for row in alignflow_pipeline(config)}
    assert {k: again[k]["status"] for k in rows} == {k: "skipped" for k in rows}
    assert again["ppo"]["status"] == "ok" and again["ppo"]["metrics"]["iterations"] == 4
    out = local(again["ppo"]["output_uri"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_00002", "iter_00004"]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    run = client.get_run(again["ppo"]["mlflow_run_id"])
    assert run.data.tags.get("alignflow.resumed_at_iteration") == "2", "PPO continued from its checkpoint"
    assert run.data.tags["mlflow.parentRunId"] == again["ppo"]["parent_run_id"], (
        "nested under the rerun's pipeline"
    )
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "timing/iteration")) == [
        1,
        2,
        3,
        4,
    ]
    failed = client.get_run(run.data.tags["alignflow.resumed_from_run"])
    assert failed.info.status == "FAILED" and failed.data.tags[SUPERSEDED_BY_TAG] == run.info.run_id


@pytest.mark.parametrize("with_reference,critic", [(True, True), (False, False)])
def test_rollout_rows_hold_each_rows_own_slice_of_the_iterations_tensors(tmp_path, with_reference, critic):
    import torch

    from alignflow.stages.common.generation.interface import Generation, SamplingParams
    from alignflow.stages.common.rollouts import write_rollouts
    from alignflow.stages.ppo.experience import Experience
    from alignflow.stages.ppo.rollout_client import Rollout, RolloutRequest
    from alignflow.stages.ppo.rollout_writer import rollout_rows

    torch.manual_seed(0)
    lengths, width = [3, 5, 1], 5
    rand = lambda: torch.randn(len(lengths), width)  # noqa: E731
    exp = Experience(
        input_ids=torch.zeros(3, 7, dtype=torch.long),
        attention_mask=torch.ones(3, 7, dtype=torch.long),
        position_ids=torch.zeros(3, 7, dtype=torch.long),
        response_ids=torch.zeros(3, 5, dtype=torch.long),
        response_mask=torch.ones(3, 5),
        rollout_logprobs=rand(),
        old_logprobs=rand(),
        ref_logprobs=rand(),
        values=rand() if critic else None,
        scores=torch.randn(3),
        token_rewards=rand(),
        kl=rand(),
        advantages=rand(),
        returns=rand() if critic else None,
        prompt_width=2,
    )
    generation = Generation(
        response_token_ids=[[7] * n for n in lengths],
        logprobs=[[0.0] * n for n in lengths],
        finish_reasons=["eos", "length", "eos"],
    )
    components, seq_kl = {"rm": torch.randn(3), "len": torch.randn(3)}, torch.randn(3)
    request = RolloutRequest(4, [2, 0, 1], [2, 0, 1], [[1, 2]] * 3, SamplingParams())
    rollout = Rollout(request, generation, seconds=0.0, weights_version=3)
    rows = rollout_rows(
        rollout, [None, None, None], ["a", "b", "c"], ["x", "y", "z"], exp, components, seq_kl, with_reference
    )
    for b, (row, n) in enumerate(zip(rows, lengths, strict=True)):
        assert row["logprobs"] == exp.rollout_logprobs[b, :n].tolist()
        assert row["ref_logprobs"] == (exp.ref_logprobs[b, :n].tolist() if with_reference else None)
        assert row["values"] == (exp.values[b, :n].tolist() if critic else None)
        assert row["returns"] == (exp.returns[b, :n].tolist() if critic else None)
        assert row["advantages"] == exp.advantages[b, :n].tolist()
        assert row["token_rewards"] == exp.token_rewards[b, :n].tolist()
        assert row["rewards"] == {name: float(v[b]) for name, v in components.items()}
        assert (row["reward_total"], row["kl"], row["length"]) == (float(exp.scores[b]), float(seq_kl[b]), n)
        assert row["prompt_id"] == str([2, 0, 1][b])
        assert (row["iteration"], row["policy_version"], row["prompt_token_ids"]) == (4, 3, [1, 2])
    write_rollouts(rows, tmp_path / "iter_00004.parquet")  # the schema takes them
    assert read_rollouts(tmp_path / "iter_00004.parquet").num_rows == 3
