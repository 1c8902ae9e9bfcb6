"""The RL stage: PPO or GRPO over a generation engine that is built once and refit every iteration.

Inputs: `engine` (the engine stage's output), `sft` (actor and frozen reference), `data` (prompts),
and `reward_<name>` (frozen reward models; the first also initialises the PPO critic). Output:
`policy/` (final actor, HF format), `critic/` (PPO), `rollouts/iter_NNNNN.parquet`,
`checkpoints/iter_NNNNN/` (resumable, each with its own manifest), `metrics.jsonl`, `profile.md`.

This file is the algorithm: set up (prompts, models and trainers, the engine; resume from the last
checkpoint), then per iteration generate -> score -> the experience's passes (reference and old log-probs,
values) -> advantages -> PPO epochs -> write rollouts -> refit the engine -> log and checkpoint, one profiler
phase each; then publish. Its parts are modules beside it: scoring.py (scores, KL, advantages),
experience_passes.py, training_loop.py (the PPO epochs), critic_schedule.py (where the critic runs),
checkpoints.py (checkpoints, resume, the final outputs), rollout_client.py, rollout_workers.py and
rollout_writer.py (generation and the rollout files), losses.py (the pure tensor functions).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alignflow.config import EngineConfig, ModelConfig, PPOConfig
from alignflow.contract import RUN_STARTED_AT_VAR, StageResult, StageSpec
from alignflow.stages.common.devices import device_of
from alignflow.stages.common.generation.interface import (
    EngineError,
    SamplingParams,
    UnsupportedArchitectureError,
    load_engine,
)
from alignflow.stages.common.models.loading import load_causal_lm, load_tokenizer
from alignflow.stages.common.profiler import Profiler
from alignflow.stages.common.ranks import from_main, is_main, world_size
from alignflow.stages.common.reward_scoring import load_reward_models
from alignflow.stages.common.runtime import (
    StageContext,
    StageInputError,
    run_program,
    seconds_since,
    section,
    stage_main,
    tracked,
)
from alignflow.stages.common.tokenization import encode_prompt, pad_token_id
from alignflow.stages.common.training.deepspeed_setup import stream_weights
from alignflow.stages.common.training.lora import (
    AdaptersDisabled,
    apply_lora,
    is_lora,
    merged_adapted_weights,
    parameter_counts,
    unwrap_lora,
)
from alignflow.stages.common.training.plain_trainer import initialize_trainer, resolve_train_backend
from alignflow.stages.common.training.precision import Precision, resolve_precision
from alignflow.stages.data.evaluators import Evaluator, load_evaluator
from alignflow.stages.data.formats import load_prompts, render_prompt
from alignflow.stages.ppo import losses as rl
from alignflow.stages.ppo.checkpoints import (
    RLState,
    latest_checkpoint,
    load_checkpoint,
    publish_last_good,
    save_checkpoint,
    start_resumed_run,
    working_dir,
    write_final,
)
from alignflow.stages.ppo.critic_schedule import (
    critic_folder,
    overlaps_critic,
    started_critic,
    values_from_first_forward,
)
from alignflow.stages.ppo.critic_worker import CriticWorker, load_critic_model
from alignflow.stages.ppo.experience import Experience, assemble
from alignflow.stages.ppo.experience_passes import (
    experience_passes,
    old_logprob_source,
    recompute_old_logprobs,
)
from alignflow.stages.ppo.iteration_flops import (
    IterationModels,
    IterationShape,
    iteration_metrics,
    spec_of,
    train_peak_tflops,
)
from alignflow.stages.ppo.nan_guard import NonFiniteError, check_finite
from alignflow.stages.ppo.reward_functions import dataset_columns, load_reward_function
from alignflow.stages.ppo.rollout_client import RanksRollouts, Rollout, RolloutClient, RolloutRequest
from alignflow.stages.ppo.rollout_nodes import RolloutNodeError, read_secret, serve_node
from alignflow.stages.ppo.rollout_workers import RolloutWorkers
from alignflow.stages.ppo.rollout_writer import RolloutWriter, rollout_rows
from alignflow.stages.ppo.scoring import (
    compute_scores,
    kl_and_advantages,
    needs_reference,
    shape_scores,
)
from alignflow.stages.ppo.trainer_settings import optim_settings, run_facts, training_attention_for
from alignflow.stages.ppo.training_loop import StaleOldLogprobs, train_on
from alignflow.storage import open_store


@dataclass
class Models:
    """What an iteration runs: the trained models, the frozen ones and the reward functions."""

    actor: Any                       # the actor's trainer (plain torch or DeepSpeed); .module is the model
    critic: Any                      # PPO: the critic's trainer or its own process (CriticWorker); GRPO: None
    reference: Any                   # the frozen reference; None when the KL plays no part (needs_reference)
    reward_models: list[Any]         # the frozen reward models, on rank 0 only (it scores for every rank)
    reward_fns: list[tuple[str, Callable]]  # (name, function): ppo.reward_functions
    precision: Precision             # the training forwards' dtype and autocast (ppo.autocast)
    # False where the engine samples from bf16-rounded weights (engine.cpu_linear_weights): its log-probs
    # are then not the actor's, and ppo.old_logprobs=auto does not take them
    engine_exact: bool = True
    # The architectures the model-FLOPs metrics count (iteration_flops), and one training device's peak
    counted: IterationModels | None = None
    train_peak_tflops: float | None = None


@dataclass
class Prompts:
    """The prompt data set the iterations draw from, and the task's own judge of their completions."""

    records: list[Any]               # data/prompts.jsonl, one record per prompt (with its dataset columns)
    texts: list[str]                 # each prompt rendered with the chat template
    ids: list[list[int]]             # each rendered prompt tokenized
    tokenizer: Any
    pad_id: int
    evaluator: Evaluator | None      # the task's held-out gold score, if any (stages/data/evaluators.py)


@dataclass
class Outputs:
    """Where an iteration's outputs go."""

    folder: Path                     # the working folder (checkpoints.working_dir): rollouts/, checkpoints/
    rollout_writer: RolloutWriter
    profiler: Profiler               # one phase per step of the iteration; timing/* metrics


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------

def run(spec: StageSpec) -> StageResult:
    cfg: PPOConfig = section(spec, PPOConfig, "ppo")
    model_cfg: ModelConfig = section(spec, ModelConfig, "model")
    engine_cfg: EngineConfig = section(spec, EngineConfig, "engine")
    reward_inputs = sorted(k for k in spec.inputs if k.startswith("reward_"))
    # The checks `alignflow validate` and `alignflow plan` make of this stage (alignflow/start_checks.py).
    from alignflow import start_checks

    problems = start_checks.rl_stage(cfg, engine_cfg, reward_inputs)
    if problems:
        raise StageInputError(problems[0].message)
    reward_fns = [(path, load_reward_function(path)) for path in cfg.reward_functions]
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    ctx = StageContext(spec)
    device = ctx.compute_device()  # model.device: every model this stage trains or runs lives there
    out = working_dir(ctx)
    state = RLState(cfg)
    resume = latest_checkpoint(spec)
    # The critic's own process (ppo.critic_process) starts first, so that its interpreter, imports and model
    # load run beside this process's setup, loads and first rollout. Closed on every exit.
    with started_critic(ctx, cfg, model_cfg, engine_cfg, device) as remote_critic, tracked(ctx):
        return _train(ctx, cfg, model_cfg, engine_cfg, reward_fns, out, state, resume, device, remote_critic)


def _train(ctx: StageContext, cfg: PPOConfig, model_cfg: ModelConfig, engine_cfg: EngineConfig,
           reward_fns: list[tuple[str, Callable]], out: Path, state: RLState, resume: tuple[int, str] | None,
           device: torch.device, remote_critic: CriticWorker | None) -> StageResult:
    """Set up, resume, the iterations, publish."""
    spec, profiler = ctx.spec, ctx.profiler
    with profiler.phase("setup"):
        prompts = _load_prompts(ctx)
    models, trainable, total = _build_models(ctx, cfg, model_cfg, engine_cfg, reward_fns, device,
                                             remote_critic)
    with profiler.phase("engine_load"):
        # Built once by the engine stage; refit from here on. In this process, or in rollout worker processes.
        if world_size() > 1:  # rank 0 generates (and scores) for every trainer rank
            rollouts = RanksRollouts(open_rollouts(ctx, cfg, engine_cfg, device) if is_main() else None,
                                     is_main(), from_main)
        else:
            rollouts = open_rollouts(ctx, cfg, engine_cfg, device)
    with closing(rollouts):  # every exit path closes it: no rollout worker process outlives the stage
        if resume is not None:
            load_checkpoint(ctx, resume[1], state, models.actor, models.critic)
            with profiler.phase("refit"):
                rollouts.refit(*refit_stream(models.actor))
        rollouts.weights_version = state.iteration
        if ctx.tracker is not None:
            if resume is not None:
                start_resumed_run(ctx, state)
            state.mlflow_run_id = ctx.tracker.run_id
        last_checkpoint = resume[1] if resume else None
        rollout_writer = RolloutWriter(open_store(spec.output_uri, spec.storage), spec.output_uri)
        outputs = Outputs(out, rollout_writer, profiler)
        in_flight = None
        startup = startup_metrics(ctx)
        if is_main():
            times = ", ".join(f"{k.removeprefix('startup/')} {v:.2f} s" for k, v in startup.items())
            print(f"{cfg.algorithm}: start-up {times}", file=sys.stderr, flush=True)
        try:
            # Every file written before a checkpoint, the publish or an error's exit.
            with closing(outputs.rollout_writer):
                while state.iteration < cfg.iterations:
                    iteration = state.iteration + 1
                    started = time.perf_counter()
                    with profiler.phase("generate"):
                        if in_flight is None:
                            in_flight = rollouts.submit(rollout_request(cfg, iteration, prompts.ids))
                        rollout = rollouts.result(in_flight)
                    in_flight = None
                    if cfg.async_rollouts and iteration < cfg.iterations:
                        in_flight = rollouts.submit(rollout_request(cfg, iteration + 1, prompts.ids))
                    metrics = _iteration(iteration, cfg, state, rollout, rollouts, models, prompts, outputs,
                                         started)
                    state.iteration = iteration
                    state.history.append(metrics)
                    _log_iteration(ctx, cfg, iteration, metrics)
                    if iteration % cfg.checkpoint_every == 0 or iteration == cfg.iterations:
                        with profiler.phase("checkpoint"):
                            # The checkpoint's iterations have their rollouts on disk.
                            outputs.rollout_writer.wait()
                            last_checkpoint = save_checkpoint(ctx, out, state, models.actor, models.critic)
        except NonFiniteError as exc:
            where = publish_last_good(ctx, out, state, models.actor, models.critic, last_checkpoint, exc)
            raise NonFiniteError(f"{exc}; stopped. Last good checkpoint: {where}") from None
        return _publish(ctx, cfg, state, models, prompts.tokenizer, out, startup, trainable, total)


def _iteration(iteration: int, cfg: PPOConfig, state: RLState, rollout: Rollout,
               rollouts: RolloutClient | RolloutWorkers | RanksRollouts, models: Models, prompts: Prompts,
               outputs: Outputs, started: float) -> dict[str, float]:
    """One RL iteration on a finished rollout (`started`: when the loop asked for it); returns its metrics
    (namespaced) with 'iteration'."""
    profiler = outputs.profiler
    generation, rows = rollout.generation, rollout.request.prompt_indices
    # Generated by an older policy than the one about to train (async rollouts): the engine's log-probs are
    # the behaviour policy's, and the PPO ratio is taken against them.
    off_policy = rollout.weights_version < state.iteration
    memory: dict[str, float] = {}
    # The engine's KV cache, and on a GPU its weights, freed while the trainer trains.
    if rollouts.unload_during_training:
        with profiler.phase("unload"):
            memory = rollouts.unload()
    profiler.count(tokens=sum(generation.lengths), samples=len(rows))
    completions = [prompts.tokenizer.decode(ids, skip_special_tokens=True)
                   for ids in generation.response_token_ids]
    texts = [prompts.texts[i] for i in rows]
    exp = _experience_of(rollout, prompts.pad_id, device_of(models.actor))
    mask = exp.response_mask
    # Off-policy (async): the old log-probs are the proximal policy's (the actor now, before this update),
    # and the engine's, the behaviour policy's, weight each token (the decoupled objective).
    values_first = not off_policy and values_from_first_forward(models.actor, models.critic, cfg, len(rows))
    source = ("recompute" if off_policy
              else old_logprob_source(cfg, models.precision, state, len(rows), values_first,
                                      models.engine_exact))
    with_reference = needs_reference(cfg)
    # The old log-probs from the first training forward: the KL to the reference (which reads them) waits for
    # it, computed in train_on beside the values (values_first) or after training.
    kl_later = with_reference and source == "first_forward"

    def score() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor | None]:
        """(raw score, its components, the gold score): rank 0 scores (the others hold no reward model) and
        sends the scores to every rank."""
        scored = None
        if is_main():
            responses = generation.response_token_ids
            sequences = [p + r for p, r in zip(rollout.request.prompt_ids, responses, strict=True)]
            columns = dataset_columns(prompts.records, rows) if models.reward_fns else None
            with models.precision.forward():  # the reward models' forwards as the actor's: ppo.autocast
                raw, components = compute_scores(models.reward_models, models.reward_fns, texts, completions,
                                                 sequences, responses, list(generation.finish_reasons),
                                                 prompts.pad_id, cfg, columns)
            gold = (torch.tensor([prompts.evaluator(t, c) for t, c in zip(texts, completions, strict=True)])
                    if prompts.evaluator is not None else None)
            scored = (raw, components, gold)
        return from_main(scored)

    # score, reference, old_logprobs, values: one phase each.
    raw, components, gold = experience_passes(exp, cfg, models.actor, models.critic, models.reference,
                                              models.precision, source, profiler, score,
                                              with_values=not values_first)
    check_finite("the reward", raw, iteration)
    finished = torch.tensor([r == "eos" for r in generation.finish_reasons])
    exp.scores = shape_scores(raw, finished, state, cfg).to(mask.device)
    if off_policy:
        exp.behaviour_weights = rl.behaviour_weights(exp.old_logprobs, exp.rollout_logprobs, mask,
                                                     cfg.async_weight_cap)
    kl_coef = state.kl_controller.value
    with profiler.phase("advantages"):
        kl_and_advantages(exp, cfg, kl_coef, with_reference and not kl_later, iteration,
                          values_known=not values_first)
    # What the passes ran, for the FLOP counts: score (reward models), reference, old_logprobs, values.
    ran = {"generate", "train", *(["score"] if models.reward_models else []),
           *(["reference"] if with_reference else []), *(["old_logprobs"] if source == "recompute" else []),
           *(["values"] if models.critic is not None and not values_first else [])}
    source_before = source
    with profiler.phase("train"):
        loss_metrics, source = _update_models(iteration, cfg, state, exp, models, kl_coef, source,
                                              values_first, kl_later)
    if kl_later and not values_first:  # the advantages did not need it: the KL alone, from the first forward
        kl_and_advantages(exp, cfg, kl_coef, True, iteration, values_known=False)
    # After training: the values (and so the advantages) may come from the critic's first training forward,
    # and the stale-log-prob fallback recomputes the KL.
    seq_kl = rl.sequence_kl(exp.kl, mask)
    # Rank 0 writes the file, in line or on the writer's thread (RolloutWriter: where a core is free for it).
    with profiler.phase("io"):
        if is_main():
            outputs.rollout_writer.submit(
                rollout_rows(rollout, prompts.records, texts, completions, exp, components, seq_kl,
                             with_reference),
                outputs.folder / "rollouts" / f"iter_{iteration:05d}.parquet")
    with profiler.phase("generate"):
        rollouts.wait_idle()  # async: the next iteration's rollout, still generating on the old weights
    if rollouts.unload_during_training:
        with profiler.phase("reload"):
            memory |= rollouts.reload()
    with profiler.phase("refit"):
        refit = rollouts.refit(*refit_stream(models.actor))
    state.kl_controller.update(float(seq_kl.mean()), n_steps=len(rows))

    lengths = mask.sum(-1)
    metrics: dict[str, float] = {
        "iteration": float(iteration),
        "rollout/score_mean": float(raw.mean()),
        "rollout/reward_total_mean": float(exp.scores.mean()),
        "rollout/response_length_mean": float(lengths.mean()),
        "rollout/eos_fraction": float(finished.float().mean()),
        "rollout/old_logprobs_recomputed": float(source != "engine"),
        "kl/coef": float(kl_coef),
        "kl/coef_next": float(state.kl_controller.value),
        "refit/bytes": float(refit.bytes),
        # The trainer's wall time of the refit (stream, send, every ack).
        "refit/seconds": float(refit.seconds),
        # Rollout workers: bytes the trainer broadcast (R x refit/bytes) and how evenly the queue spread the
        # work.
        **({"refit/bytes_sent": float(refit.bytes_sent)} if hasattr(refit, "bytes_sent") else {}),
        **{k: v for k, v in generation.metrics.items() if k.startswith("perf/rollout_")},
        **memory,
        "rollout/policy_lag": float(state.iteration - rollout.weights_version),
        "timing/generate_engine": rollout.seconds,
        **{f"rollout/reward_{name}_mean": float(v.mean()) for name, v in components.items()},
        **{k if "/" in k else f"losses/{k}": v for k, v in loss_metrics.items()},
        **profiler.iteration_metrics(),
        "timing/iteration": time.perf_counter() - started,
    }
    if models.counted is not None:
        metrics |= iteration_metrics(
            models.counted, IterationShape.of(rows, rollout.request.prompt_ids, list(generation.lengths)),
            cfg.ppo_epochs, ran, metrics, metrics["timing/iteration"], models.train_peak_tflops, world_size(),
            trained_twice=source != source_before)
    if with_reference:
        metrics["kl/mean"] = float(seq_kl.mean())
    if source == "recompute" and "rollout/logprob_engine_vs_actor_max" not in metrics:
        difference = (exp.rollout_logprobs - exp.old_logprobs).abs() * mask
        metrics["rollout/logprob_engine_vs_actor_max"] = float(difference.max())
    if exp.values is not None:
        metrics["losses/explained_variance"] = float(rl.explained_variance(exp.values, exp.returns, mask))
    if gold is not None:
        metrics["rollout/gold_score_mean"] = float(gold.mean())
    return metrics


def _update_models(iteration: int, cfg: PPOConfig, state: RLState, exp: Experience, models: Models,
                   kl_coef: float, source: str, values_first: bool, kl_later: bool = False
                   ) -> tuple[dict[str, float], str]:
    """The PPO epochs (train_on) on exp; returns their metrics and where the old log-probs came from in the
    end.

    Under ppo.old_logprobs: auto the engine's old log-probs (source 'engine', on-policy only) are checked
    against the first minibatch's forward before any step; stale, they are recomputed, the KL and advantages
    with them, and the epochs run again from the same weights (and every later iteration recomputes).
    values_first: the critic's first training forward gives the values (values_from_first_forward); kl_later:
    the KL to the reference is computed then too, from the old log-probs of the actor's first forward."""
    actor, critic, precision = models.actor, models.critic, models.precision
    actor.train()
    if critic is not None and not isinstance(critic, CriticWorker):  # the process: with each train request
        critic.train()
    check = cfg.old_logprobs_tolerance if source == "engine" and cfg.old_logprobs == "auto" else None
    try:
        return train_on(
            exp, actor, critic, cfg, kl_coef, iteration, precision, check,
            old_from_first_forward=source == "first_forward",
            advantages_after_values=(lambda e: kl_and_advantages(e, cfg, kl_coef, kl_later, iteration))
            if values_first else None), source
    except StaleOldLogprobs as stale:
        # No optimizer step ran: recompute at the same weights and train again; later iterations recompute.
        print(f"{cfg.algorithm}: iteration {iteration}: {stale} (more than ppo.old_logprobs_tolerance = "
              f"{cfg.old_logprobs_tolerance:g}); recomputing old log-probs with the actor from now on",
              file=sys.stderr, flush=True)
        state.old_logprobs_fallback = True
        exp.old_logprobs = recompute_old_logprobs(exp, cfg, actor, precision)
        kl_and_advantages(exp, cfg, kl_coef, needs_reference(cfg), iteration)
        loss_metrics = train_on(exp, actor, critic, cfg, kl_coef, iteration, precision)
        loss_metrics["rollout/logprob_engine_vs_actor_max"] = stale.measured
        return loss_metrics, "recompute"


def _log_iteration(ctx: StageContext, cfg: PPOConfig, iteration: int, metrics: dict[str, float]) -> None:
    """The iteration's line on stderr (rank 0) and its metrics to MLflow, queued for the tracker's background
    sender so that the loop never waits on the server."""
    gold = (f" gold {metrics['rollout/gold_score_mean']:+.3f}" if "rollout/gold_score_mean" in metrics
            else "")
    kl = f" kl {metrics['kl/mean']:.3f}" if "kl/mean" in metrics else ""
    if is_main():
        print(f"{cfg.algorithm}: iteration {iteration}/{cfg.iterations} score "
              f"{metrics['rollout/score_mean']:+.3f}{gold}{kl} len "
              f"{metrics['rollout/response_length_mean']:.1f} ({metrics['timing/iteration']:.1f} s)",
              file=sys.stderr, flush=True)
    if ctx.tracker is not None:
        ctx.tracker.log_metrics_async({k: v for k, v in metrics.items() if k != "iteration"}, iteration)


def _publish(ctx: StageContext, cfg: PPOConfig, state: RLState, models: Models, tokenizer, out: Path,
             startup: dict[str, float], trainable: int, total: int) -> StageResult:
    """The final policy (and critic), metrics.jsonl and the stage's manifest; the StageResult."""
    profiler = ctx.profiler
    with profiler.phase("publish"):
        write_final(out, state, models.actor, models.critic, tokenizer, cfg, profiler.facts)
        summary = profiler.summary()
        if not is_main():
            return ctx.rank_result({"iterations": float(state.iteration)})
        final = state.history[-1]
        metrics = {"rollout/reward_total_mean": final["rollout/reward_total_mean"],
                   "iterations": float(state.iteration),
                   **{k: v for k, v in summary.items() if k.startswith("perf/")},
                   "perf/trainable_parameters": float(trainable), "perf/trainable_share": trainable / total,
                   **startup}
        if "kl/mean" in final:
            metrics["kl/mean"] = final["kl/mean"]
        if "rollout/gold_score_mean" in final:
            metrics["rollout/gold_score_mean"] = final["rollout/gold_score_mean"]
        if ctx.tracker is not None:
            ctx.tracker.log_artifact(out / "metrics.jsonl", "reports")
        manifest = ctx.publish_output(out, summary={"metrics": metrics,
                                                    "key_metric": "rollout/reward_total_mean"})
    bottleneck = "; ".join(profiler.bottlenecks()[:1])
    return ctx.result(manifest, metrics, "rollout/reward_total_mean",
                      message=f"{cfg.algorithm}: {state.iteration} iterations; {bottleneck}")


def rollout_request(cfg: PPOConfig, iteration: int, prompt_ids: list[list[int]]) -> RolloutRequest:
    """The prompts and sampling of `iteration`: a seeded draw, so a resumed run draws the same ones."""
    draw = random.Random(cfg.seed * 1_000_003 + iteration)
    chosen = draw.sample(range(len(prompt_ids)), min(cfg.prompts_per_iteration, len(prompt_ids)))
    rows = [i for i in chosen for _ in range(cfg.group_size)]  # group-contiguous for GRPO
    seeds = [(cfg.seed * 1_000_003 + iteration) * 4096 + k for k in range(len(rows))]
    sampling = SamplingParams(temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                              max_new_tokens=cfg.max_new_tokens, seeds=seeds)
    return RolloutRequest(iteration, rows, chosen, [prompt_ids[i] for i in rows], sampling)


def _experience_of(rollout: Rollout, pad_id: int, device: torch.device) -> Experience:
    """The rollout laid out for the forwards (experience.py) on the trained models' device: the engine's
    log-probs as the rollout's and, until recomputed, the old ones; the rest zero until the passes fill it."""
    generation = rollout.generation
    input_ids, attention_mask, position_ids, response_ids, mask, width_p = assemble(
        rollout.request.prompt_ids, generation.response_token_ids, pad_id)
    rollout_logprobs = generation.padded(pad_id)[1][:, : response_ids.shape[1]]
    return Experience(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      response_ids=response_ids, response_mask=mask, rollout_logprobs=rollout_logprobs * mask,
                      old_logprobs=rollout_logprobs * mask, ref_logprobs=torch.zeros_like(mask), values=None,
                      scores=torch.zeros(len(rollout.request.prompt_indices)),
                      token_rewards=torch.zeros_like(mask), kl=torch.zeros_like(mask),
                      advantages=torch.zeros_like(mask), returns=None, prompt_width=width_p).to(device)


# ----------------------------------------------------------------------------------------------
# Setup and plumbing
# ----------------------------------------------------------------------------------------------

def _load_prompts(ctx: StageContext) -> Prompts:
    """The data input's prompts, rendered and tokenized with the SFT model's tokenizer, and its evaluator."""
    sft_dir, data_dir = ctx.input("sft"), ctx.input("data")
    tokenizer = load_tokenizer(sft_dir)
    pad_id = pad_token_id(tokenizer)
    records = load_prompts(data_dir / "prompts.jsonl")
    evaluator = load_evaluator(data_dir, prompts=("prompts",))  # the held-out gold score, where there is one
    texts = [render_prompt(p.prompt, tokenizer) for p in records]
    ids = [encode_prompt(tokenizer, text) for text in texts]
    return Prompts(records, texts, ids, tokenizer, pad_id, evaluator)


def _build_models(ctx: StageContext, cfg: PPOConfig, model_cfg: ModelConfig, engine_cfg: EngineConfig,
                  reward_fns: list[tuple[str, Callable]], device: torch.device,
                  remote_critic: CriticWorker | None) -> tuple[Models, int, int]:
    """The models loaded (phase load_models) and the actor's and critic's trainers built around them (phase
    trainer_init); with the actor's trainable and total parameter counts."""
    spec, profiler = ctx.spec, ctx.profiler
    sft_dir = ctx.input("sft")
    with profiler.phase("load_models"):
        # Rank 0 scores every rollout and sends the scores with it: only it loads the reward models.
        reward_models = (load_reward_models(ctx, device=device)
                         if is_main() and any(k.startswith("reward_") for k in spec.inputs) else [])
        actor_model = apply_lora(load_causal_lm(sft_dir, dtype=model_cfg.dtype), cfg.lora, "ppo.lora")
        actor_model = actor_model.to(device)
        reference = None  # not even loaded when the KL plays no part (kl_coef 0)
        if needs_reference(cfg):
            # With LoRA the reference is the actor with its adapters off: the frozen base is the SFT model.
            reference = (AdaptersDisabled(actor_model) if cfg.lora.enabled
                         else load_causal_lm(sft_dir, dtype=model_cfg.dtype).to(device).eval()
                         .requires_grad_(False))
        trainable, total = parameter_counts(actor_model)
    with profiler.phase("trainer_init"):
        try:
            backend = resolve_train_backend(cfg.train_backend, cfg.zero_stage)
        except ValueError as exc:
            raise StageInputError(str(exc)) from None
        actor = initialize_trainer(actor_model, optim_settings(cfg, model_cfg, cfg.actor_lr), backend)
        attention = training_attention_for(cfg, engine_cfg)
        train_device = next(actor.module.parameters()).device
        precision = resolve_precision(cfg.autocast, model_cfg.dtype, train_device,
                                      getattr(actor.module.config, "hidden_size", None))
        profiler.facts = run_facts(cfg, model_cfg, engine_cfg, backend, precision, train_device, device)
        critic: Any = remote_critic  # in its own process (started_critic), or here
        if cfg.algorithm == "ppo" and critic is None:
            critic_dir = critic_folder(ctx)
            critic = initialize_trainer(load_critic_model(critic_dir, cfg, model_cfg.dtype).to(device),
                                        optim_settings(cfg, model_cfg, cfg.critic_lr), backend)
        local_critic = critic is not None and not isinstance(critic, CriticWorker)
        ctx.record_device("train", actor.module)
        if local_critic:
            ctx.record_device("critic", critic.module)
        elif critic is not None:
            ctx.record_device("critic", "cpu")  # the critic's process: only where the models are on the CPU
        if reference is not None:
            ctx.record_device("reference", actor.module if cfg.lora.enabled else reference)
        if reward_models:
            ctx.record_device("score", reward_models[0].model)
        for model in (None if cfg.lora.enabled else reference, unwrap_lora(actor.module),
                      unwrap_lora(critic.module) if local_critic else None,
                      *(rm.model for rm in reward_models)):
            if model is not None:
                model.set_attn_implementation(attention)
        if cfg.compile_train:
            # In place (nn.Module.compile): parameter names, checkpoints and refit streams keep their keys.
            # With LoRA: the HF backbone under peft's wrapper, its LoRA layers inside the graph; the reference
            # forward (adapters disabled) flips a flag dynamo guards on, so a second graph is compiled once
            # (tests/stages/ppo/test_ppo_lora.py checks loss, gradients and reference against eager).
            for trained in (actor, critic if local_critic else None):
                if trained is not None:
                    unwrap_lora(trained.module).base_model.compile(dynamic=True)
        overlapped = overlaps_critic(actor, critic, cfg) or isinstance(critic, CriticWorker)
        print(f"{cfg.algorithm}: {backend} trainer{f' on {world_size()} ranks' if world_size() > 1 else ''}, "
              f"{attention} attention, forwards in {precision.label} "
              f"({precision.reason}); reference forward "
              f"{'on' if needs_reference(cfg) else 'skipped (kl_coef 0)'}; "
              f"old log-probs: {cfg.old_logprobs}; trains {trainable:,} of {total:,} actor parameters"
              + ("; the critic in its own process (ppo.critic_process)" if isinstance(critic, CriticWorker)
                 else "; critic updates on their own thread (ppo.overlap_critic)" if overlapped else "")
              + (f" (LoRA rank {cfg.lora.rank}: the refit sends the adapted modules' merged weights only)"
                 if cfg.lora.enabled else ""), file=sys.stderr, flush=True)
        if ctx.tracker is not None:
            ctx.tracker.log_metrics({"perf/autocast_bf16": float(precision.autocast_dtype is not None),
                                     "perf/trainable_parameters": float(trainable),
                                     "perf/overlap_critic": float(overlapped),
                                     "perf/critic_process": float(isinstance(critic, CriticWorker)),
                                     "perf/trainable_share": trainable / total})
    models = Models(actor, critic, reference, reward_models, reward_fns, precision,
                    engine_exact=engine_cfg.cpu_linear_weights == "float32",
                    counted=_counted_models(ctx, actor, critic, reward_models),
                    train_peak_tflops=train_peak_tflops(
                        train_device, precision.autocast_dtype or next(actor.module.parameters()).dtype))
    return models, trainable, total


def _counted_models(ctx: StageContext, actor, critic, reward_models: list[Any]) -> IterationModels:
    """The architectures of the iteration's models for its FLOP counts; the critic's process holds its model,
    so its shape is read from its initial weights' config there."""
    if isinstance(critic, CriticWorker):
        from transformers import AutoConfig

        critic_config = AutoConfig.from_pretrained(critic_folder(ctx))
    else:
        critic_config = unwrap_lora(critic.module).config if critic is not None else None
    return IterationModels(spec_of(unwrap_lora(actor.module).config),
                           spec_of(critic_config) if critic_config is not None else None,
                           [spec_of(rm.model.config) for rm in reward_models], has_critic=critic is not None)


def open_rollouts(ctx: StageContext, cfg: PPOConfig, engine_cfg: EngineConfig, device: torch.device
                  ) -> RolloutClient | RolloutWorkers:
    """The engine stage's output behind the rollout client: in this process (engine.rollout_workers = 0), or
    as engine.rollout_workers replicas in their own processes fed by a work queue (each
    engine.tensor_parallel_size processes), on the trainer's device type (on a GPU each worker process takes
    its default one)."""
    if engine_cfg.rollout_workers >= 1:
        tp = engine_cfg.tensor_parallel_size
        if engine_cfg.refit_backend == "nccl" and device.type != "cuda":
            raise StageInputError(f"engine.refit_backend=nccl sends GPU memory, but the trainer runs on "
                                  f"{device.type}; set engine.refit_backend: gloo")
        try:
            secret = read_secret("the trainer") if engine_cfg.rollout_nodes else None
            workers = RolloutWorkers(ctx.input("engine"), engine_cfg.rollout_workers,
                                     chunk_size=engine_cfg.queue_chunk,
                                     threads=engine_cfg.rollout_worker_threads,
                                     timeout_s=engine_cfg.rollout_timeout_s,
                                     unload_during_training=engine_cfg.unload_during_training,
                                     device=None if device.type == "cuda" else str(device),
                                     tensor_parallel_size=tp, worker_python=engine_cfg.worker_python,
                                     rollout_nodes=engine_cfg.rollout_nodes,
                                     endpoint=engine_cfg.rollout_endpoint, secret=secret,
                                     refit_backend=engine_cfg.refit_backend)
        except (EngineError, UnsupportedArchitectureError, RolloutNodeError) as exc:
            raise StageInputError(str(exc)) from None
        layout = (f"{engine_cfg.rollout_workers} rollout replica(s) x {tp} tensor-parallel ranks: "
                  if tp > 1 else "")
        ctx.record_device("generate", "cuda" if device.type == "cuda" else device)
        pids = ", ".join(str(w.pid) for w in workers.workers)
        where = f" on {engine_cfg.rollout_nodes} rollout node(s)" if engine_cfg.rollout_nodes else ""
        threads = "/".join(str(t) for t in sorted({w.info["threads"] for w in workers.workers}))
        print(f"{cfg.algorithm}: {layout}{len(workers.workers)} rollout worker processes{where} "
              f"(pids {pids}; {threads} torch thread(s) each), chunks of {engine_cfg.queue_chunk} sequences",
              file=sys.stderr, flush=True)
        return workers
    # With ppo.async_rollouts the next iteration is generated while this one trains (one-step off-policy).
    engine = load_engine(ctx.input("engine"), device=str(device))
    ctx.record_device("generate", engine.execution_paths().get("device", str(device)))
    return RolloutClient(engine, overlap=cfg.async_rollouts,
                         unload_during_training=engine_cfg.unload_during_training)


def refit_stream(actor) -> tuple[Iterator[tuple[str, torch.Tensor]], bool]:
    """(the weights the engine needs after an update, whether they are a partial set).

    With LoRA only the adapted modules changed: their merged weights W + (alpha / r) * B @ A are all that is
    sent (the frozen rest is already in the engine); otherwise every parameter (ZeRO-3 gathered one at a
    time).
    """
    if is_lora(actor.module):
        return merged_adapted_weights(actor.module), True
    return stream_weights(actor), False


def startup_metrics(ctx: StageContext) -> dict[str, float]:
    """Where the time before the first iteration went, in seconds: 'startup/process' (interpreter start and
    imports, from the flow's launch), 'startup/stage' (spec, inputs, model loads, trainer init, engine load),
    'startup/to_first_iteration' (their sum) and, under `alignflow run`, 'startup/since_run' (from the
    command's start: the difference is orchestration, i.e. Prefect, planning and the earlier stages' cache
    checks)."""
    stage = time.perf_counter() - ctx.started
    out = {"startup/stage": stage}
    if ctx.process_start_s is not None:
        out["startup/process"] = ctx.process_start_s
        out["startup/to_first_iteration"] = ctx.process_start_s + stage
    since_run = seconds_since(RUN_STARTED_AT_VAR)
    if since_run is not None:
        out["startup/since_run"] = since_run
    return out

def serve_rollout_node(spec: StageSpec, node: int) -> int:
    """`--rollout-node I`: this node runs its share of the rollout replicas for the trainer's rank 0 at
    engine.rollout_endpoint, until rank 0 stops them (stages/ppo/rollout_nodes.py)."""
    engine_cfg: EngineConfig = section(spec, EngineConfig, "engine")
    if engine_cfg.rollout_nodes == 0:
        raise StageInputError(
            f"--rollout-node {node}: the spec's engine.rollout_nodes is 0, so the trainer runs its replicas "
            "itself; set engine.rollout_nodes (and engine.rollout_endpoint) to give them nodes of their own"
        )
    ctx = StageContext(spec)
    device = ctx.compute_device()
    try:
        return serve_node(str(ctx.input("engine")), node, engine_cfg,
                          None if device.type == "cuda" else str(device))
    except RolloutNodeError as exc:
        raise StageInputError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    return stage_main("ppo", run, argv, rollout_node=serve_rollout_node)


if __name__ == "__main__":
    run_program(main)
