"""The critic in its own process (stages/ppo/critic_worker.py) trains exactly like the critic on a thread,
keeps the stale-log-prob gate, and names its failures: an error inside it, a failed start, its death."""

from __future__ import annotations

import copy
import os
import pickle
import signal
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import pytest
import torch

from alignflow.stages.common.models.loading import load_causal_lm, load_sequence_classifier
from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer
from alignflow.stages.common.training.trainer_state import INDEX_FILE, TrainerStateError
from alignflow.stages.ppo.critic_schedule import critic_in_process, overlaps_critic
from alignflow.stages.ppo.critic_worker import CriticSpec, CriticWorker, CriticWorkerError
from alignflow.stages.ppo.experience import packing_for, token_values
from alignflow.stages.ppo.training_loop import StaleOldLogprobs, train_on
from tests.stages.ppo.test_train_shortcuts import FP32, PAD, checkpoint, ppo_config, rollout, trainer_settings

__all__ = ["checkpoint", "rollout"]  # module fixtures shared with the shortcut tests
CPU = torch.device("cpu")
pytestmark = pytest.mark.cpu_only("the critic's process holds the models on the CPU (ppo.critic_process)")


@pytest.fixture(autouse=True)
def _two_threads(one_torch_thread):
    # one for the actor, one for the critic (one_torch_thread restores 1 after the test)
    torch.set_num_threads(2)
    yield


@pytest.fixture(scope="module")
def critic_folder(checkpoint, tmp_path_factory) -> Path:
    """The critic's initial weights as the reward stage publishes them: a sequence classifier that pads with
    PAD."""
    folder = tmp_path_factory.mktemp("critic") / "reward"
    torch.manual_seed(0)
    load_sequence_classifier(checkpoint, pad_token_id=PAD).save_pretrained(folder)
    return folder


def ppo_with_critic(**overrides):
    return ppo_config(algorithm="ppo", group_size=1, prompts_per_iteration=6, minibatch_size=3, **overrides)


def experience_with_targets(rollout):
    exp = copy.copy(rollout)
    noise = torch.Generator().manual_seed(0)
    exp.values = torch.randn(exp.response_mask.shape, generator=noise) * exp.response_mask
    exp.returns = torch.randn(exp.response_mask.shape, generator=noise) * exp.response_mask
    return exp


def remote_critic(folder: Path, cfg, **spec) -> CriticWorker:
    settings = trainer_settings(micro_batch_size=cfg.minibatch_size)
    return CriticWorker(
        CriticSpec(
            str(folder), cfg, "float32", settings, spec.pop("attention", "eager"), FP32, threads=1, **spec
        )
    )


def remote_weights(worker: CriticWorker, tmp_path: Path) -> dict[str, torch.Tensor]:
    """The critic's weights, as the worker's trainer state holds them."""
    from safetensors.torch import load_file

    worker.save_state(tmp_path / "critic")
    tensors = {}
    for shard in (tmp_path / "critic").glob("*.safetensors"):
        tensors.update(load_file(shard))
    return {key.removeprefix("weight."): t for key, t in tensors.items() if key.startswith("weight.")}


def test_critic_in_its_own_process_trains_exactly_like_on_a_thread(
    critic_folder, checkpoint, rollout, tmp_path
):
    """Same values pass, same metrics, same actor and critic weights, bit for bit (2 epochs x 2 minibatches,
    one thread per model both ways); the trainer's thread count is restored."""
    exp = experience_with_targets(rollout)
    cfg = ppo_with_critic()
    settings = trainer_settings(micro_batch_size=3)

    actor = PlainTorchTrainer(load_causal_lm(checkpoint), settings)
    critic = PlainTorchTrainer(load_sequence_classifier(critic_folder), settings)
    critic.module.set_attn_implementation("eager")
    assert overlaps_critic(actor, critic, cfg)
    packed = packing_for(exp, cfg, actor)
    with torch.no_grad():
        values_here = token_values(critic.module, exp, lean=True, packed=packed)
    on_thread = train_on(copy.copy(exp), actor, critic, cfg, 0.0, 1, FP32)

    remote_actor = PlainTorchTrainer(load_causal_lm(checkpoint), settings)
    assert critic_in_process(remote_actor.module.config.hidden_size, cfg, "torch", CPU)
    with closing(remote_critic(critic_folder, cfg)) as worker:
        worker.wait_ready()
        assert torch.equal(worker.values_async(exp, packed).result(), values_here)
        in_process = train_on(copy.copy(exp), remote_actor, worker, cfg, 0.0, 1, FP32)
        assert torch.get_num_threads() == 2
        weights = remote_weights(worker, tmp_path)
    assert "losses/value_loss" in on_thread and in_process == on_thread
    for (name, x), (_, y) in zip(
        actor.module.named_parameters(), remote_actor.module.named_parameters(), strict=True
    ):
        assert torch.equal(x, y), name
    assert weights.keys() == dict(critic.module.named_parameters()).keys()
    for name, param in critic.module.named_parameters():
        assert torch.equal(param, weights[name]), name


FORKED_CRITIC = """
import os, pickle, sys
import torch
from alignflow.stages.common import forking
from alignflow.stages.ppo.critic_worker import CriticWorker
forking.mark_clean()  # as a stage program does after its imports
with open(sys.argv[1], "rb") as f:
    spec, exp, packed = pickle.load(f)
worker = CriticWorker(spec)
assert worker.start_method == "fork", worker.start_method
torch.save(worker.values_async(exp, packed).result(), sys.argv[2])
with open(sys.argv[3], "w") as f:
    f.write(str(worker.pid))
os._exit(0)  # the trainer dies without closing the worker
"""


FORKED_FILES = ("request.pkl", "values.pt", "pid.txt")


def exited(pid: int, within_s: float) -> bool:
    """Whether the process is gone (or a zombie nobody reaped) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


def test_a_critic_forked_from_a_clean_stage_process_computes_what_the_trainers_own_does(
    critic_folder, checkpoint, rollout, tmp_path
):
    """Where a stage program forks the critic's process (stages/common/forking.py: it starts with the stage's
    imports, not a new interpreter's), its values pass on two threads gives the trainer's critic's bits, and
    it exits when the trainer dies without closing it (it holds no copy of the trainer's end of the pipe)."""
    cfg = ppo_with_critic()
    settings = trainer_settings(micro_batch_size=3)
    critic = PlainTorchTrainer(load_sequence_classifier(critic_folder), settings)
    critic.module.set_attn_implementation("eager")
    packed = packing_for(rollout, cfg, PlainTorchTrainer(load_causal_lm(checkpoint), settings))
    with torch.no_grad():
        values_here = token_values(critic.module, rollout, lean=True, packed=packed)
    spec = CriticSpec(str(critic_folder), cfg, "float32", settings, "eager", FP32, threads=2)
    with open(tmp_path / "request.pkl", "wb") as f:
        pickle.dump((spec, rollout, packed), f)
    # Output to a file, not a pipe: a worker that outlived the script would hold a pipe open.
    with open(tmp_path / "stderr.txt", "w") as stderr:
        code = subprocess.run(
            [sys.executable, "-c", FORKED_CRITIC, *(str(tmp_path / name) for name in FORKED_FILES)],
            stdout=stderr, stderr=stderr, timeout=300,
        ).returncode
    assert code == 0, (tmp_path / "stderr.txt").read_text()[-3000:]
    assert torch.equal(torch.load(tmp_path / "values.pt", weights_only=True), values_here)
    pid = int((tmp_path / "pid.txt").read_text())
    if not exited(pid, within_s=10):
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"the forked critic (pid {pid}) outlived its trainer")


def test_a_stale_check_leaves_the_critics_process_untouched(critic_folder, checkpoint, rollout, tmp_path):
    """The process starts the critic's updates before the actor's check of the old log-probs: when the check
    fails its first update drops its gradients and nothing steps; the same worker then trains normally."""
    exp = experience_with_targets(rollout)
    cfg = ppo_with_critic()
    actor = PlainTorchTrainer(load_causal_lm(checkpoint), trainer_settings(micro_batch_size=3))
    stale = copy.copy(exp)
    stale.old_logprobs = exp.rollout_logprobs + 1e-2 * exp.response_mask
    with closing(remote_critic(critic_folder, cfg)) as worker:
        before = remote_weights(worker, tmp_path / "before")
        with pytest.raises(StaleOldLogprobs):
            train_on(stale, actor, worker, cfg, 0.0, 1, FP32, check_old_tolerance=1e-4)
        after_stale = remote_weights(worker, tmp_path / "stale")
        metrics = train_on(copy.copy(exp), actor, worker, cfg, 0.0, 1, FP32, check_old_tolerance=1e-4)
        trained = remote_weights(worker, tmp_path / "trained")
    assert all(torch.equal(before[name], after_stale[name]) for name in before), (
        "the critic moved before the check"
    )
    assert "losses/value_loss" in metrics
    assert any(not torch.equal(before[name], trained[name]) for name in before), (
        "the critic did not train after"
    )


def test_an_error_inside_the_worker_is_raised_here_with_its_traceback(critic_folder, tmp_path):
    with closing(remote_critic(critic_folder, ppo_with_critic())) as worker:
        with pytest.raises(TrainerStateError, match=f"the checkpoint: no {INDEX_FILE}") as raised:
            worker.load_state(tmp_path / "nowhere", "the checkpoint")
        assert any(f"critic worker (pid {worker.pid})" in note for note in raised.value.__notes__)
        # the worker goes on answering after an error
        worker.save_state(tmp_path / "critic")
        assert (tmp_path / "critic" / INDEX_FILE).exists()


def test_a_critic_that_cannot_load_names_why(tmp_path):
    with closing(remote_critic(tmp_path / "missing", ppo_with_critic())) as worker:
        with pytest.raises(CriticWorkerError, match="could not start"):
            worker.wait_ready()
        with pytest.raises(CriticWorkerError, match="could not start"):  # and stays broken
            worker.save_state(tmp_path / "critic")


def test_a_dead_worker_is_named_with_its_signal_and_close_is_safe(critic_folder, rollout):
    worker = remote_critic(critic_folder, ppo_with_critic())
    worker.wait_ready()
    os.kill(worker.pid, signal.SIGKILL)
    worker.process.join(10)
    with pytest.raises(CriticWorkerError, match=rf"pid {worker.pid}\) died \(killed by signal SIGKILL\)"):
        worker.values_async(rollout, None).result()
    worker.close()
    worker.close()


def test_the_critic_goes_to_its_process_only_where_it_would_get_a_thread():
    """One rank, the plain torch trainer on the CPU, PPO, more than one thread, no async rollouts or
    compile_train, overlap_critic on, and under auto an actor narrower than 256."""
    assert critic_in_process(64, ppo_with_critic(), "torch", CPU)
    assert not critic_in_process(64, ppo_with_critic(), "deepspeed", CPU)
    assert not critic_in_process(64, ppo_with_critic(critic_process="off"), "torch", CPU)
    assert not critic_in_process(64, ppo_with_critic(overlap_critic=False), "torch", CPU)
    assert not critic_in_process(64, ppo_with_critic(async_rollouts=True), "torch", CPU)
    assert not critic_in_process(64, ppo_with_critic(compile_train=True), "torch", CPU)
    assert not critic_in_process(64, ppo_config(), "torch", CPU)  # GRPO: no critic
    assert not critic_in_process(256, ppo_with_critic(), "torch", CPU)  # auto: dispatch-bound widths only
    assert critic_in_process(256, ppo_with_critic(critic_process="on"), "torch", CPU)
    # On a GPU the models train where they are, in this process: no process copies the critic to the CPU.
    assert not critic_in_process(64, ppo_with_critic(critic_process="on"), "torch", torch.device("cuda", 0))
    torch.set_num_threads(1)
    assert not critic_in_process(64, ppo_with_critic(), "torch", CPU)
