"""What a killed RL stage resumes from and what a finished one leaves; not when to checkpoint (the loop says).

The RL state, its checkpoints (published, found, loaded), the working folder a resumed run continues in, the
resumed attempt's MLflow run, the last good state after a NaN, and the final policy and critic. A checkpoint
is `checkpoints/iter_NNNNN/` under the stage's output, published with its own manifest: the actor's and
critic's trainer states (every rank's optimizer shard under ZeRO), `state.json` (RLState) and `rng.json` (the
torch, Python and NumPy RNG states as numbers: nothing in it is unpickled). Checkpoints written before held
the RNGs in a pickle, `rng.pt`; it is never opened (see load_rng).
"""

from __future__ import annotations

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
from alignflow.stages.common.ranks import barrier, is_main, world_size
from alignflow.stages.common.runtime import StageContext, StageInputError, dump_json
from alignflow.stages.common.training.lora import save_trained
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
    folder.mkdir(parents=True, exist_ok=True)
    actor.save_checkpoint(str(folder / "actor"), tag="state")  # every rank: its optimizer shard (ZeRO)
    if critic is not None:
        critic.save_checkpoint(str(folder / "critic"), tag="state")
    uri = join_uri(ctx.spec.output_uri, "checkpoints", name)
    barrier()  # every rank's files are in the folder before rank 0 publishes it
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
    """Resume from the checkpoint at `uri`: the trainers' states, the RNGs and `state`; refused when it was
    written by another number of trainer ranks."""
    if is_main():  # rank 0 fills the download cache first; the other ranks then find it there
        folder, _ = materialize(uri, ctx.cache_dir, ctx.spec.storage)
    barrier()
    if not is_main():
        folder, _ = materialize(uri, ctx.cache_dir, ctx.spec.storage)
    saved = json.loads((folder / "state.json").read_text())
    written_by = int(saved.get("world_size", 1))
    if written_by != world_size():
        # ppo.resources is part of the output's key, so the flow never resumes across rank counts; a spec
        # edited by hand could. DeepSpeed's optimizer shards are cut per rank: refuse rather than mis-load.
        raise StageInputError(
            f"{uri}: this checkpoint was written by {written_by} trainer rank(s) and the stage "
            f"now runs {world_size()} (ppo.resources); resume with the rank count that wrote "
            "it, or start a fresh run (another output)"
        )
    actor.load_checkpoint(str(folder / "actor"), tag="state")
    if critic is not None:
        critic.load_checkpoint(str(folder / "critic"), tag="state")
    seed = int((ctx.spec.config.get("ppo") or {}).get("seed", 0))  # ppo.seed
    load_rng(folder, uri, reseed=seed * 1_000_003 + int(saved["iteration"]))
    state.load_json(saved)


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


def load_rng(folder: Path, uri: str, reseed: int) -> None:
    """Restore the RNGs from a checkpoint's rng.json; a checkpoint of the old format (rng.pt) is re-seeded.

    rng.pt is a pickle of Python objects (random.getstate() is a tuple), which only an unsafe
    torch.load(weights_only=False) reads, and unpickling runs any code the file carries. Re-seeding (from
    ppo.seed and the iteration, with a warning) rather than refusing: the RNGs only pick which samples and
    tokens come next, while refusing would throw away the trained actor and critic the checkpoint holds.
    """
    if (folder / RNG_FILE).is_file():
        saved = json.loads((folder / RNG_FILE).read_text())
        if saved.get("format") != RNG_FORMAT:
            raise StageInputError(f"{uri}/{RNG_FILE}: unknown format {saved.get('format')!r}, "
                                  f"expected {RNG_FORMAT!r}; start a fresh run (another output)")
        set_rng_state(saved)
        return
    why = (f"keeps its RNG state in {OLD_RNG_FILE}, a pickle, which is not loaded (unpickling runs any code "
           "in the file)" if (folder / OLD_RNG_FILE).is_file() else f"has no {RNG_FILE}")
    print(f"warning: ppo: {uri} {why}; the RNGs are re-seeded ({reseed}), so the samples drawn after this "
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
    local.mkdir(parents=True, exist_ok=True)
    if not is_main():  # rank 0 clears what a killed run left; the others only write their checkpoint shards
        return local
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


def write_final(out: Path, state: RLState, actor, critic, tokenizer, cfg: PPOConfig) -> None:
    """The finished run's outputs in `out`: policy/ (HF format, with the tokenizer), critic/ (PPO),
    metrics.jsonl and alignflow_run.json."""
    policy_dir = out / "policy"
    policy_dir.mkdir(parents=True, exist_ok=True)
    save_trained(actor, policy_dir)  # merged, plus the adapter files, with LoRA (every rank; rank 0 writes)
    if critic is not None:
        critic_dir = out / "critic"
        critic_dir.mkdir(parents=True, exist_ok=True)
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
        },
        out / "alignflow_run.json",
    )
