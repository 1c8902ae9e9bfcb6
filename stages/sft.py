"""The SFT stage: supervised fine-tuning through DeepSpeed with the loss on completion tokens only.

Inputs: `base` (a Hugging Face causal-LM folder with its tokenizer) and `data` (the data stage's
output). Output: an HF-format safetensors checkpoint with its tokenizer and a sidecar
`alignflow_checkpoint.json` describing it (steps, losses, data digests).
"""

from __future__ import annotations

import contextlib
import time

import torch

from alignflow.config import ModelConfig, SFTConfig
from alignflow.contract import StageResult, StageSpec
from alignflow.kernels import selective_log_softmax
from alignflow.stages.common.devices import device_of
from alignflow.stages.common.models.loading import load_causal_lm, load_tokenizer
from alignflow.stages.common.ranks import is_main, local_share, sum_over_ranks, world_size
from alignflow.stages.common.runtime import StageContext, run_program, section, stage_main, tracked
from alignflow.stages.common.tokenization import (
    IGNORE_INDEX,
    Encoded,
    collate_lm,
    encode_example,
    pad_token_id,
)
from alignflow.stages.common.training.loop import (
    batch_indices,
    check_training_section,
    progress_bar,
    split_micro,
    total_steps,
)
from alignflow.stages.common.training.lora import apply_lora
from alignflow.stages.common.training.placement import place_for_training, to_device
from alignflow.stages.common.training.precision import Precision
from alignflow.stages.common.training.supervised_stage import log_datasets, start_training
from alignflow.stages.data.formats import load_sft, render_prompt


def completion_nll(model, batch: dict[str, torch.Tensor], precision: Precision | None = None
                   ) -> tuple[torch.Tensor, int]:
    """Summed negative log-likelihood of the completion tokens of a batch, and their count; the batch is moved
    to the model's device and the forward runs in `precision` (None: the model's dtype).

    Uses the kernels' selective log-softmax: no [B, T, V] float32 log-softmax is materialised.
    """
    batch = to_device(batch, device_of(model))
    with precision.forward() if precision is not None else contextlib.nullcontext():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE_INDEX
    logp = selective_log_softmax(logits[:, :-1], targets.clamp(min=0))
    return -(logp * mask).sum(), int(mask.sum())


@torch.no_grad()
def eval_loss(model, examples: list[Encoded], pad_id: int, batch_size: int, precision: Precision | None = None
              ) -> float:
    """Mean per-token NLL of the completion tokens of `examples`."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        nll, n = completion_nll(model, collate_lm(examples[start:start + batch_size], pad_id), precision)
        total, count = total + float(nll), count + n
    model.train(was_training)
    return total / max(count, 1)


def run(spec: StageSpec) -> StageResult:
    cfg: SFTConfig = section(spec, SFTConfig, "sft")
    model_cfg: ModelConfig = section(spec, ModelConfig, "model")
    check_training_section(cfg, "sft")
    torch.manual_seed(cfg.seed)
    ctx = StageContext(spec)
    with tracked(ctx):
        base_dir, data_dir = ctx.input("base"), ctx.input("data")
        tokenizer = load_tokenizer(base_dir)
        model, precision = place_for_training(
            ctx, apply_lora(load_causal_lm(base_dir, dtype=model_cfg.dtype), cfg.lora, "sft.lora"),
            cfg.autocast, model_cfg.dtype, "sft")
        pad_id = pad_token_id(tokenizer)
        train_records = load_sft(data_dir / "sft_train.jsonl")
        eval_records = load_sft(data_dir / "sft_eval.jsonl")
        log_datasets(ctx, {"sft_train": len(train_records), "sft_eval": len(eval_records)})

        def encode(records) -> list[Encoded]:
            return [encode_example(tokenizer, render_prompt(r.prompt, tokenizer), r.completion,
                                   cfg.max_length) for r in records]

        train, held_out = encode(train_records), encode(eval_records)
        truncated = sum(e.truncated for e in train)
        steps = total_steps(len(train), cfg.epochs, cfg.batch_size)
        trainer = start_training(ctx, "sft", model, precision, cfg, steps, model_cfg.dtype)
        engine, log = trainer.engine, trainer.log

        with ctx.profiler.phase("eval"):
            initial_loss = eval_loss(engine.module, held_out, pad_id, cfg.micro_batch_size, precision)
        log({"eval/loss": initial_loss}, step=0)
        metrics = {"eval/loss_initial": initial_loss, **trainer.perf_metrics()}
        tokens_seen, started = 0, time.perf_counter()
        train_loss = float("nan")
        with progress_bar("sft", steps) as advance:
            batches = batch_indices(len(train), cfg.batch_size, steps, cfg.seed)
            for step, indices in enumerate(batches, start=1):
                # Every rank draws the same global batch and trains on its share of it.
                micro = [collate_lm([train[i] for i in part], pad_id)
                         for part in split_micro(local_share(indices), cfg.micro_batch_size)]
                local_tokens = sum(int(m["attention_mask"].sum()) for m in micro)
                step_tokens, step_all_tokens = sum_over_ranks(
                    sum(int((m["labels"][:, 1:] != IGNORE_INDEX).sum()) for m in micro), local_tokens)
                step_nll = 0.0
                with ctx.profiler.phase("train"):
                    for batch in micro:
                        nll, _ = completion_nll(engine, batch, precision)
                        trainer.backward(nll, step_tokens)  # the token-mean over the global step
                        step_nll += float(nll.detach())
                ctx.profiler.count(tokens=local_tokens, samples=len(indices) // world_size())
                train_loss = sum_over_ranks(step_nll)[0] / step_tokens
                trainer.check_finite(train_loss, step, "lower sft.lr or check the data")
                tokens_seen += step_all_tokens
                step_metrics = {"train/loss": train_loss, "train/lr": trainer.lr(),
                                "perf/tokens_per_s": tokens_seen / (time.perf_counter() - started)}
                if step % cfg.eval_every == 0 or step == steps:
                    with ctx.profiler.phase("eval"):
                        step_metrics["eval/loss"] = eval_loss(engine.module, held_out, pad_id,
                                                              cfg.micro_batch_size, precision)
                log(step_metrics, step=step)
                advance(f"loss {train_loss:.3f}")
        final_loss = step_metrics["eval/loss"]
        metrics.update({"eval/loss": final_loss, "train/loss": train_loss, "train/steps": float(steps),
                        "perf/tokens_per_s": step_metrics["perf/tokens_per_s"],
                        "timing/train_s": time.perf_counter() - started})
        log({"eval/loss_final": final_loss, "timing/train_s": metrics["timing/train_s"]}, step=steps)
        with ctx.output_dir() as out:
            trainer.save(out, tokenizer, {
                "stage": "sft", "steps": steps, "lora": cfg.lora.model_dump() if cfg.lora.enabled else None,
                "examples": len(train), "truncated_examples": truncated, "metrics": metrics,
                "inputs": spec.inputs, "input_digests": spec.input_digests})
            if not is_main():
                return ctx.rank_result(metrics)
            manifest = ctx.publish_output(out, summary={"metrics": metrics, "key_metric": "eval/loss"})
        return ctx.result(manifest, metrics, "eval/loss",
                          message=f"held-out loss {initial_loss:.3f} -> {final_loss:.3f}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("sft", run, argv)


if __name__ == "__main__":
    run_program(main)
