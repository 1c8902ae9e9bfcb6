"""What the supervised training stages (SFT, reward, DPO) share around their own data, loss and metrics.

A stage loads its model and data and logs its data files (`log_datasets`); `start_training` wraps the
model in DeepSpeed and returns a `SupervisedTrainer`. The stage's own loop (batches, loss, metrics) then
calls `backward` once per micro-batch, `check_finite` once per step and `log` for its metrics, and ends
with `save`, after which rank 0 publishes. What this module is not: a training loop or a base class; each
stage's loop stays in the stage, readable top to bottom (stages/common/training/loop.py has its batching).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alignflow.stages.common.ranks import is_main, world_size
from alignflow.stages.common.runtime import StageContext, dump_json
from alignflow.stages.common.training.deepspeed_setup import initialize
from alignflow.stages.common.training.loop import optim_settings
from alignflow.stages.common.training.lora import parameter_counts, save_trained
from alignflow.stages.common.training.precision import Precision


def log_datasets(ctx: StageContext, rows: Mapping[str, int]) -> None:
    """Log files of the `data` input as the stage's MLflow dataset inputs: `<name>.jsonl` with its digest and
    `rows[name]` rows; a name ending in 'train' is training data, any other evaluation data. Without
    tracking it does nothing."""
    if ctx.tracker is None:
        return
    data_manifest = ctx.input_manifest("data")
    for name, count in rows.items():
        ctx.tracker.log_dataset(name, f"{data_manifest.uri}/{name}.jsonl",
                                data_manifest.file(f"{name}.jsonl").sha256,
                                "training" if name.endswith("train") else "evaluation", count)


def _no_log(*args: Any, **kwargs: Any) -> None:
    """The metrics logger of a stage run without tracking."""


@dataclass
class SupervisedTrainer:
    """A supervised stage's model under DeepSpeed, in training mode, and what its loop needs beside its
    loss."""

    ctx: StageContext
    name: str  # the stage as its messages name it: sft, dpo, reward-<model name>
    engine: Any  # the DeepSpeed engine; engine.module is the model
    scheduler: Any
    grad_accum: int  # micro-batches per rank in one optimizer step
    trainable: int  # parameters that train (the LoRA adapters, or all)
    total: int  # parameters in all
    precision: Precision
    log: Callable[..., None]  # ctx.tracker.log_metrics(metrics, step=...), or a no-op without tracking

    def backward(self, loss_sum: torch.Tensor, count: int) -> None:
        """Back-propagate one micro-batch's share of the global step's mean loss, then step the engine (it
        updates the weights at the step's last micro-batch).

        loss_sum: scalar, the micro-batch's loss summed over its items (tokens or pairs); count: the items of
        the whole global step, over all ranks.
        """
        # A mean over the whole global step, not a mean of micro-batch means: DeepSpeed divides by grad_accum
        # in backward and averages gradients over ranks, so scale back up.
        self.engine.backward(loss_sum / count * self.grad_accum * world_size())
        self.engine.step()

    def lr(self) -> float:
        """The learning rate of the step just taken."""
        return self.scheduler.get_last_lr()[0]

    def check_finite(self, loss: float, step: int, advice: str) -> None:
        """Stop the stage when a step's loss is NaN or infinite; `advice` says what to change."""
        if not math.isfinite(loss):
            raise RuntimeError(f"{self.name}: loss is {loss} at step {step}; {advice}")

    def perf_metrics(self) -> dict[str, float]:
        """What trains and in what precision: perf/trainable_parameters, perf/trainable_share and
        perf/autocast_bf16."""
        return {"perf/trainable_parameters": float(self.trainable),
                "perf/trainable_share": self.trainable / self.total,
                "perf/autocast_bf16": float(self.precision.autocast_dtype is not None)}

    def save(self, folder: Path, tokenizer, sidecar: dict[str, Any], files: Mapping[Path, Any] | None = None
             ) -> None:
        """Save the trained model as an HF checkpoint in `folder` (created if missing), then, on rank 0
        only, the tokenizer, the sidecar `alignflow_checkpoint.json` describing the checkpoint, and `files`
        (path -> a str written as it is, anything else as JSON). Call it on every rank; then the other ranks
        return `ctx.rank_result` and rank 0 publishes."""
        with self.ctx.profiler.phase("save"):
            folder.mkdir(exist_ok=True)
            save_trained(self.engine, folder)  # every rank: a collective under ZeRO-3; rank 0 writes
        if not is_main():
            return
        with self.ctx.profiler.phase("save"):
            tokenizer.save_pretrained(folder)
            dump_json(sidecar, folder / "alignflow_checkpoint.json")
            for path, content in (files or {}).items():
                if isinstance(content, str):
                    path.write_text(content)
                else:
                    dump_json(content, path)


def start_training(ctx: StageContext, name: str, model: torch.nn.Module, precision: Precision, cfg,
                   steps: int, dtype: str) -> SupervisedTrainer:
    """Wrap `model` (placed by `place_for_training`) in a DeepSpeed engine with the optimiser settings of the
    stage's section `cfg` over `steps` optimizer steps, in training mode; record where it trains."""
    trainable, total = parameter_counts(model)  # on the bare model: ZeRO-3 partitions it in initialize
    engine, _, scheduler = initialize(model, optim_settings(cfg, steps, dtype))
    engine.train()  # from_pretrained returns eval mode; dropout (GPT-2 style models) must be on
    ctx.record_device("train", engine.module)
    return SupervisedTrainer(ctx=ctx, name=name, engine=engine, scheduler=scheduler,
                             grad_accum=cfg.batch_size // (cfg.micro_batch_size * world_size()),
                             trainable=trainable, total=total, precision=precision,
                             log=ctx.tracker.log_metrics if ctx.tracker is not None else _no_log)
