"""The base stage: the starting policy checkpoint, a tiny random Llama made on the spot or an imported HF one.

With `model.base` empty it trains a byte-level BPE tokenizer on the data stage's texts and makes a
random-init Llama from `model.tiny`. Otherwise it loads `model.base` (a local HF folder, or a
published alignflow output URI) with `from_pretrained` to check it is a usable causal LM, and
publishes its files unchanged, so every later stage reads the policy from the object store. Weights in
a pickle format are refused unless `model.allow_pickle`; allowed, they are published as safetensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from alignflow import start_checks
from alignflow.config import ModelConfig
from alignflow.contract import StageResult, StageSpec
from alignflow.manifest import find_published, materialize
from alignflow.stages.common.models.loading import (
    SAFETENSORS_WEIGHTS,
    ModelDirError,
    load_causal_lm,
    load_tokenizer,
    pickle_refusal,
)
from alignflow.stages.common.models.tiny import make_tiny_model, save_base_model, train_tokenizer
from alignflow.stages.common.runtime import (
    StageContext,
    StageInputError,
    dump_json,
    run_program,
    section,
    stage_main,
    tracked,
)
from alignflow.stages.data.formats import load_preferences, load_prompts, load_sft, render_prompt

# Files of an HF model folder that the base stage republishes (weights, configs, tokenizer).
_MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".model", ".txt", ".jinja", ".tiktoken")


def corpus_texts(data_dir: Path) -> list[str]:
    """Every prompt and response text of the data stage's output (the tokenizer's training corpus)."""
    texts: list[str] = []
    for record in load_sft(data_dir / "sft_train.jsonl"):
        texts += [render_prompt(record.prompt), record.completion]
    for record in load_preferences(data_dir / "preferences_train.jsonl"):
        texts += [render_prompt(record.prompt), record.chosen, record.rejected]
    for name in ("prompts.jsonl", "eval_prompts.jsonl"):
        texts += [render_prompt(r.prompt) for r in load_prompts(data_dir / name)]
    return texts


def _import_dir(ctx: StageContext, base: str, allow_pickle: bool = False) -> Path:
    """A local folder holding `model.base`: a plain directory, a published output, or a folder inside one
    (the registry's versions point at `<RL output>/policy`); published outputs are verified. A folder whose
    weights are pickle files is refused unless allow_pickle (model.allow_pickle)."""
    if "://" in base and not base.startswith("file://"):
        if find_published(base, ctx.spec.storage) is not None:
            folder = materialize(base, ctx.cache_dir, ctx.spec.storage)[0]
        else:
            parent, _, sub = base.rstrip("/").rpartition("/")
            if find_published(parent, ctx.spec.storage) is None:
                raise StageInputError(f"model.base '{base}': neither it nor its parent is a published output")
            folder = materialize(parent, ctx.cache_dir, ctx.spec.storage)[0] / sub
        refusal = pickle_refusal(folder, allow_pickle)
        if refusal is not None:
            raise StageInputError(f"model.base: {refusal}")
        return folder
    # `alignflow validate` makes the same check (pickle weights too)
    problem = start_checks.base_model_dir(base, ctx.spec.workdir, allow_pickle)
    if problem is not None:
        raise StageInputError(problem.message)
    path = Path(base.removeprefix("file://"))
    return path if path.is_absolute() else Path(ctx.spec.workdir) / path


def _import_model(source: Path, cfg: ModelConfig, out: Path):
    """Load model.base from `source` (the check that it is a usable causal LM) and publish its files into
    `out`: weights, configs and tokenizer files as they are; weights in pickle (allowed by
    model.allow_pickle) re-saved as safetensors, so no later stage reads a pickle. Returns (model,
    tokenizer); a folder that is not a loadable model is bad input (exit 2)."""
    try:
        tokenizer = load_tokenizer(source)
        model = load_causal_lm(source, dtype=cfg.dtype, allow_pickle=cfg.allow_pickle)
    except ModelDirError as exc:
        raise StageInputError(f"model.base: {exc}") from None
    resave = not any((source / name).is_file() for name in SAFETENSORS_WEIGHTS)
    for path in sorted(source.iterdir()):
        if (
            path.is_file()
            and path.suffix in _MODEL_FILE_SUFFIXES
            and path.name != "manifest.json"
            and not (resave and path.name.endswith(".bin.index.json"))  # the index of pickle shards
        ):
            shutil.copyfile(path, out / path.name)
    if resave:
        model.save_pretrained(out)  # safetensors, in model.dtype
    return model, tokenizer


def run(spec: StageSpec) -> StageResult:
    cfg: ModelConfig = section(spec, ModelConfig, "model")
    ctx = StageContext(spec)
    with tracked(ctx):
        # refused (a missing folder, pickle weights) before anything is written
        source = _import_dir(ctx, cfg.base, cfg.allow_pickle) if cfg.base is not None else None
        with ctx.output_dir() as out:
            if source is None:
                texts = corpus_texts(ctx.input("data"))
                tokenizer = train_tokenizer(texts, cfg.tiny.vocab_size)
                model = make_tiny_model(cfg.tiny, tokenizer, seed=cfg.seed)
                save_base_model(model, tokenizer, out)
                origin = "tiny"
            else:
                model, tokenizer = _import_model(source, cfg, out)
                origin = cfg.base
            n_params = sum(p.numel() for p in model.parameters())
            architecture = (model.config.architectures or [type(model).__name__])[0]
            dump_json(
                {
                    "stage": "base",
                    "origin": origin,
                    "architecture": architecture,
                    "parameters": n_params,
                    "vocab_size": len(tokenizer),
                    "torch_version": torch.__version__,
                },
                out / "alignflow_checkpoint.json",
            )
            metrics = {"model/parameters": float(n_params), "model/vocab_size": float(len(tokenizer))}
            if ctx.tracker is not None:
                ctx.tracker.log_metrics(metrics)
                ctx.tracker.set_tags({"alignflow.architecture": architecture})
                ctx.tracker.log_artifact(out / "config.json", "model")
            manifest = ctx.publish_output(
                out,
                summary={"metrics": metrics, "key_metric": "model/parameters", "architecture": architecture},
            )
        return ctx.result(
            manifest,
            metrics,
            "model/parameters",
            message=f"{architecture} with {n_params:,} parameters ({origin})",
        )


def main(argv: list[str] | None = None) -> int:
    return stage_main("base", run, argv)


if __name__ == "__main__":
    run_program(main)
