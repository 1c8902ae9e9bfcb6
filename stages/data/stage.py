"""The data stage: generate the demo task or validate the user's files, split held-out sets, publish.

Output files (all JSONL, one record per line): sft_train, sft_eval, preferences_train,
preferences_eval, prompts, eval_prompts, plus stats.json. Later stages read only this output, so
every dataset they see has been validated once, here, with file:line errors for bad records.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from alignflow.config import DataConfig
from alignflow.contract import StageResult, StageSpec
from alignflow.manifest import sha256_file
from alignflow.stages.common.runtime import (
    StageContext,
    StageInputError,
    dump_json,
    run_program,
    section,
    stage_main,
    tracked,
)
from alignflow.stages.data.demo_task import generate_demo_task
from alignflow.stages.data.formats import holdout_split, load_preferences, load_prompts, load_sft, write_jsonl
from alignflow.stages.data.preflight import identical_pairs, identical_pairs_warning, size_limits
from alignflow.storage import open_store

DATASET_FILES = ("sft_train", "sft_eval", "preferences_train", "preferences_eval", "prompts", "eval_prompts")


def _fetch(uri: str, scratch: Path, spec: StageSpec) -> Path:
    """A local copy of a user's data file (local paths are used in place)."""
    store = open_store(uri, spec.storage)
    local = store.local_path(uri) if "://" in uri else Path(uri)
    if local is not None:
        path = Path(local)
        if not path.is_absolute():
            path = Path(spec.workdir) / path
        return path
    target = scratch / Path(uri).name
    store.get_file(uri, target)
    return target


def _split(name: str, records: list, fraction: float, seed: int) -> tuple[list, list]:
    try:
        return holdout_split(records, fraction, seed)
    except ValueError as exc:
        raise StageInputError(f"{name}: {exc}; add records or point data.{name} at a larger file") from None


def run(spec: StageSpec) -> StageResult:
    cfg: DataConfig = section(spec, DataConfig, "data")
    ctx = StageContext(spec)
    with tracked(ctx), tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if cfg.source == "demo":
            paths = generate_demo_task(cfg.demo, scratch)
            sources = {k: f"demo://seed={cfg.demo.seed}/{k}" for k in paths}
            seed = cfg.demo.seed
        else:
            paths = {k: _fetch(getattr(cfg, k), scratch, spec)
                     for k in ("sft", "preferences", "prompts", "eval_prompts") if getattr(cfg, k)}
            sources = {k: getattr(cfg, k) for k in paths}
            seed = 0
        limits = size_limits(cfg)  # the same limits `alignflow validate` checks (preflight.py)
        sft = load_sft(paths["sft"], limits)
        preferences = load_preferences(paths["preferences"], limits)
        identical = identical_pairs_warning(sources["preferences"], preferences)
        if identical:
            print(f"warning: data: {identical}", file=sys.stderr, flush=True)
        prompts = load_prompts(paths["prompts"], limits)
        sft_train, sft_eval = _split("sft", sft, cfg.eval_fraction, seed)
        pref_train, pref_eval = _split("preferences", preferences, cfg.eval_fraction, seed + 1)
        if "eval_prompts" in paths:
            eval_prompts = load_prompts(paths["eval_prompts"], limits)
        else:
            prompts, eval_prompts = _split("prompts", prompts, cfg.eval_fraction, seed + 2)
        datasets = {"sft_train": sft_train, "sft_eval": sft_eval, "preferences_train": pref_train,
                    "preferences_eval": pref_eval, "prompts": prompts, "eval_prompts": eval_prompts}
        with ctx.output_dir() as out:
            stats = {}
            for name, records in datasets.items():
                path = out / f"{name}.jsonl"
                write_jsonl(records, path)
                stats[name] = {"records": len(records), "sha256": sha256_file(path)}
            stats["sources"] = sources
            dump_json(stats, out / "stats.json")
            metrics = {f"data/{name}_records": float(len(records)) for name, records in datasets.items()}
            metrics["data/preferences_identical"] = float(len(identical_pairs(preferences)))
            if ctx.tracker is not None:
                ctx.tracker.log_metrics(metrics)
                for name in DATASET_FILES:
                    ctx.tracker.log_dataset(name, f"{spec.output_uri}/{name}.jsonl", stats[name]["sha256"],
                                            context="published", n_records=stats[name]["records"])
            manifest = ctx.publish_output(
                out, summary={"metrics": metrics, "key_metric": "data/sft_train_records"}
            )
        return ctx.result(manifest, metrics, "data/sft_train_records")


def main(argv: list[str] | None = None) -> int:
    return stage_main("data", run, argv)


if __name__ == "__main__":
    run_program(main)
