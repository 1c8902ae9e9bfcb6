"""The DPO stage: direct preference optimisation of the SFT policy, with no reward model or generation engine.

Inputs: `sft` (the policy to start from, which is also the frozen reference) and `data` (the
preference pairs). The reference log-probs of every pair are computed once, before the first
update, by the policy itself (at step 0 it is the reference, and LoRA adapters start at zero):
no second model is loaded and no reference forward runs during training. Losses by name
(`dpo.loss`: sigmoid, ipo, cdpo) from stages/dpo/losses.py. Output, in the RL stage's
layout so the evaluate stage and the registry read either: `policy/` (a merged HF checkpoint, its
tokenizer, and `adapter/` with LoRA), `metrics.jsonl` (one row per optimizer step) and
`alignflow_run.json`.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from alignflow.config import DPOConfig, ModelConfig
from alignflow.contract import StageResult, StageSpec
from alignflow.stages.common.models.loading import load_causal_lm, load_tokenizer
from alignflow.stages.common.ranks import is_main, local_share, sum_over_ranks
from alignflow.stages.common.runtime import (
    StageContext,
    StageInputError,
    run_program,
    section,
    stage_main,
    tracked,
)
from alignflow.stages.common.tokenization import encode_completion, encode_prompt, pad_token_id
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
from alignflow.stages.common.training.response_logprobs import response_logprobs
from alignflow.stages.common.training.supervised_stage import log_datasets, start_training
from alignflow.stages.data.formats import load_preferences, render_prompt
from alignflow.stages.dpo.losses import LENGTH_NORMALISED, preference_loss


@dataclass(frozen=True)
class EncodedPair:
    """One preference pair as token ids: the shared prompt and both responses (each cut to fit max_length)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


def encode_pairs(tokenizer, records, max_length: int) -> tuple[list[EncodedPair], dict[str, int]]:
    """Encoded pairs and what was dropped: pairs whose prompt leaves no room for a response ('no_room') and
    pairs whose chosen response equals the rejected one ('identical', no preference to learn)."""
    pairs, dropped = [], {"no_room": 0, "identical": 0}
    for record in records:
        prompt = encode_prompt(tokenizer, render_prompt(record.prompt, tokenizer))
        room = max_length - len(prompt)
        chosen = encode_completion(tokenizer, record.chosen)[:room]
        rejected = encode_completion(tokenizer, record.rejected)[:room]
        if room <= 0:
            dropped["no_room"] += 1
        elif chosen == rejected:
            dropped["identical"] += 1
        else:
            pairs.append(EncodedPair(prompt, chosen, rejected))
    return pairs, dropped


def sequence_logprobs(model, pairs: list[EncodedPair], pad_id: int, mean: bool,
                      precision: Precision | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] chosen, [N] rejected) float32 log pi(response | prompt) of the pairs: summed over response tokens,
    or their per-token mean when `mean`. One forward over the 2N sequences (`response_logprobs`)."""
    both = response_logprobs(model, [p.prompt for p in pairs] * 2,
                             [p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id, mean, precision)
    return both[: len(pairs)], both[len(pairs):]


def chosen_nll(chosen_logprobs: torch.Tensor, pairs: list[EncodedPair], mean: bool) -> torch.Tensor:
    """[N] per-token mean NLL of the chosen responses, from their log-probs (sums, or already means)."""
    if mean:
        return -chosen_logprobs
    return -chosen_logprobs / torch.tensor([len(p.chosen) for p in pairs], dtype=chosen_logprobs.dtype,
                                           device=chosen_logprobs.device)


@torch.no_grad()
def reference_logprobs(model, pairs: list[EncodedPair], pad_id: int, mean: bool, batch_size: int,
                       precision: Precision | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] chosen and rejected log-probs of every pair under `model` in eval mode (no dropout), in batches."""
    was_training = model.training
    model.eval()
    parts = [sequence_logprobs(model, pairs[i:i + batch_size], pad_id, mean, precision)
             for i in range(0, len(pairs), batch_size)]
    model.train(was_training)
    return torch.cat([c for c, _ in parts]).float(), torch.cat([r for _, r in parts]).float()


@torch.no_grad()
def evaluate_pairs(model, pairs: list[EncodedPair], reference: tuple[torch.Tensor, torch.Tensor],
                   cfg: DPOConfig, pad_id: int, precision: Precision | None = None) -> dict[str, float]:
    """Held-out DPO loss and implicit-reward metrics (eval/loss and
    eval/rewards_{chosen,rejected,margin,accuracy})."""
    mean = cfg.loss in LENGTH_NORMALISED
    chosen, rejected = reference_logprobs(model, pairs, pad_id, mean, cfg.micro_batch_size, precision)
    out = preference_loss(cfg.loss, chosen, rejected, *reference, cfg.beta, cfg.label_smoothing,
                          chosen_nll=chosen_nll(chosen, pairs, mean), nll_coef=cfg.nll_coef)
    return {"eval/loss": float(out.losses.mean()),
            **{k.replace("rewards/", "eval/rewards_"): v for k, v in out.metrics().items()}}


def load_pairs(data_dir: Path, tokenizer, cfg: DPOConfig
               ) -> tuple[list[EncodedPair], list[EncodedPair], dict[str, int]]:
    """(training pairs, held-out pairs, what was dropped from training) of the data input; the held-out pairs
    are optional. No usable training pair is a StageInputError that says why."""
    train_file, eval_file = data_dir / "preferences_train.jsonl", data_dir / "preferences_eval.jsonl"
    if not train_file.is_file():
        raise StageInputError(f"dpo: the data input has no preferences_train.jsonl ({data_dir}); DPO trains "
                              "on preference pairs {prompt, chosen, rejected}: set data.preferences")
    train, dropped = encode_pairs(tokenizer, load_preferences(train_file), cfg.max_length)
    held_out, _ = (encode_pairs(tokenizer, load_preferences(eval_file), cfg.max_length) if eval_file.is_file()
                   else ([], {}))
    if not train:
        raise StageInputError(f"dpo: no usable preference pair in {train_file.name} ({dropped['no_room']} "
                              f"with no room for a response at dpo.max_length={cfg.max_length}, "
                              f"{dropped['identical']} with chosen == rejected): DPO needs preference pairs")
    if dropped["identical"] or dropped["no_room"]:
        print(f"dpo: skipped {dropped['identical']} pairs with chosen == rejected and {dropped['no_room']} "
              f"whose prompt fills dpo.max_length={cfg.max_length}", file=sys.stderr, flush=True)
    return train, held_out, dropped


def run(spec: StageSpec) -> StageResult:
    cfg: DPOConfig = section(spec, DPOConfig, "dpo")
    model_cfg: ModelConfig = section(spec, ModelConfig, "model")
    check_training_section(cfg, "dpo")
    torch.manual_seed(cfg.seed)
    ctx = StageContext(spec)
    with tracked(ctx):
        sft_dir, data_dir = ctx.input("sft"), ctx.input("data")
        tokenizer = load_tokenizer(sft_dir)
        pad_id = pad_token_id(tokenizer)
        train, held_out, dropped = load_pairs(data_dir, tokenizer, cfg)
        log_datasets(ctx, {name: count for name, count in (("preferences_train", len(train)),
                                                            ("preferences_eval", len(held_out))) if count})
        model, precision = place_for_training(
            ctx, apply_lora(load_causal_lm(sft_dir, dtype=model_cfg.dtype), cfg.lora, "dpo.lora"),
            cfg.autocast, model_cfg.dtype, "dpo")
        mean, batch = cfg.loss in LENGTH_NORMALISED, cfg.micro_batch_size
        with ctx.profiler.phase("reference"):
            # The policy before its first update is the reference (LoRA's B matrices start at zero).
            ref_train = reference_logprobs(model, train, pad_id, mean, batch, precision)
            ref_eval = (reference_logprobs(model, held_out, pad_id, mean, batch, precision) if held_out
                        else None)
        steps = total_steps(len(train), cfg.epochs, cfg.batch_size)
        trainer = start_training(ctx, "dpo", model, precision, cfg, steps, model_cfg.dtype)
        engine, log = trainer.engine, trainer.log
        print(f"dpo: {cfg.loss} loss, beta {cfg.beta:g}, {len(train)} pairs, {steps} steps; trains "
              f"{trainer.trainable:,} of {trainer.total:,} parameters"
              + (f" (LoRA rank {cfg.lora.rank})" if cfg.lora.enabled else ""), file=sys.stderr, flush=True)
        def evaluate() -> dict[str, float]:
            return evaluate_pairs(engine.module, held_out, ref_eval, cfg, pad_id, precision)

        initial = evaluate() if held_out else {}
        log({"eval/loss": initial["eval/loss"]} if initial else {}, step=0)
        history: list[dict[str, float]] = []
        started = time.perf_counter()
        with progress_bar("dpo", steps) as advance:
            for step, indices in enumerate(batch_indices(len(train), cfg.batch_size, steps, cfg.seed), 1):
                step_losses, chosen_rewards, rejected_rewards = [], [], []
                share = local_share(indices)  # every rank draws the same global batch and trains on its share
                with ctx.profiler.phase("train"):
                    for part in split_micro(share, cfg.micro_batch_size):
                        pairs = [train[i] for i in part]
                        chosen, rejected = sequence_logprobs(engine, pairs, pad_id, mean, precision)
                        rows = torch.tensor(part)
                        out = preference_loss(cfg.loss, chosen.float(), rejected.float(), ref_train[0][rows],
                                              ref_train[1][rows], cfg.beta, cfg.label_smoothing,
                                              chosen_nll=chosen_nll(chosen.float(), pairs, mean),
                                              nll_coef=cfg.nll_coef)
                        trainer.backward(out.losses.sum(), len(indices))  # the mean over the step's pairs
                        step_losses.append(out.losses.detach())
                        chosen_rewards.append(out.chosen_rewards)
                        rejected_rewards.append(out.rejected_rewards)
                ctx.profiler.count(tokens=sum(2 * len(train[i].prompt) + len(train[i].chosen)
                                              + len(train[i].rejected) for i in share), samples=len(share))
                losses, chosen_r, rejected_r = (torch.cat(x)
                                                for x in (step_losses, chosen_rewards, rejected_rewards))
                # Means over the global batch: sums over this rank's share, summed over ranks.
                loss_sum, chosen_sum, rejected_sum, correct = sum_over_ranks(
                    float(losses.sum()), float(chosen_r.sum()), float(rejected_r.sum()),
                    float((chosen_r > rejected_r).sum()))
                n = len(indices)
                train_loss = loss_sum / n
                trainer.check_finite(train_loss, step, "lower dpo.lr or raise dpo.beta")
                metrics = {"step": step, "train/loss": train_loss, "train/lr": trainer.lr(),
                           "rewards/chosen": chosen_sum / n, "rewards/rejected": rejected_sum / n,
                           "rewards/margin": (chosen_sum - rejected_sum) / n, "rewards/accuracy": correct / n}
                if held_out and (step % cfg.eval_every == 0 or step == steps):
                    with ctx.profiler.phase("eval"):
                        metrics.update(evaluate())
                history.append(metrics)
                log({k: v for k, v in metrics.items() if k != "step"}, step=step)
                advance(f"loss {train_loss:.3f} margin {metrics['rewards/margin']:+.3f}")
        final = history[-1]
        result_metrics = {k: v for k, v in final.items() if k != "step"}
        result_metrics.update({"train/steps": float(steps), "timing/train_s": time.perf_counter() - started,
                               **trainer.perf_metrics()})
        if initial:
            result_metrics["eval/loss_initial"] = initial["eval/loss"]
        with ctx.output_dir() as out:
            trainer.save(out / "policy", tokenizer, {
                "stage": "dpo", "loss": cfg.loss, "beta": cfg.beta, "steps": steps, "pairs": len(train),
                "dropped_pairs": dropped, "lora": cfg.lora.model_dump() if cfg.lora.enabled else None,
                "metrics": result_metrics, "inputs": spec.inputs, "input_digests": spec.input_digests,
            }, files={
                out / "metrics.jsonl": "".join(json.dumps(m) + "\n" for m in history),
                out / "alignflow_run.json": {"algorithm": "dpo", "loss": cfg.loss, "beta": cfg.beta,
                                             "steps": steps, "final": final},
            })
            if not is_main():
                return ctx.rank_result(result_metrics)
            if ctx.tracker is not None:
                ctx.tracker.log_artifact(out / "metrics.jsonl", "reports")
            key = "eval/rewards_accuracy" if held_out else "rewards/accuracy"
            manifest = ctx.publish_output(out, summary={"metrics": result_metrics, "key_metric": key})
        accuracy = result_metrics.get("eval/rewards_accuracy", result_metrics["rewards/accuracy"])
        loss = result_metrics.get("eval/loss", train_loss)
        return ctx.result(manifest, result_metrics, key,
                          message=f"{cfg.loss} loss {loss:.3f}, implicit-reward accuracy {accuracy:.3f} "
                                  f"after {steps} steps")


def main(argv: list[str] | None = None) -> int:
    return stage_main("dpo", run, argv)


if __name__ == "__main__":
    run_program(main)
