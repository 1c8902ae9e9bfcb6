"""The reward stage: one reward model, a scalar head on the SFT backbone trained with the Bradley-Terry loss.

Inputs: `sft` (the SFT checkpoint, whose backbone the model starts from) and `data`. The spec's
config holds the shared `reward` hyperparameters and this model's `model` entry (name, seed, data
share, weight); the flow runs the stage once per entry of `reward.models`. Output: an HF-format
sequence-classification checkpoint (num_labels=1), its tokenizer, and a sidecar with held-out
pairwise accuracy and the score's mean/std on held-out responses (the RL stage normalises with them).
"""

from __future__ import annotations

import contextlib
import random
import time

import torch
import torch.nn.functional as F

from alignflow.config import ModelConfig, RewardConfig, RewardModelSpec
from alignflow.contract import StageResult, StageSpec
from alignflow.stages.common.devices import device_of
from alignflow.stages.common.models.loading import load_sequence_classifier, load_tokenizer
from alignflow.stages.common.ranks import is_main, local_share, sum_over_ranks
from alignflow.stages.common.runtime import StageContext, run_program, section, stage_main, tracked
from alignflow.stages.common.tokenization import encode_completion, encode_prompt, pad_right, pad_token_id
from alignflow.stages.common.training.loop import (
    batch_indices,
    check_training_section,
    progress_bar,
    split_micro,
    total_steps,
)
from alignflow.stages.common.training.lora import apply_lora
from alignflow.stages.common.training.placement import place_for_training
from alignflow.stages.common.training.precision import Precision
from alignflow.stages.common.training.supervised_stage import log_datasets, start_training
from alignflow.stages.data.formats import load_preferences, render_prompt


def encode_pair(tokenizer, record, max_length: int) -> tuple[list[int], list[int]]:
    """Token ids of prompt+chosen and prompt+rejected (each cut on the right at max_length)."""
    prompt_ids = encode_prompt(tokenizer, render_prompt(record.prompt, tokenizer))
    chosen = prompt_ids + encode_completion(tokenizer, record.chosen)
    rejected = prompt_ids + encode_completion(tokenizer, record.rejected)
    return chosen[:max_length], rejected[:max_length]


def score(model, sequences: list[list[int]], pad_id: int, precision: Precision | None = None) -> torch.Tensor:
    """[N] scalar rewards of right-padded sequences (the head reads the last non-pad token), computed on the
    model's device in `precision` (None: the model's dtype)."""
    device = device_of(model)
    input_ids = pad_right(sequences, pad_id).to(device)
    attention_mask = pad_right([[1] * len(s) for s in sequences], 0).to(device)
    with precision.forward() if precision is not None else contextlib.nullcontext():
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.squeeze(-1).float()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r_chosen - r_rejected), summed over pairs ([N] each -> scalar)."""
    return -F.logsigmoid(chosen - rejected).sum()


@torch.no_grad()
def evaluate_pairs(model, pairs: list[tuple[list[int], list[int]]], pad_id: int, batch_size: int,
                   precision: Precision | None = None) -> dict[str, float]:
    """Held-out pairwise accuracy, mean BT loss, and the mean/std of scores over all held-out responses."""
    was_training = model.training
    model.eval()
    chosen_scores, rejected_scores = [], []
    for start in range(0, len(pairs), batch_size):
        part = pairs[start:start + batch_size]
        both = score(model, [c for c, _ in part] + [r for _, r in part], pad_id, precision)
        chosen_scores.append(both[: len(part)])
        rejected_scores.append(both[len(part):])
    model.train(was_training)
    chosen, rejected = torch.cat(chosen_scores), torch.cat(rejected_scores)
    everything = torch.cat([chosen, rejected])
    return {"eval/accuracy": float((chosen > rejected).float().mean()),
            "eval/loss": float(bradley_terry_loss(chosen, rejected) / len(pairs)),
            "eval/score_mean": float(everything.mean()), "eval/score_std": float(everything.std())}


def run(spec: StageSpec) -> StageResult:
    cfg: RewardConfig = section(spec, RewardConfig, "reward")
    rm: RewardModelSpec = section(spec, RewardModelSpec, "reward_model")
    model_cfg: ModelConfig = section(spec, ModelConfig, "model")
    check_training_section(cfg, "reward")
    torch.manual_seed(rm.seed)
    ctx = StageContext(spec)
    with tracked(ctx, run_name=f"reward-{rm.name}"):
        sft_dir, data_dir = ctx.input("sft"), ctx.input("data")
        tokenizer = load_tokenizer(sft_dir)
        pad_id = pad_token_id(tokenizer)
        model, precision = place_for_training(
            ctx, apply_lora(load_sequence_classifier(sft_dir, dtype=model_cfg.dtype, seed=rm.seed), cfg.lora,
                            "reward.lora", classifier=True), cfg.autocast, model_cfg.dtype, "reward")
        train_records = load_preferences(data_dir / "preferences_train.jsonl")
        eval_records = load_preferences(data_dir / "preferences_eval.jsonl")
        if rm.data_fraction < 1.0:
            keep = max(1, round(len(train_records) * rm.data_fraction))
            train_records = random.Random(rm.seed).sample(train_records, keep)
        log_datasets(ctx, {"preferences_train": len(train_records), "preferences_eval": len(eval_records)})
        train = [encode_pair(tokenizer, r, cfg.max_length) for r in train_records]
        held_out = [encode_pair(tokenizer, r, cfg.max_length) for r in eval_records]
        steps = total_steps(len(train), cfg.epochs, cfg.batch_size)
        trainer = start_training(ctx, f"reward-{rm.name}", model, precision, cfg, steps, model_cfg.dtype)
        engine, log = trainer.engine, trainer.log
        with ctx.profiler.phase("eval"):
            initial = evaluate_pairs(engine.module, held_out, pad_id, cfg.micro_batch_size, precision)
        log({"eval/accuracy": initial["eval/accuracy"], "eval/loss": initial["eval/loss"]}, step=0)
        started = time.perf_counter()
        with progress_bar(f"reward-{rm.name}", steps) as advance:
            batches = batch_indices(len(train), cfg.batch_size, steps, rm.seed)
            for step, indices in enumerate(batches, start=1):
                step_loss, step_correct = 0.0, 0
                share = local_share(indices)  # every rank draws the same global batch and trains on its share
                with ctx.profiler.phase("train"):
                    for part in split_micro(share, cfg.micro_batch_size):
                        both = score(engine, [train[i][0] for i in part] + [train[i][1] for i in part],
                                     pad_id, precision)
                        chosen, rejected = both[: len(part)], both[len(part):]
                        loss = bradley_terry_loss(chosen, rejected)
                        trainer.backward(loss, len(indices))  # the mean over the global step's pairs
                        step_loss += float(loss.detach())
                        step_correct += int((chosen > rejected).sum())
                ctx.profiler.count(tokens=sum(len(train[i][0]) + len(train[i][1]) for i in share),
                                   samples=len(share))
                step_loss, step_correct = sum_over_ranks(step_loss, step_correct)
                train_loss = step_loss / len(indices)
                trainer.check_finite(train_loss, step, "lower reward.lr")
                step_metrics = {"train/loss": train_loss, "train/accuracy": step_correct / len(indices),
                                "train/lr": trainer.lr()}
                if step % cfg.eval_every == 0 or step == steps:
                    with ctx.profiler.phase("eval"):
                        step_metrics.update(evaluate_pairs(engine.module, held_out, pad_id,
                                                           cfg.micro_batch_size, precision))
                log(step_metrics, step=step)
                advance(f"loss {train_loss:.3f}")
        with ctx.profiler.phase("eval"):
            final = evaluate_pairs(engine.module, held_out, pad_id, cfg.micro_batch_size, precision)
        metrics = {**final, "eval/accuracy_initial": initial["eval/accuracy"], "train/steps": float(steps),
                   **trainer.perf_metrics(), "timing/train_s": time.perf_counter() - started}
        log({"timing/train_s": metrics["timing/train_s"]}, step=steps)
        with ctx.output_dir() as out:
            trainer.save(out, tokenizer, {
                "stage": "reward", "name": rm.name,
                "lora": cfg.lora.model_dump() if cfg.lora.enabled else None, "weight": rm.weight,
                "steps": steps, "pairs": len(train), "score_mean": final["eval/score_mean"],
                "score_std": final["eval/score_std"], "metrics": metrics, "inputs": spec.inputs})
            if not is_main():
                return ctx.rank_result(metrics)
            manifest = ctx.publish_output(out, summary={"metrics": metrics, "key_metric": "eval/accuracy",
                                                        "name": rm.name})
        return ctx.result(manifest, metrics, "eval/accuracy",
                          message=f"{rm.name}: held-out pairwise accuracy {final['eval/accuracy']:.3f}")


def main(argv: list[str] | None = None) -> int:
    return stage_main("reward", run, argv)


if __name__ == "__main__":
    run_program(main)
