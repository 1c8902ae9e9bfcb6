"""The RL stage over two nodes, each in its own network namespace with its own launcher: a trainer rank on
node A and its rollout replica on node B gain like one process; trainer ranks on both nodes train like one
rank, only rank 0's node writes, a killed node is named in one line, and a rerun resumes.

The nodes reach each other only through their addresses (tests/stages/common/netns.py); they share the file
system, as the test's upstream outputs are file:// folders. Skipped, saying why, where namespaces cannot be
made (no root, no `ip`).
"""

from __future__ import annotations

import json
import re
import time

import pytest
from mlflow import MlflowClient

from alignflow.config import ROLLOUT_SECRET_VAR as SECRET_VAR
from alignflow.contract import StageResult, StageSpec
from alignflow.stages import evaluate
from tests.stages.common import netns
from tests.stages.common.test_ranks import WEIGHT_ATOL, one_rank_ppo
from tests.stages.ppo.test_ppo import attempt_runs, finish, local, ppo_spec, start_stage

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(netns.why_not() is not None, reason=str(netns.why_not()))]

RDZV_PORT = 29400
ROLLOUT_PORT = 29500
SECRET = {SECRET_VAR: "two-nodes-test-secret-0123456789"}
# The policies of the two runs differ only by the engine's fp32 rounding in other batch shapes (~1e-6 in
# log-probs); the bound on the held-out gold gain.
GOLD_GAIN_TOL = 1e-4


@pytest.fixture
def two_nodes():
    nodes = netns.make_two_nodes("rl")
    yield nodes
    netns.remove_two_nodes(nodes)


def start_on_both(spec, nodes, workdir):
    """The stage's command on each node (as each pod of an Indexed Job runs it): (node A's, node B's)."""
    path = spec.dump(workdir / f"spec-{spec.output_uri.rsplit('/', 1)[1]}-two-nodes.json")
    return tuple(node.start(["-m", "alignflow.stages", "ppo", "--spec", str(path)], cwd=workdir)
                 for node in nodes)


def two_node_spec(upstream, name: str, nodes, **ppo):
    a, _ = nodes
    resources = {"nnodes": 2, "nproc_per_node": 1, "rdzv_endpoint": f"{a.address}:{RDZV_PORT}"}
    return ppo_spec(upstream, name, iterations=2, minibatch_size=4, ppo_epochs=2, checkpoint_every=1,
                    train_backend="deepspeed", resources=resources, **ppo)


def held_out_gold_gain(upstream, ppo_result: StageResult, name: str) -> float:
    """The evaluation stage's held-out gold gain of a PPO output over the SFT policy (greedy answers)."""
    workdir, _, rows = upstream
    inputs = {"data": rows["data"]["output_uri"], "sft": rows["sft"]["output_uri"],
              "reward_rm": rows["reward-rm"]["output_uri"], "ppo": ppo_result.output_uri}
    # Sampled answers: two PPO iterations move the policy's probabilities, not yet its greedy answers.
    config = {"evaluate": {"n_prompts": 32, "max_new_tokens": 16, "temperature": 1.0},
              "model": {"dtype": "float32", "device": "cpu"},
              "engine": {"backend": "native", "max_batch_size": 16, "max_seq_len": 96}}
    spec = StageSpec(stage="evaluate", config=config, inputs=inputs, workdir=str(workdir),
                     output_uri=f"file://{workdir}/tests/evaluate-{name}")
    metrics = evaluate.run(spec).metrics
    return metrics["eval/policy_gold_score"] - metrics["eval/sft_gold_score"]


def test_a_trainer_on_node_a_and_its_replica_on_node_b_gain_like_one_process(upstream, two_nodes, tmp_path):
    a, b = two_nodes
    # A larger step than the suite's, so that the policy moves off the SFT one in two iterations.
    single = ppo_spec(upstream, "ppo-engine-in-process", iterations=2, actor_lr=5e-3)
    code, single_result, err = finish(start_stage(single, upstream[0]))
    assert code == 0, err[-3000:]
    spec = ppo_spec(upstream, "ppo-replica-on-node-b", iterations=2, actor_lr=5e-3)
    spec.config["engine"].update(rollout_workers=1, rollout_nodes=1,
                                 rollout_endpoint=f"{a.address}:{ROLLOUT_PORT}")
    path = spec.dump(upstream[0] / "spec-ppo-replica-on-node-b.json")
    node_b = b.start(["-m", "alignflow.stages", "ppo", "--spec", str(path), "--rollout-node", "0"],
                     cwd=upstream[0], env=SECRET)
    node_a = a.start(["-m", "alignflow.stages", "ppo", "--spec", str(path)], cwd=upstream[0], env=SECRET)
    out_a, err_a = node_a.communicate(timeout=900)
    _, err_b = node_b.communicate(timeout=120)
    assert node_a.returncode == 0, err_a[-4000:]
    assert node_b.returncode == 0, err_b[-4000:]
    assert re.search(rf"rollout node 0 \(af-rl-b, {re.escape(b.address)}\): replicas \[0\]", err_b), err_b
    assert "1 rollout worker processes on 1 rollout node(s)" in err_a, err_a[-3000:]
    remote = StageResult.from_output(out_a)
    history = [[json.loads(line) for line in (local(r.output_uri) / "metrics.jsonl").read_text().splitlines()]
               for r in (single_result, remote)]
    for one_it, two_it in zip(*history, strict=True):
        # the same sequences (per-sequence seeds), scored alike
        assert two_it["rollout/score_mean"] == pytest.approx(one_it["rollout/score_mean"], abs=1e-5)
        assert two_it["refit/bytes"] == one_it["refit/bytes"]
        for key in ("losses/policy_loss", "losses/value_loss"):
            assert two_it[key] == pytest.approx(one_it[key], rel=1e-4, abs=WEIGHT_ATOL), key
    gains = [held_out_gold_gain(upstream, r, n) for r, n in ((single_result, "single"), (remote, "remote"))]
    print(f"held-out gold gain: one process {gains[0]:+.6f}, replica on node B {gains[1]:+.6f}")
    assert gains[0] != 0.0, "the policy did not move: the comparison would say nothing"
    assert abs(gains[1] - gains[0]) <= GOLD_GAIN_TOL, gains


def test_trainer_ranks_on_two_nodes_train_like_one_rank(upstream, two_nodes, tmp_path):
    spec = two_node_spec(upstream, "ppo-two-nodes", two_nodes, zero_stage=2)
    node_a, node_b = start_on_both(spec, two_nodes, upstream[0])
    out_b, err_b = node_b.communicate(timeout=900)
    out_a, err_a = node_a.communicate(timeout=900)
    assert node_a.returncode == 0, err_a[-4000:]
    assert node_b.returncode == 0, err_b[-4000:]
    result = StageResult.from_output(out_a)
    assert result.status == "ok"
    assert "this node's ranks (1) finished; rank 0's node publishes the output" in err_b
    assert "deepspeed trainer on 2 ranks" in err_a
    one = one_rank_ppo(upstream, 2)
    history = [[json.loads(line) for line in (local(r.output_uri) / "metrics.jsonl").read_text().splitlines()]
               for r in (one, result)]
    for one_it, two_it in zip(*history, strict=True):
        assert two_it["rollout/score_mean"] == one_it["rollout/score_mean"]
        for key in ("losses/policy_loss", "losses/value_loss", "losses/approx_kl"):
            assert two_it[key] == pytest.approx(one_it[key], rel=1e-4, abs=WEIGHT_ATOL), key
    # only rank 0 wrote the checkpoints: whole states, no per-rank files
    actor = local(result.output_uri) / "checkpoints/iter_00002/actor"
    index = json.loads((actor / "trainer_state.json").read_text())
    assert index["written_by_ranks"] == 2


def test_a_killed_node_is_named_in_one_line_and_a_rerun_resumes_without_repeating_iterations(
    upstream, two_nodes
):
    a, b = two_nodes
    spec = two_node_spec(upstream, "ppo-two-nodes-killed", two_nodes, zero_stage=2, tracking=True)
    spec.config["ppo"]["iterations"] = 5
    node_a, node_b = start_on_both(spec, two_nodes, upstream[0])
    checkpoint = local(spec.output_uri) / "checkpoints" / "iter_00002" / "manifest.json"
    deadline = time.monotonic() + 600
    while not checkpoint.is_file():
        assert node_a.poll() is None and node_b.poll() is None, "a node ended before its second checkpoint"
        assert time.monotonic() < deadline, "no second checkpoint in 600 s"
        time.sleep(0.2)
    killed_at = time.monotonic()
    killed = b.kill_all()
    out_a, err_a = node_a.communicate(timeout=120)
    named_after = time.monotonic() - killed_at
    node_b.communicate(timeout=60)
    assert node_a.returncode == 1, err_a[-3000:]
    message = StageResult.from_output(out_a).message
    match = re.search(rf"lost node 1 \([^,]+, {re.escape(b.address)}\): rank 1 \(pid (\d+)\)", message)
    assert match, message
    assert int(match.group(1)) in killed
    assert "\n" not in message
    assert named_after < 30, f"named {named_after:.1f} s after the kill"
    print(f"node B killed; node A's stage ended {named_after:.2f} s later: {message}")

    # The flow's retry: the same command on both nodes again resumes from the last checkpoint.
    node_a, node_b = start_on_both(spec, two_nodes, upstream[0])
    out_a, err_a = node_a.communicate(timeout=900)
    node_b.communicate(timeout=120)
    assert node_a.returncode == 0, err_a[-4000:]
    assert re.search(r"ppo: resuming from \S+/checkpoints/iter_0000[2-5] after iteration [2-5]\n", err_a), \
        err_a[-3000:]
    lines = (local(spec.output_uri) / "metrics.jsonl").read_text().splitlines()
    metrics = [json.loads(line) for line in lines]
    assert [m["iteration"] for m in metrics] == [1.0, 2.0, 3.0, 4.0, 5.0]
    client = MlflowClient(spec.tracking.uri)
    final = attempt_runs(client, spec)[-1]
    steps = [m.step for m in client.get_metric_history(final.info.run_id, "rollout/score_mean")]
    assert steps == [1, 2, 3, 4, 5], "each iteration once in the run the output points at"
