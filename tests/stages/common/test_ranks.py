"""Training stages on 2 gloo ranks (torchrun's elastic launch from the stage's entry point) against 1 rank."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignflow.contract import StageResult
from tests.stages.ppo.test_ppo import finish, local, start_stage
from tests.stages.test_lora_stages import stage_spec

pytestmark = pytest.mark.slow

# What two ranks change: the order in which gloo sums the two halves of each gradient (and DeepSpeed's
# division by the world size before the sum), ~1e-7 relative per step; Adam can turn a gradient entry near 0
# into a step of up to lr, so the bound that always holds is loose (lr x steps). After 9 steps on a
# 2-core CPU: ZeRO-2 bit-identical (max |diff| 0.0), ZeRO-3 7.5e-9; 1e-6 leaves room for other CPUs'
# kernels while training moves the weights by > 1e-2 (asserted below, so the comparison can fail).
WEIGHT_ATOL = 1e-6
LOSS_RTOL = 1e-5


def sft_section(upstream, **changes) -> dict:
    _, config, _ = upstream
    # 9 steps of 16 sequences: micro-batches of 8, so 1 rank accumulates 2 and each of 2 ranks runs 1.
    return {**config.sft.model_dump(mode="json"), "epochs": 1, "eval_every": 3, **changes}


def run_sft(upstream, name: str, **changes) -> tuple[StageResult, str]:
    workdir = upstream[0]
    spec = stage_spec(upstream, "sft", {"sft": sft_section(upstream, **changes), "variant": {"name": name}},
                      {"base": "base", "data": "data"})
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-4000:]
    return result, stderr


@pytest.fixture(scope="module")
def one_rank(upstream):
    return run_sft(upstream, "one-rank", zero_stage=2)[0]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_sft_on_two_ranks_equals_one_rank_with_the_same_global_batch(upstream, one_rank, zero_stage):
    two, stderr = run_sft(upstream, f"two-ranks-zero{zero_stage}", zero_stage=zero_stage,
                          resources={"nproc_per_node": 2})
    assert two.status == "ok" and two.output_uri != one_rank.output_uri
    for key in ("eval/loss_initial", "eval/loss", "train/loss"):
        assert two.metrics[key] == pytest.approx(one_rank.metrics[key], rel=LOSS_RTOL), key
    assert two.metrics["train/steps"] == one_rank.metrics["train/steps"] == 9
    one_weights = load_file(local(one_rank.output_uri) / "model.safetensors")
    two_weights = load_file(local(two.output_uri) / "model.safetensors")
    assert one_weights.keys() == two_weights.keys()
    base = load_file(local(upstream[2]["base"]["output_uri"]) / "model.safetensors")
    for name, weight in one_weights.items():
        torch.testing.assert_close(two_weights[name], weight, rtol=0, atol=WEIGHT_ATOL, msg=name)
    # The comparison can fail: training moved the weights by far more than the tolerance.
    assert max(float((one_weights[n] - base[n]).abs().max()) for n in base) > 1e-2


def test_batch_that_does_not_split_over_the_ranks_is_a_one_line_error(upstream):
    workdir = upstream[0]
    spec = stage_spec(upstream, "sft", {"sft": sft_section(upstream, batch_size=24, micro_batch_size=8,
                                                           resources={"nproc_per_node": 2})},
                      {"base": "base", "data": "data"})
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 2, stderr[-3000:]
    assert result.status == "failed"
    assert "sft.batch_size=24 must be a multiple of sft.micro_batch_size=8 x the 2 ranks" in result.message


def _rank_pids(launcher_pid: int) -> dict[int, int]:
    """{RANK: pid} of the processes started under `launcher_pid` that carry a RANK variable."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        env = dict(item.split(b"=", 1) for item in environ if b"=" in item)
        if ppid == launcher_pid and b"RANK" in env:
            found[int(env[b"RANK"])] = int(proc.name)
    return found


class StderrWatch:
    """A stage's stderr read on a thread, so a test can wait for a line (a point the stage reaches) instead of
    guessing how long it takes to get there."""

    def __init__(self, proc):
        self.proc, self.lines, self.ended, self.changed = proc, [], False, threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()
        with self.changed:
            self.ended = True
            self.changed.notify_all()

    def wait_for(self, pattern: str, bound_s: float = 300) -> bool:
        """Whether a line matching `pattern` came before the stream ended (bound_s only bounds a hang)."""

        def seen() -> bool:
            return any(re.search(pattern, line) for line in self.lines)

        with self.changed:
            self.changed.wait_for(lambda: seen() or self.ended, bound_s)
            return seen()

    def drain(self) -> tuple[str, str]:
        """(stdout, stderr) once the process has ended."""
        stdout = self.proc.stdout.read()
        self.proc.wait(timeout=900)
        self.reader.join(timeout=60)
        return stdout, "".join(self.lines)

    def finish(self) -> tuple[int, StageResult, str]:
        stdout, stderr = self.drain()
        return self.proc.returncode, StageResult.from_output(stdout), stderr


# Rank 0's progress line at each tenth of the steps (progress_bar in stages/common/training/loop.py).
TRAINING_PROGRESS = r"\d+/\d+ .*\(\d+ s, eta \d+ s\)"


def start_long_two_rank_sft(upstream, name: str):
    """(spec, launcher process, {RANK: pid}, its stderr watch) of a 2-rank SFT run long enough to be killed
    mid-training (~2,700 steps), returned once rank 0 has reported a tenth of its steps done."""
    spec = stage_spec(
        upstream,
        "sft",
        {
            "sft": sft_section(upstream, epochs=300, resources={"nproc_per_node": 2}),
            "variant": {"name": name},
        },
        {"base": "base", "data": "data"},
    )
    proc = start_stage(spec, upstream[0])
    watch = StderrWatch(proc)
    deadline = time.monotonic() + 120
    ranks: dict[int, int] = {}
    while len(ranks) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.5)
        ranks = _rank_pids(proc.pid)
    assert len(ranks) == 2, f"ranks did not start: {ranks}"
    assert watch.wait_for(TRAINING_PROGRESS), f"no training progress: {''.join(watch.lines)[-3000:]}"
    return spec, proc, ranks, watch


def test_a_killed_rank_fails_the_stage_within_seconds_naming_it(upstream):
    spec, proc, ranks, watch = start_long_two_rank_sft(upstream, "killed")  # into training
    assert proc.poll() is None, "the stage ended before the kill"
    os.kill(ranks[1], signal.SIGKILL)
    killed = time.monotonic()
    code, result, stderr = watch.finish()
    waited = time.monotonic() - killed
    assert code == 1, stderr[-3000:]
    assert result.status == "failed"
    assert f"rank 1 of 2 (pid {ranks[1]}) killed by SIGKILL" in result.message
    assert waited < 15, f"the stage took {waited:.1f} s to notice"
    assert not _rank_pids(proc.pid) and all(not Path(f"/proc/{pid}").exists() for pid in ranks.values())
    assert not (local(spec.output_uri) / "manifest.json").exists()  # nothing published


def _reward_section(upstream, **changes) -> dict:
    _, config, _ = upstream
    reward = {k: v for k, v in config.reward.model_dump(mode="json").items() if k != "models"}
    return {
        "reward": {**reward, "micro_batch_size": 8, **changes},
        "reward_model": config.reward.models[0].model_dump(mode="json"),
    }


def _dpo_section(upstream, **changes) -> dict:
    return {
        "dpo": {
            "loss": "ipo",
            "beta": 5.0,
            "lr": 1e-3,
            "batch_size": 16,
            "micro_batch_size": 8,
            "max_length": 64,
            "eval_every": 3,
            **changes,
        }
    }


@pytest.mark.parametrize(
    ("stage", "section", "weights", "compared"),
    [
        ("reward", _reward_section, "model.safetensors", ("eval/loss", "eval/accuracy", "eval/score_mean")),
        ("dpo", _dpo_section, "policy/model.safetensors", ("eval/loss", "train/loss", "rewards/margin")),
    ],
)
def test_reward_and_dpo_on_two_ranks_equal_one_rank(upstream, stage, section, weights, compared):
    workdir = upstream[0]
    results = []
    for name, resources in (("one", {}), ("two", {"nproc_per_node": 2})):
        parts = section(upstream, resources=resources)
        spec = stage_spec(
            upstream,
            stage,
            {**parts, "variant": {"name": f"{stage}-{name}-rank"}},
            {"sft": "sft", "data": "data"},
        )
        code, result, stderr = finish(start_stage(spec, workdir))
        assert code == 0, stderr[-4000:]
        results.append(result)
    one, two = results
    for key in compared:
        assert two.metrics[key] == pytest.approx(one.metrics[key], rel=LOSS_RTOL, abs=1e-7), key
    one_weights, two_weights = (load_file(local(r.output_uri) / weights) for r in results)
    sft = load_file(local(upstream[2]["sft"]["output_uri"]) / "model.safetensors")
    for name, weight in one_weights.items():
        torch.testing.assert_close(two_weights[name], weight, rtol=0, atol=WEIGHT_ATOL, msg=name)
    assert max(float((one_weights[n] - sft[n]).abs().max()) for n in sft if n in one_weights) > 1e-3


def test_ranks_die_with_a_killed_launcher(upstream):
    """A SIGKILLed stage process takes its ranks with it:
    none is left training into an output a retry re-creates."""
    spec, proc, ranks, watch = start_long_two_rank_sft(upstream, "launcher-killed")  # into training
    proc.kill()
    watch.drain()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in ranks.values()):
        time.sleep(0.2)
    alive = [
        pid
        for pid in ranks.values()
        if Path(f"/proc/{pid}").exists()
        and Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"
    ]
    assert not alive, f"ranks {alive} outlived their launcher"


def run_ppo(upstream, name: str, **ppo) -> StageResult:
    from tests.stages.ppo.test_ppo import ppo_spec

    # 2 iterations of 8 rollouts, 2 epochs of 2 minibatches of 4 (2 rows per rank on 2 ranks): 8 updates of
    # actor and critic; a checkpoint at iteration 1 (DeepSpeed shards of every rank, published by rank 0).
    spec = ppo_spec(
        upstream,
        name,
        iterations=2,
        minibatch_size=4,
        ppo_epochs=2,
        checkpoint_every=1,
        train_backend="deepspeed",
        **ppo,
    )
    code, result, stderr = finish(start_stage(spec, upstream[0]))
    assert code == 0, stderr[-4000:]
    assert result.status in ("ok", "skipped")  # skipped: another module ran this same spec first
    return result


_ONE_RANK_PPO: dict[int, StageResult] = {}


def one_rank_ppo(upstream, zero_stage: int) -> StageResult:
    """The 1-rank run the 2-rank ones are compared with (run once per ZeRO stage in this module)."""
    if zero_stage not in _ONE_RANK_PPO:
        _ONE_RANK_PPO[zero_stage] = run_ppo(upstream, f"ppo-one-rank-zero{zero_stage}", zero_stage=zero_stage)
    return _ONE_RANK_PPO[zero_stage]


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_ppo_on_two_trainer_ranks_equals_one_rank(upstream, zero_stage):
    """Rank 0 generates and scores, each rank trains half of every minibatch: the same losses and policy."""
    import json

    one = one_rank_ppo(upstream, zero_stage)
    two = run_ppo(
        upstream, f"ppo-two-ranks-zero{zero_stage}", zero_stage=zero_stage, resources={"nproc_per_node": 2}
    )
    history = [
        [json.loads(line) for line in (local(r.output_uri) / "metrics.jsonl").read_text().splitlines()]
        for r in (one, two)
    ]
    for one_it, two_it in zip(*history, strict=True):
        # the same rollouts (rank 0's engine)
        assert two_it["rollout/score_mean"] == one_it["rollout/score_mean"]
        for key in (
            "losses/policy_loss",
            "losses/value_loss",
            "losses/clipfrac",
            "losses/approx_kl",
            "kl/mean",
        ):
            assert two_it[key] == pytest.approx(one_it[key], rel=1e-4, abs=1e-7), key
    for part in ("policy", "critic"):
        one_weights = load_file(local(one.output_uri) / part / "model.safetensors")
        two_weights = load_file(local(two.output_uri) / part / "model.safetensors")
        assert one_weights.keys() == two_weights.keys()
        for name, weight in one_weights.items():
            torch.testing.assert_close(
                two_weights[name], weight, rtol=0, atol=WEIGHT_ATOL, msg=f"{part} {name}"
            )
    sft = load_file(local(upstream[2]["sft"]["output_uri"]) / "model.safetensors")
    policy = load_file(local(two.output_uri) / "policy" / "model.safetensors")
    assert max(float((policy[n] - sft[n]).abs().max()) for n in sft) > 1e-3  # it trained: the check can fail
    checkpoint = local(two.output_uri) / "checkpoints" / "iter_00001"
    assert (checkpoint / "manifest.json").is_file() and (checkpoint / "state.json").is_file()


def test_ppo_on_two_trainer_ranks_with_two_rollout_workers(upstream):
    """The whole distributed loop: 2 trainer ranks (ZeRO-2) and the engine as 2 worker processes fed by rank
    0's work queue and refit by it; the same rollouts as the in-process engine of one rank (the workers run
    the same engine on the same seeds), so the losses agree with the 1-rank run too."""
    import json

    from tests.stages.ppo.test_ppo import ppo_spec

    spec = ppo_spec(
        upstream,
        "ppo-two-ranks-two-workers",
        iterations=2,
        minibatch_size=4,
        ppo_epochs=2,
        checkpoint_every=1,
        train_backend="deepspeed",
        zero_stage=2,
        resources={"nproc_per_node": 2},
    )
    spec.config["engine"] = {**spec.config["engine"], "rollout_workers": 2, "queue_chunk": 4}
    code, result, stderr = finish(start_stage(spec, upstream[0]))
    assert code == 0, stderr[-4000:]
    assert "2 rollout worker processes" in stderr and "deepspeed trainer on 2 ranks" in stderr
    two = [json.loads(line) for line in (local(result.output_uri) / "metrics.jsonl").read_text().splitlines()]
    one = [
        json.loads(line)
        for line in (local(one_rank_ppo(upstream, 2).output_uri) / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["iteration"] for m in two] == [1.0, 2.0]
    # both workers refit each iteration
    assert all(m["refit/bytes_sent"] == 2 * m["refit/bytes"] > 0 for m in two)
    for one_it, two_it in zip(one, two, strict=True):
        assert two_it["rollout/score_mean"] == pytest.approx(one_it["rollout/score_mean"], abs=1e-6)
        assert two_it["losses/policy_loss"] == pytest.approx(one_it["losses/policy_loss"], rel=1e-4, abs=1e-7)

    # Killed after its first checkpoint, it resumes on 1 rank and continues the same curve (the flow does not
    # key outputs by ppo.resources: a retry on fewer or more machines resumes). Without its manifest and its
    # last checkpoint the output is what a run killed in iteration 2 leaves.
    resume_on_other_ranks(spec, upstream, result, nproc_per_node=1, compared_with=two)


def resume_on_other_ranks(
    spec, upstream, killed: StageResult, nproc_per_node: int, compared_with: list
) -> None:
    """Rerun `spec` on `nproc_per_node` trainer ranks over `killed`'s output, less its manifest and its
    iteration-2 checkpoint: it must resume from iteration 1 and reproduce iteration 2 of `compared_with`."""
    import json
    import shutil

    folder = local(killed.output_uri)
    (folder / "manifest.json").unlink()
    shutil.rmtree(folder / "checkpoints" / "iter_00002")
    section = {**spec.config["ppo"], "resources": {"nproc_per_node": nproc_per_node}}
    resumed_spec = spec.model_copy(update={"config": {**spec.config, "ppo": section}})
    code, result, stderr = finish(start_stage(resumed_spec, upstream[0]))
    assert code == 0, stderr[-4000:]
    moved = f"written by {3 - nproc_per_node} trainer rank(s), on {nproc_per_node}: every rank gets its share"
    assert f"after iteration 1, {moved} of the saved state" in stderr
    resumed = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in resumed] == [1.0, 2.0]
    first, second = compared_with[1], resumed[1]
    assert second["rollout/score_mean"] == pytest.approx(first["rollout/score_mean"], abs=1e-6)
    for key in ("losses/policy_loss", "losses/value_loss", "losses/approx_kl", "kl/mean"):
        assert second[key] == pytest.approx(first[key], rel=1e-4, abs=1e-7), key


def test_ppo_resumes_a_one_rank_checkpoint_on_two_ranks(upstream):
    """1 -> 2: the plain torch trainer's checkpoint (1 rank, ZeRO 0) resumes under DeepSpeed on 2 ranks."""
    import json

    from tests.stages.ppo.test_ppo import ppo_spec

    spec = ppo_spec(upstream, "ppo-resume-one-to-two", iterations=2, minibatch_size=4, ppo_epochs=2,
                    checkpoint_every=1, train_backend="auto", zero_stage=0)
    code, result, stderr = finish(start_stage(spec, upstream[0]))
    assert code == 0, stderr[-4000:]
    assert "torch trainer" in stderr
    one = [json.loads(line) for line in (local(result.output_uri) / "metrics.jsonl").read_text().splitlines()]
    resume_on_other_ranks(spec, upstream, result, nproc_per_node=2, compared_with=one)


def test_the_cause_is_a_silent_death_then_a_reported_error_never_the_launchers_sigterm():
    """Which rank's failure is named: the launcher's SIGTERM of a survivor (same monitor pass, same timestamp)
    never hides the rank that reported its error; a rank killed without a word comes before both."""
    from types import SimpleNamespace

    from alignflow.stages.common.ranks import failed_rank_of

    def failure(exitcode: int, timestamp: float = 100.0):
        return SimpleNamespace(exitcode=exitcode, timestamp=timestamp)

    reported = {0: {"code": 2}}
    assert failed_rank_of({0: failure(2), 1: failure(-signal.SIGTERM, 99.0)}, reported) == 0
    assert failed_rank_of({0: failure(1), 1: failure(-signal.SIGKILL)}, {0: {"code": 1}}) == 1
    assert failed_rank_of({0: failure(-signal.SIGTERM), 1: failure(-signal.SIGTERM, 99.0)}, {}) == 1
    assert failed_rank_of({0: failure(1, 101.0), 1: failure(1, 100.0)}, {0: {}, 1: {}}) == 1


NODE_A = {"node": 0, "host": "node-a.cluster.local", "address": "10.0.0.1"}
NODE_B = {"node": 1, "host": "node-b.cluster.local", "address": "10.0.0.2"}


@pytest.mark.parametrize(
    "error",
    [
        # gloo: the address in brackets
        "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:41235",
        # NCCL over sockets: torch's DistBackendError, the peer's short host name in the last line
        "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote process exited or "
        "there was a network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a "
        "network error or a remote process exiting prematurely.\nLast error:\nsocketProgress: Connection "
        "closed by remote peer node-b<42830>",
        # NCCL over InfiniBand: the peer's address
        "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a network error\n"
        "Last error:\nNET/IB : Got completion from peer 10.0.0.2<49189> with error 12, opcode 0, len 0",
    ],
)
def test_a_lost_peer_is_named_from_gloo_and_nccl_errors(monkeypatch, error):
    """The line a rank prints when a collective breaks names the other node, its ranks and pids, whichever
    backend reported it; a message naming this node's own address (its launcher reports that) or no peer
    at all names nothing."""
    import json as json_module

    from alignflow.stages.common import ranks

    places = {0: {**NODE_A, "pid": 100}, 1: {**NODE_A, "pid": 101}, 2: {**NODE_B, "pid": 200},
              3: {**NODE_B, "pid": 201}}

    class Store:
        def get(self, key: str) -> bytes:
            return json_module.dumps(places[int(key.removeprefix(ranks.PLACE_KEY))]).encode()

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(ranks, "_launcher_store", lambda timeout_s: Store())
    line = ranks.lost_peer(RuntimeError(error))
    assert line is not None and line.startswith(
        "lost node 1 (node-b.cluster.local, 10.0.0.2): rank 2 (pid 200), rank 3 (pid 201), "
        "seen by rank 1 of 4"
    ), line
    assert "\n" not in line
    reason = line.split("in a collective (", 1)[1]
    assert ("Connection closed" in reason or "Got completion" in reason) and "ProcessGroupNCCL" not in reason

    own = error.replace("10.0.0.2", "10.0.0.1").replace("node-b<", "node-a<")
    assert ranks.lost_peer(RuntimeError(own)) is None  # this node's own ranks: their launcher names them
    assert ranks.lost_peer(RuntimeError("Watchdog caught collective operation timeout")) is None
