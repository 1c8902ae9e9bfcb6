"""What a killed RL stage resumes from and what a finished one leaves; not when to checkpoint (the loop says).

The RL state, its checkpoints (published, found, loaded), the working folder a resumed run continues in, the
resumed attempt's MLflow run, the last good state after a NaN, and the final policy and critic. A checkpoint
is `checkpoints/iter_NNNNN/` under the stage's output, published with its own manifest by rank 0, the only
rank that writes it: `actor/` and `critic/` (each trainer's weights and AdamW moments, whole, gathered from
every rank's ZeRO shard by a collective: stages/common/training/trainer_state.py), `state.json` (RLState)
and `rng.json` (the torch, Python and NumPy RNG states as numbers: nothing in it is unpickled). Nothing in it
depends on the number of trainer ranks, so a run resumes on another `ppo.resources` (a node lost, or added),
and no node but rank 0's needs to reach the folder: on resume rank 0 reads it and broadcasts. Checkpoints
written before held the RNGs in a pickle, `rng.pt`; it is never opened (see load_rng).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from alignflow.config import PPOConfig
from alignflow.contract import StageSpec
from alignflow.manifest import find_published, materialize, publish
from alignflow.stages.common.bottleneck_advice import RunFacts
from alignflow.stages.common.ranks import from_main, is_main, world_size
from alignflow.stages.common.runtime import StageContext, StageInputError, dump_json
from alignflow.stages.common.training.lora import save_trained
from alignflow.stages.common.training.trainer_state import (
    TrainerStateError,
    load_trainer_state,
    save_trainer_state,
)
from alignflow.stages.ppo import losses as rl
from alignflow.stages.ppo.critic_worker import CriticWorker
from alignflow.stages.ppo.kl_control import make_kl_controller
from alignflow.storage import join_uri, open_store, remove_unfinished_writes

CHECKPOINT_DIR = re.compile(r"/checkpoints/iter_(\d{5})/manifest\.json$")
RNG_FILE = "rng.json"
OLD_RNG_FILE = "rng.pt"  # a pickle (torch.save of Python objects): never loaded
RNG_FORMAT = "alignflow-rng-1"


class RLState:
    """Everything besides model/optimizer weights that resuming needs."""

    def __init__(self, cfg: PPOConfig):
        self.iteration = 0                       # iterations completed
        self.kl_controller = make_kl_controller(cfg)
        self.score_stats = rl.RunningMeanStd()
        self.history: list[dict[str, float]] = []  # per-iteration metrics, for metrics.jsonl
        self.mlflow_run_id: str | None = None
        # Set when the engine's log-probs were found to differ from the actor's (ppo.old_logprobs: auto):
        # every later iteration recomputes them.
        self.old_logprobs_fallback = False

    def to_json(self) -> dict[str, Any]:
        return {"iteration": self.iteration, "kl_controller": self.kl_controller.state_dict(),
                "score_stats": self.score_stats.state_dict(), "history": self.history,
                "mlflow_run_id": self.mlflow_run_id, "old_logprobs_fallback": self.old_logprobs_fallback,
                "world_size": world_size()}

    def load_json(self, data: dict[str, Any]) -> None:
        self.iteration = int(data["iteration"])
        self.kl_controller.load_state_dict(data["kl_controller"])
        self.score_stats.load_state_dict(data["score_stats"])
        self.history = list(data["history"])
        self.mlflow_run_id = data.get("mlflow_run_id")
        self.old_logprobs_fallback = bool(data.get("old_logprobs_fallback", False))


def latest_checkpoint(spec: StageSpec) -> tuple[int, str] | None:
    """(iteration, URI) of the newest published checkpoint under the stage's output, if any."""
    store = open_store(spec.output_uri, spec.storage)
    found = []
    for uri, _ in store.list(join_uri(spec.output_uri, "checkpoints")):
        match = CHECKPOINT_DIR.search(uri)
        if match:
            found.append((int(match.group(1)), uri.rsplit("/", 1)[0]))
    return max(found) if found else None


def save_checkpoint(ctx: StageContext, out: Path, state: RLState, actor, critic) -> str:
    """Publish checkpoints/iter_NNNNN (the trainers' states, RL state, RNG) with its manifest."""
    name = f"iter_{state.iteration:05d}"
    folder = out / "checkpoints" / name
    # Every rank takes part (gathering ZeRO's shards is collective); only rank 0 writes.
    _save_trainer(actor, folder / "actor")
    if critic is not None:
        _save_trainer(critic, folder / "critic")
    uri = join_uri(ctx.spec.output_uri, "checkpoints", name)
    if not is_main():
        return uri
    dump_json(rng_state(), folder / RNG_FILE)
    dump_json(state.to_json(), folder / "state.json")
    publish(
        folder,
        uri,
        stage="ppo-checkpoint",
        config=ctx.spec.config,
        inputs={},
        version=ctx.spec.code_version,
        summary={"iteration": state.iteration},
        storage=ctx.spec.storage,
    )
    return uri


def load_checkpoint(ctx: StageContext, uri: str, state: RLState, actor, critic) -> None:
    """Resume from the checkpoint at `uri`: the trainers' states, the RNGs and `state`, on any number of
    trainer ranks. Rank 0 downloads and reads it; the others receive what they need from it (no other node
    reaches the object store's copy, nor needs a folder shared with rank 0)."""
    folder = materialize(uri, ctx.cache_dir, ctx.spec.storage)[0] if is_main() else None
    saved = from_main(json.loads((folder / "state.json").read_text()) if folder is not None else None)
    written_by = int(saved.get("world_size", 1))
    if is_main():
        moved = (f", written by {written_by} trainer rank(s), on {world_size()}: every rank gets its share "
                 "of the saved state" if written_by != world_size() else "")
        print(f"ppo: resuming from {uri} after iteration {saved['iteration']}{moved}", file=sys.stderr,
              flush=True)
    try:
        _load_trainer(actor, folder / "actor" if folder else None, f"{uri}/actor")
        if critic is not None:
            _load_trainer(critic, folder / "critic" if folder else None, f"{uri}/critic")
    except TrainerStateError as exc:
        raise StageInputError(str(exc)) from exc
    seed = int((ctx.spec.config.get("ppo") or {}).get("seed", 0))  # ppo.seed
    rng = from_main(_read_rng(folder, uri) if folder is not None else None)
    load_rng(rng, uri, reseed=seed * 1_000_003 + int(saved["iteration"]))
    state.load_json(saved)


def _save_trainer(trainer, folder: Path) -> None:
    if isinstance(trainer, CriticWorker):  # its trainer lives in its own process (one rank)
        trainer.save_state(folder)
    else:
        save_trainer_state(trainer, folder)


def _load_trainer(trainer, folder: Path | None, where: str) -> None:
    if isinstance(trainer, CriticWorker):
        trainer.load_state(folder, where)
    else:
        load_trainer_state(trainer, folder, where)


def rng_state() -> dict[str, Any]:
    """The torch (CPU), Python and NumPy RNG states as JSON numbers, for rng.json."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "format": RNG_FORMAT,
        "torch": torch.get_rng_state().tolist(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
    }


def set_rng_state(saved: dict[str, Any]) -> None:
    """Restore the RNGs from rng_state()'s dict."""
    torch.set_rng_state(torch.tensor(saved["torch"], dtype=torch.uint8))
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _read_rng(folder: Path, uri: str) -> dict[str, Any] | str:
    """A checkpoint's rng.json, checked; else why it has none, in words."""
    if (folder / RNG_FILE).is_file():
        saved = json.loads((folder / RNG_FILE).read_text())
        if saved.get("format") != RNG_FORMAT:
            raise StageInputError(f"{uri}/{RNG_FILE}: unknown format {saved.get('format')!r}, "
                                  f"expected {RNG_FORMAT!r}; start a fresh run (another output)")
        return saved
    return (f"keeps its RNG state in {OLD_RNG_FILE}, a pickle, which is not loaded (unpickling runs any code "
            "in the file)" if (folder / OLD_RNG_FILE).is_file() else f"has no {RNG_FILE}")


def load_rng(saved: dict[str, Any] | str, uri: str, reseed: int) -> None:
    """Restore the RNGs from a checkpoint's rng.json (`saved`, rank 0's RNGs, on every rank); a checkpoint of
    the old format (rng.pt, `saved` says why in words) is re-seeded.

    rng.pt is a pickle of Python objects (random.getstate() is a tuple), which only an unsafe
    torch.load(weights_only=False) reads, and unpickling runs any code the file carries. Re-seeding (from
    ppo.seed and the iteration, with a warning) rather than refusing: the RNGs only pick which samples and
    tokens come next, while refusing would throw away the trained actor and critic the checkpoint holds.
    """
    if isinstance(saved, dict):
        set_rng_state(saved)
        return
    print(f"warning: ppo: {uri} {saved}; the RNGs are re-seeded ({reseed}), so the samples drawn after this "
          "resume differ from those of an uninterrupted run", file=sys.stderr, flush=True)
    torch.manual_seed(reseed)
    random.seed(reseed)
    np.random.seed(reseed % 2**32)


def working_dir(ctx: StageContext) -> Path:
    """Where the stage writes as it goes: the output folder itself for file://, else a scratch folder.

    Not cleared on start: a resumed run keeps the rollouts and checkpoints of the killed one. What the
    killed run left half-written goes, so the published output never carries it: the temp files of
    atomic writes, and checkpoint folders that never got their manifest (they are rewritten).
    """
    local = open_store(ctx.spec.output_uri, ctx.spec.storage).local_path(ctx.spec.output_uri)
    if local is None:
        local = ctx.workdir / ".alignflow" / "scratch" / ("ppo-" + ctx.spec.output_uri.rsplit("/", 1)[-1])
    if not is_main():  # rank 0 clears what a killed run left, and is the only one that writes here
        return local
    local.mkdir(parents=True, exist_ok=True)
    leftovers = [str(p.relative_to(local)) for p in remove_unfinished_writes(local)]
    checkpoints = local / "checkpoints"
    for folder in sorted(checkpoints.iterdir()) if checkpoints.is_dir() else []:
        if folder.is_dir() and not (folder / "manifest.json").is_file():
            shutil.rmtree(folder)
            leftovers.append(f"{folder.relative_to(local)}/")
    if leftovers:
        print(
            f"ppo: removed what an interrupted run left half-written in {local}: {', '.join(leftovers)}",
            file=sys.stderr,
        )
    return local


def start_resumed_run(ctx: StageContext, state: RLState) -> None:
    """Start the resumed attempt's MLflow run with the checkpoint's history, steps 1..k, before it logs live.

    The run is a fresh one (tracked() opened it and marked the killed attempt's run superseded): a killed
    attempt may have logged iterations past its last checkpoint, which this attempt runs again with other
    values, and MLflow cannot delete metric steps. So the run the pipeline points at shows each step once,
    with the values of the iterations the final policy came from.
    """
    assert ctx.tracker is not None
    ctx.tracker.log_history(state.history)
    ctx.tracker.set_tags(
        {
            "alignflow.resumed_at_iteration": str(state.iteration),
            **({"alignflow.resumed_from_run": state.mlflow_run_id} if state.mlflow_run_id else {}),
        }
    )


def publish_last_good(
    ctx: StageContext, out: Path, state: RLState, actor, critic, last_checkpoint: str | None, exc: Exception
) -> str:
    """After a non-finite value (`exc`): checkpoint the current state if no update ran in the bad iteration.
    Returns where the last good state is, in words for the error message."""
    if "loss" not in str(exc) and state.iteration > 0:
        # The bad value appeared before any optimizer step of this iteration: the weights are good.
        uri = join_uri(ctx.spec.output_uri, "checkpoints", f"iter_{state.iteration:05d}")
        if find_published(uri, ctx.spec.storage) is None:
            uri = save_checkpoint(ctx, out, state, actor, critic)
        return f"{uri} (iteration {state.iteration})"
    return (
        f"{last_checkpoint} (the updates of this iteration are discarded)"
        if last_checkpoint
        else "none (no iteration completed)"
    )


def write_final(out: Path, state: RLState, actor, critic, tokenizer, cfg: PPOConfig, facts: RunFacts) -> None:
    """The finished run's outputs in `out`: policy/ (HF format, with the tokenizer), critic/ (PPO),
    metrics.jsonl and alignflow_run.json (with `facts`, what the run ran with: trainer, precision, engine)."""
    policy_dir, critic_dir = out / "policy", out / "critic"
    if is_main():  # the only rank that writes: the others may run on nodes without this folder
        policy_dir.mkdir(parents=True, exist_ok=True)
        if critic is not None:
            critic_dir.mkdir(parents=True, exist_ok=True)
    save_trained(actor, policy_dir)  # merged, plus the adapter files, with LoRA (every rank; rank 0 writes)
    if critic is not None:
        if isinstance(critic, CriticWorker):
            critic.save_trained(critic_dir)
        else:
            save_trained(critic, critic_dir)
    if not is_main():
        return
    tokenizer.save_pretrained(policy_dir)
    (out / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in state.history))
    dump_json(
        {
            "algorithm": cfg.algorithm,
            "iterations": state.iteration,
            "kl_coef_final": state.kl_controller.value,
            "final": state.history[-1],
            "run_facts": dataclasses.asdict(facts),
        },
        out / "alignflow_run.json",
    )
