"""The RL checkpoint's RNG state: saved as numbers (rng.json) and restored exactly; an old checkpoint's
rng.pt, a pickle, is never unpickled (a crafted one that writes a file stays inert) and the RNGs are
re-seeded with a warning."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from alignflow.config import PPOConfig
from alignflow.contract import StageSpec
from alignflow.manifest import publish
from alignflow.stages.common.training.plain_trainer import PlainTorchTrainer
from alignflow.stages.common.training.trainer_state import save_trainer_state
from alignflow.stages.ppo.checkpoints import (
    OLD_RNG_FILE,
    RNG_FILE,
    RLState,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from tests.malicious_pickle import unpickling_runs_it, write_malicious_pickle
from tests.stages.common.training.test_plain_trainer import SETTINGS


def small_trainer(seed: int) -> PlainTorchTrainer:
    """A real trainer of a 3 -> 2 linear layer, stepped once so its optimizer holds moments."""
    torch.manual_seed(seed)
    trainer = PlainTorchTrainer(torch.nn.Linear(3, 2), SETTINGS)
    trainer.backward(trainer(torch.ones(1, 3)).sum())
    trainer.step()
    return trainer


def context(tmp_path: Path, seed: int = 3) -> SimpleNamespace:
    spec = StageSpec(stage="ppo", config={"ppo": {"seed": seed}}, output_uri=f"file://{tmp_path}/out",
                     code_version="test", workdir=str(tmp_path))
    return SimpleNamespace(spec=spec, cache_dir=tmp_path / "cache")


def draws() -> tuple[list[float], float, float]:
    return torch.rand(4).tolist(), random.random(), float(np.random.rand())


def test_the_rng_state_round_trips_through_json():
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    draws()
    saved = json.loads(json.dumps(rng_state()))
    expected = draws()
    draws()
    set_rng_state(saved)
    assert draws() == expected


def test_a_checkpoint_holds_no_pickle_and_resumes_the_exact_rngs(tmp_path):
    ctx, state = context(tmp_path), RLState(PPOConfig())
    state.iteration = 2
    out = tmp_path / "out"
    saved, actor = small_trainer(seed=1), small_trainer(seed=2)
    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    uri = save_checkpoint(ctx, out, state, saved, None)
    expected = draws()
    folder = out / "checkpoints/iter_00002"
    assert (folder / RNG_FILE).is_file() and not (folder / OLD_RNG_FILE).exists()
    assert not [p for p in folder.rglob("*") if p.suffix in (".pt", ".pkl", ".bin", ".pth", ".ckpt")]
    draws()
    resumed = RLState(PPOConfig())
    load_checkpoint(ctx, uri, resumed, actor, None)
    assert draws() == expected
    assert resumed.iteration == 2
    assert torch.equal(actor.module.weight, saved.module.weight)


def test_an_old_rng_pickle_is_never_unpickled_and_the_rngs_are_reseeded(tmp_path, capsys):
    """A checkpoint of the old format whose rng.pt was swapped for a crafted pickle (the manifest lists it
    with its sha256, as an attacker who can publish would): resuming leaves the payload inert."""
    sentinel = tmp_path / "pwned"
    folder = tmp_path / "old/checkpoints/iter_00004"
    save_trainer_state(small_trainer(seed=1), folder / "actor")
    state = RLState(PPOConfig())
    state.iteration = 4
    (folder / "state.json").write_text(json.dumps(state.to_json()))
    write_malicious_pickle(folder / OLD_RNG_FILE, sentinel)
    assert unpickling_runs_it(folder / OLD_RNG_FILE, sentinel), "the crafted file is a working attack"
    uri = f"file://{folder}"
    publish(folder, uri, stage="ppo-checkpoint", config={}, inputs={}, version="old")

    ctx, after = context(tmp_path, seed=3), []
    for _ in range(2):
        resumed, actor = RLState(PPOConfig()), small_trainer(seed=2)
        load_checkpoint(ctx, uri, resumed, actor, None)
        after.append(draws())
    assert not sentinel.exists()
    assert resumed.iteration == 4
    assert after[0] == after[1], "re-seeded from ppo.seed and the iteration: the same on every resume"
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == 2 * [
        f"warning: ppo: {uri} keeps its RNG state in rng.pt, a pickle, which is not loaded (unpickling runs "
        f"any code in the file); the RNGs are re-seeded ({3 * 1_000_003 + 4}), so the samples drawn after "
        "this resume differ from those of an uninterrupted run"
    ]
