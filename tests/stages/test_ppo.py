"""The RL stage as a program: alignment on the demo task, resume after SIGKILL, the NaN guard, rollouts, refit."""

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

from alignflow.contract import StageResult, StageSpec, TrackingSpec
from alignflow.manifest import find_published, output_uri, read_manifest
from alignflow.stages.rollouts import ROLLOUT_SCHEMA, read_rollouts
from tests.conftest import REPO, small_config

pytestmark = pytest.mark.slow

PPO_TEST = {"iterations": 4, "prompts_per_iteration": 8, "minibatch_size": 8, "max_new_tokens": 16,
            "checkpoint_every": 2}


def ppo_spec(upstream, name: str, tracking: bool = False, reward_model: bool = True, **ppo) -> StageSpec:
    workdir, config, rows = upstream
    section = {"ppo": {**config.ppo.model_dump(mode="json"), **PPO_TEST, **ppo},
               "model": config.model.model_dump(mode="json"), "engine": config.engine.model_dump(mode="json")}
    inputs = {"engine": "engine", "sft": "sft", "data": "data", **({"reward_rm": "reward-rm"} if reward_model else {})}
    tracking_spec = None
    if tracking:
        tracking_spec = TrackingSpec(uri=f"sqlite:///{workdir / 'mlflow.db'}", experiment="test")
    return StageSpec(stage="ppo", config=section, inputs={k: rows[v]["output_uri"] for k, v in inputs.items()},
                     input_digests={k: rows[v]["manifest_digest"] for k, v in inputs.items()},
                     output_uri=output_uri(f"file://{workdir}/tests", "ppo", {"name": name, **section}, {}, "t"),
                     tracking=tracking_spec, code_version="test", workdir=str(workdir))


def start_stage(spec: StageSpec, workdir: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    path = spec.dump(workdir / f"spec-{spec.output_uri.rsplit('/', 1)[1]}-{spec.stage}.json")
    environment = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", f"alignflow.stages.{spec.stage}", "--spec", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=workdir, env=environment)


def finish(proc: subprocess.Popen) -> tuple[int, StageResult, str]:
    stdout, stderr = proc.communicate(timeout=900)
    return proc.returncode, StageResult.from_output(stdout), stderr


def local(uri: str) -> Path:
    return Path(uri.removeprefix("file://"))


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_rl_raises_held_out_gold_score_above_sft(upstream, algorithm):
    """With a fixed seed, the RL policy beats SFT on the gold score of held-out prompts (evaluate stage)."""
    workdir, config, rows = upstream
    extra = {"group_size": 4, "prompts_per_iteration": 8, "minibatch_size": 16} if algorithm == "grpo" else {}
    spec = ppo_spec(upstream, f"align-{algorithm}", algorithm=algorithm, iterations=12, checkpoint_every=12,
                    max_new_tokens=24, **extra)
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    # Sampled at T=1 like the demo: greedy decoding of this tiny model collapses for SFT and policy alike.
    evaluate = {"evaluate": {**config.evaluate.model_dump(mode="json"), "n_prompts": 8, "max_new_tokens": 24,
                             "temperature": 1.0},
                "model": spec.config["model"], "engine": spec.config["engine"]}
    eval_spec = StageSpec(stage="evaluate", config=evaluate,
                          inputs={"ppo": result.output_uri, "sft": spec.inputs["sft"], "data": spec.inputs["data"],
                                  "reward_rm": spec.inputs["reward_rm"]},
                          output_uri=output_uri(f"file://{workdir}/tests", "evaluate", evaluate,
                                                {"ppo": result.manifest_digest}, "t"),
                          code_version="test", workdir=str(workdir))
    code, evaluation, stderr = finish(start_stage(eval_spec, workdir))
    assert code == 0, stderr[-3000:]
    report = json.loads((local(evaluation.output_uri) / "eval.json").read_text())
    assert evaluation.metrics["eval/gold_delta"] > 0.1, report
    assert evaluation.metrics["eval/kl_to_ref"] < config.evaluate.kl_budget


def test_resume_after_sigkill_is_continuous(upstream):
    workdir, _, _ = upstream
    # The reward function adds 0 and, in the first run only, stalls in iteration 3: the kill lands after the
    # iteration-2 checkpoint however fast the iterations are (without it, iterations 3 and 4 finished within the
    # 0.2 s poll on 2 cores).
    spec = ppo_spec(upstream, "resume", tracking=True,
                    reward_functions=["tests.stages.reward_fixtures:stall_from_third_call_when_asked"])
    first_checkpoint = local(spec.output_uri) / "checkpoints" / "iter_00002" / "manifest.json"
    proc = start_stage(spec, workdir, env={"ALIGNFLOW_TEST_STALL": "1"})
    deadline = time.time() + 600
    while not first_checkpoint.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert first_checkpoint.exists(), proc.communicate()[1][-3000:] if proc.poll() is not None else "timed out"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert find_published(spec.output_uri) is None, "a killed stage must not look finished"
    # What a kill in the middle of a write leaves, whether or not this kill landed in one: the temp files of
    # atomic writes and a checkpoint folder without its manifest. The resumed run must not publish them.
    killed_out = local(spec.output_uri)
    leftovers = [killed_out / "rollouts" / ".iter_00004.parquet.0123456789abcdef.tmp",
                 killed_out / ".tmp-k1ll3d", killed_out / "checkpoints" / "iter_00004" / "rng.pt"]
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
    assert b"half-written" not in (out / "checkpoints" / "iter_00004" / "rng.pt").read_bytes()
    for i, name in enumerate(files, start=1):
        assert set(pq.read_table(out / "rollouts" / name).column("iteration").to_pylist()) == {i}
    history = [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert history == [1, 2, 3, 4]
    client = MlflowClient(spec.tracking.uri)
    run_id = result.mlflow_run_id
    steps = [m.step for m in client.get_metric_history(run_id, "timing/iteration")]
    assert sorted(steps) == [1, 2, 3, 4], "every iteration logged once: no gap, no duplicate"
    assert client.get_run(run_id).data.tags.get("alignflow.resumed") == "true"


def test_nan_reward_stops_with_iteration_and_last_good_checkpoint(upstream, tmp_path):
    workdir, _, _ = upstream
    spec = ppo_spec(upstream, "nan", algorithm="grpo", group_size=2, minibatch_size=16,
                    reward_functions=["tests.stages.reward_fixtures:nan_on_second_call"],
                    reward_function_weights=[1.0])
    code, result, stderr = finish(start_stage(spec, workdir, env={"ALIGNFLOW_TEST_COUNTER": str(tmp_path / "n")}))
    assert code == 1
    checkpoint = f"{spec.output_uri}/checkpoints/iter_00001"
    assert result.status == "failed"
    assert result.message == ("NonFiniteError: iteration 2: the reward is not finite (16 NaN/inf value(s)); "
                              f"stopped. Last good checkpoint: {checkpoint} (iteration 1)")
    assert find_published(checkpoint) is not None
    assert find_published(spec.output_uri) is None


def test_grpo_on_a_reward_function_alone_runs_without_reward_models_or_reference(upstream):
    workdir, _, _ = upstream
    spec = ppo_spec(upstream, "functions-only", reward_model=False, algorithm="grpo", group_size=4,
                    prompts_per_iteration=4, minibatch_size=16, iterations=2, checkpoint_every=2, kl_coef=0.0,
                    reward_functions=["alignflow.stages.rl.reward_functions:letter_share"])
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    assert "reference forward skipped (kl_coef 0)" in stderr
    frame = pd.read_parquet(local(result.output_uri) / "rollouts" / "iter_00002.parquet")
    assert all(set(rewards) == {"alignflow.stages.rl.reward_functions:letter_share"}
               for rewards in frame["rewards"].map(dict))
    assert frame["ref_logprobs"].isna().all() and frame["values"].isna().all()
    assert not any(key.startswith("kl/") for key in result.metrics)


def test_async_rollouts_are_one_step_off_policy_and_trained_with_behaviour_weights(upstream):
    workdir, _, _ = upstream
    spec = ppo_spec(upstream, "async", algorithm="grpo", group_size=4, prompts_per_iteration=4, minibatch_size=16,
                    iterations=3, checkpoint_every=3, async_rollouts=True)
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    out = local(result.output_uri)
    versions = [set(pd.read_parquet(out / "rollouts" / f"iter_{i:05d}.parquet")["policy_version"]) for i in (1, 2, 3)]
    assert versions == [{0}, {0}, {1}]  # iteration k+1 was generated while iteration k trained
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["rollout/policy_lag"] for m in history] == [0, 1, 1]
    assert "losses/behaviour_weight_mean" not in history[0]  # on-policy: no weights
    for m in history[1:]:
        assert 0 < m["losses/behaviour_weight_mean"] <= 2.0  # pi_prox / pi_behaviour, capped at async_weight_cap


def test_rollouts_read_back_and_engine_refit_every_iteration(upstream):
    workdir, _, _ = upstream
    # fp32 training: the check below compares the engine with the actor, which bf16 autocast would blur (~5e-3).
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

    rows = duckdb.sql(f"SELECT iteration, count(*) FROM read_parquet('{out}/rollouts/*.parquet') "
                      "GROUP BY iteration ORDER BY iteration").fetchall()
    assert rows == [(1, 8), (2, 8), (3, 8)]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["timing/refit"] > 0 for m in metrics), "the engine is refit every iteration"
    profile = (out / "profile.md").read_text()
    assert "| engine_load | 1 |" in profile, "the engine is loaded once (built by the engine stage), not rebuilt"
    assert "| refit | 3 |" in profile
    assert max(m["rollout/logprob_engine_vs_actor_max"] for m in metrics) < 1e-4, "refit keeps engine == actor"


def test_failed_pipeline_rerun_skips_finished_stages_and_ppo_continues(upstream, tmp_path, monkeypatch):
    from alignflow.flows.pipeline import alignflow_pipeline

    workdir, _, rows = upstream
    monkeypatch.setenv("ALIGNFLOW_TEST_COUNTER", str(tmp_path / "calls"))
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    config = small_config(workdir, stages=["data", "base", "sft", "reward", "engine", "ppo"],
                          engine={"max_seq_len": 96, "max_batch_size": 32},
                          ppo={**PPO_TEST, "reward_functions": ["tests.stages.reward_fixtures:fail_once_on_third_call"],
                               "reward_function_weights": [0.0]},
                          deployment={"stage_retries": 0})
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
    assert run.data.tags.get("alignflow.resumed") == "true", "PPO continued from its checkpoint, in the same run"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "timing/iteration")) == [1, 2, 3, 4]
