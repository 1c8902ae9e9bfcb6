"""The evaluation stage: the final policy against the SFT policy on held-out prompts; numbers, words, plots.

Inputs: the policy, named after the stage that trained it (exactly one of the two, same layout:
policy/, metrics.jsonl, alignflow_run.json): `ppo` (the RL stage's output, one metrics row per
iteration) or `dpo` (the DPO stage's output, one row per optimizer step); `sft` (the SFT checkpoint:
the baseline and the KL reference); `data` (eval_prompts.jsonl, stats.json); and zero or more
`reward_<name>` (the reward models: those PPO was trained against; a DPO pipeline, or GRPO on reward
functions alone, may have none). Output: eval.json (every number), eval_report.md, samples.jsonl
(one row per prompt), plots/<name>.png (the training curves of `PLOTS` that metrics.jsonl has) and
profile.md. Everything is also logged to the stage's MLflow run.

What it measures, on the first `evaluate.n_prompts` held-out prompts:
  - reward-model score: the weighted sum of z-scored reward-model scores, the number PPO maximised
    (stages/common/reward_scoring.py), for a policy response and an SFT response to each prompt (only with
    reward models: without them the reward-model numbers are absent, and so is the reward-hacking
    check, which compares the reward-model score with the gold score);
  - gold score: the demo task's hidden scorer (only when the data is the demo task);
  - win rates of policy over SFT under each available score (ties count one half);
  - KL(policy || SFT) in nats per response (see `kl_to_reference`);
  - response length in tokens.
Both policies answer each prompt with the same per-prompt seed (common random numbers), so at
temperature > 0 the comparison is not noisier than it needs to be. What it is not: a benchmark of
external tasks; it checks what this pipeline optimised, and whether optimising it helped (gold).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from alignflow import start_checks
from alignflow.config import POLICY_STAGES, EngineConfig, EvaluateConfig, ModelConfig
from alignflow.contract import StageResult, StageSpec
from alignflow.stages.common.bottleneck_advice import RunFacts
from alignflow.stages.common.generation.interface import Generation, SamplingParams, build_engine
from alignflow.stages.common.generation.worker_python import call_in, resolve
from alignflow.stages.common.models.loading import load_causal_lm, load_tokenizer
from alignflow.stages.common.reward_scoring import (
    load_reward_models,
    reward_input_names,
    score_with_reward_models,
)
from alignflow.stages.common.runtime import (
    StageContext,
    StageInputError,
    dump_json,
    run_program,
    section,
    stage_main,
    tracked,
)
from alignflow.stages.common.tokenization import encode_prompt, pad_token_id
from alignflow.stages.common.training.response_logprobs import response_logprobs
from alignflow.stages.data.evaluators import load_evaluator
from alignflow.stages.data.formats import load_prompts, render_prompt

GENERATION_SEED = 0  # evaluation responses (both policies: the same seed per prompt)
KL_SEED = 1  # the temperature-1 samples of the KL estimate
KL_BATCH = 16  # sequences per forward pass of the KL estimate
CELL_CHARS = 160  # a response longer than this is cut in the report's sample table (samples.jsonl has it all)

# Curves drawn from the policy stage's metrics.jsonl: file name -> (title, y label, [(metric, legend)]). The
# first three are the RL stage's, the last three the DPO stage's; a plot is drawn when the history has at
# least one of its metrics (`plots_to_draw`).
PLOTS: dict[str, tuple[str, str, list[tuple[str, str]]]] = {
    "reward": ("Reward during training", "score", [
        ("rollout/score_mean", "reward-model score (z, weighted)"),
        ("rollout/reward_total_mean", "reward after shaping"),
        ("rollout/gold_score_mean", "gold score"),
    ]),
    "kl": ("KL to the reference during training", "nats per response",
           [("kl/mean", "KL(policy || reference)")]),
    "length": ("Response length during training", "tokens",
               [("rollout/response_length_mean", "mean length")]),
    "implicit_rewards": ("Implicit rewards during training", "beta x log-ratio to the reference", [
        ("rewards/chosen", "chosen (training batch)"),
        ("rewards/rejected", "rejected (training batch)"),
        ("rewards/margin", "margin (training batch)"),
        ("eval/rewards_margin", "margin (held-out pairs)"),
    ]),
    "accuracy": ("Implicit-reward accuracy during training", "share of pairs, chosen > rejected", [
        ("rewards/accuracy", "training batch"),
        ("eval/rewards_accuracy", "held-out pairs"),
    ]),
    "loss": ("Preference loss during training", "loss", [("train/loss", "training batch"),
                                                          ("eval/loss", "held-out pairs")]),
}


# ----------------------------------------------------------------------------------------------
# Measurements (pure functions)
# ----------------------------------------------------------------------------------------------

def win_rate(policy: Sequence[float], baseline: Sequence[float]) -> float:
    """Share of prompts where the policy's score beats the baseline's; an exact tie counts 1/2."""
    if len(policy) != len(baseline) or not policy:
        raise ValueError(f"win_rate needs two equally long, non-empty score lists; got {len(policy)} and "
                         f"{len(baseline)}")
    wins = sum(1.0 if p > b else 0.5 if p == b else 0.0 for p, b in zip(policy, baseline, strict=True))
    return wins / len(policy)


def paired_delta(policy: Sequence[float], baseline: Sequence[float]) -> tuple[float, float]:
    """(mean of policy - baseline, its standard error); the s.e. is 0 with fewer than two prompts."""
    diffs = [p - b for p, b in zip(policy, baseline, strict=True)]
    mean = sum(diffs) / len(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
    return mean, se


@torch.no_grad()
def response_logprob_sums(model: Any, prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
                          batch_size: int = KL_BATCH) -> torch.Tensor:
    """[N] float32 on the CPU: sum over response tokens of log p(token | prefix) under `model` (temperature
    1), `batch_size` sequences per forward (`response_logprobs` has the shapes)."""
    return torch.cat([response_logprobs(model, prompt_ids[i:i + batch_size], response_ids[i:i + batch_size],
                                        pad_id).cpu() for i in range(0, len(prompt_ids), batch_size)])


def kl_to_reference(policy: Any, reference: Any, prompt_ids: list[list[int]], response_ids: list[list[int]],
                    pad_id: int, batch_size: int = KL_BATCH) -> torch.Tensor:
    """[N] per-response k1 estimates of KL(policy || reference) in nats: sum_t log pi(y_t) - log ref(y_t).

    The responses must be sampled from `policy` at temperature 1. Then each value is an unbiased
    single-sample Monte-Carlo estimate of the sequence-level KL, and their mean estimates the expected
    KL per response over the prompts. Single values can be negative; the mean of many is not, in
    expectation. The PPO stage's `kl/mean` is the same quantity on training prompts when it runs with
    its defaults (k1 estimator, temperature 1), so the plotted curve and this number are comparable.
    """
    return (response_logprob_sums(policy, prompt_ids, response_ids, pad_id, batch_size)
            - response_logprob_sums(reference, prompt_ids, response_ids, pad_id, batch_size))


def policy_input(inputs: Mapping[str, str]) -> str:
    """The name of the spec's policy input: 'ppo' (an RL stage output) or 'dpo' (a DPO stage output).

    Exactly one: the evaluation compares one policy with the SFT policy.
    """
    problem = start_checks.policy_input(inputs)
    if problem is not None:
        raise StageInputError(problem.message)
    return next(name for name in POLICY_STAGES if name in inputs)


def history_x(row: Mapping[str, Any]) -> float | None:
    """A metrics row's position on the training axis: its RL 'iteration' or its DPO 'step' (None if
    neither)."""
    x = row.get("iteration", row.get("step"))
    return None if x is None else float(x)


def read_history(path: Path, input_name: str = "ppo") -> list[dict[str, float]]:
    """The policy stage's metrics (one JSON object per line: per RL iteration or per DPO step), in that
    order."""
    if not path.is_file():
        raise StageInputError(f"{path} not found: the '{input_name}' input must be a {input_name} stage "
                              "output with metrics.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: history_x(r) or 0)


def training_summary(input_name: str, run_info: Mapping[str, Any], history: list[dict[str, float]]
                     ) -> dict[str, Any]:
    """What trained the policy, from its alignflow_run.json (the history when absent): the RL stage's
    algorithm and iterations, or the DPO stage's algorithm, loss, beta and optimizer steps."""
    if input_name == "dpo":
        return {"algorithm": run_info.get("algorithm", "dpo"), "loss": run_info.get("loss"),
                "beta": run_info.get("beta"), "steps": run_info.get("steps", len(history))}
    return {"algorithm": run_info.get("algorithm"), "iterations": run_info.get("iterations", len(history))}


def early_late(history: list[dict[str, float]], key: str) -> tuple[float, float] | None:
    """Mean of `key` over the first and the last quarter of the iterations (at least one each), or None."""
    values = [float(r[key]) for r in history
              if key in r and r[key] is not None and math.isfinite(float(r[key]))]
    if len(values) < 2:
        return None
    k = max(1, len(values) // 4)
    return sum(values[:k]) / k, sum(values[-k:]) / k


# ----------------------------------------------------------------------------------------------
# Words
# ----------------------------------------------------------------------------------------------

def reward_hacking_sentence(rm_delta: float, gold_delta: float | None, gold_se: float | None = None,
                            where: str = "on held-out prompts", algorithm: str | None = None) -> str | None:
    """The reward-hacking warning when the reward-model score rose while the gold score fell, else None.

    The advice depends on what trained the policy: PPO/GRPO optimised the reward models, DPO never saw them.
    """
    if gold_delta is None or not (rm_delta > 0 and gold_delta < 0):
        return None
    noise = ""
    if gold_se:
        z = abs(gold_delta) / gold_se
        noise = (f" (the gold drop is {z:.1f} standard errors" + (", within noise" if z < 2 else "") + ")")
    if algorithm == "dpo":
        advice = ("DPO never saw the reward model, so the two disagree about this policy: the preference "
                  "data rewards something the gold scorer does not. Check the preference pairs, raise "
                  "dpo.beta (a stronger pull to the reference), or train fewer steps.")
    else:
        advice = ("The policy exploits the reward model's blind spots instead of getting better: raise "
                  "ppo.kl_coef (or lower ppo.target_kl), stop after fewer iterations, or train the reward "
                  "models on more or harder preference data (an ensemble is harder to exploit).")
    return (f"Reward hacking {where}: the reward-model score rose by {rm_delta:+.3f} while the gold score "
            f"fell by {gold_delta:+.3f}{noise}. {advice}")


def kl_budget_sentence(kl: float, budget: float, algorithm: str | None = None) -> str | None:
    if kl <= budget:
        return None
    advice = ("Its text may have drifted far from the SFT policy's; raise dpo.beta (a stronger pull to the "
              "reference) or train fewer steps (dpo.epochs)." if algorithm == "dpo" else
              "Its text may have drifted where the reward models were never trained; raise ppo.kl_coef or "
              "use adaptive KL (ppo.adaptive_kl) with a lower ppo.target_kl.")
    return (f"KL warning: the policy is {kl:.2f} nats per response from the SFT reference, above "
            f"evaluate.kl_budget = {budget:g}. {advice}")


def headline(result: dict[str, Any]) -> str:
    """The one-line summary of the StageResult message: each available score's delta and win rate, and the
    KL."""
    parts = []
    if result["rm_available"]:
        parts.append(f"RM {result['rm_delta']:+.3f} (win rate {result['win_rate_rm']:.0%})")
    if result["gold_available"]:
        parts.append(f"gold {result['gold_delta']:+.3f} (win rate {result['win_rate_gold']:.0%})")
    elif result["rm_available"]:
        parts.append("gold n/a")
    else:
        parts.append("no score (no reward model, no gold scorer)")
    return (f"policy vs SFT on {result['n_prompts']} prompts: " + ", ".join(parts)
            + f", KL {result['kl_to_ref']:.2f} nats"
            + ("; REWARD HACKING" if result["reward_hacking"] else ""))


def _cell(text: str | None, limit: int = CELL_CHARS) -> str:
    if text is None:
        return "-"
    text = text if len(text) <= limit else text[: limit - 1] + "…"
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r", "").replace("\n", "<br>") or "(empty)"


def _num(value: float | None, fmt: str = "+.3f") -> str:
    return "n/a" if value is None else format(value, fmt)


def render_report(result: dict[str, Any], samples: list[dict[str, Any]], n_shown: int) -> str:
    """eval_report.md from eval.json's content and the per-prompt samples; reward-model rows and columns only
    when there were reward models."""
    pol, sft = result["policy"], result["sft"]
    gold, rm = result["gold_available"], result["rm_available"]
    run = result.get("training", {})
    algorithm = run.get("algorithm")
    trained = (f"{algorithm or 'dpo'} policy after {run['steps']} steps" if "steps" in run
               else f"{run.get('algorithm', 'rl')} policy after {run.get('iterations', '?')} iterations")
    models = (", ".join(f"{m['name']} (weight {m['weight']:g})" for m in result["reward_models"]) if rm
              else "none given")
    lines = ["# Evaluation: final policy vs SFT", "",
             f"{result['n_prompts']} held-out prompts; {trained}; temperature {result['temperature']:g}, "
             f"at most {result['max_new_tokens']} new tokens; reward models: {models}.", "",
             "## Summary", "",
             "| | SFT | policy | delta (± 1 s.e.) | policy win rate |", "|---|---:|---:|---:|---:|"]
    if rm:
        lines.append(f"| reward-model score (z) | {sft['rm_score']:+.3f} | {pol['rm_score']:+.3f} | "
                     f"{result['rm_delta']:+.3f} ± {result['rm_delta_se']:.3f} | "
                     f"{result['win_rate_rm']:.1%} |")
    if gold:
        lines.append(f"| gold score | {sft['gold_score']:+.3f} | {pol['gold_score']:+.3f} | "
                     f"{result['gold_delta']:+.3f} ± {result['gold_delta_se']:.3f} | "
                     f"{result['win_rate_gold']:.1%} |")
    else:
        lines.append("| gold score | n/a | n/a | n/a | n/a |")
    lines += [f"| response length (tokens) | {sft['length']:.1f} | {pol['length']:.1f} | "
              f"{pol['length'] - sft['length']:+.1f} | |",
              f"| ended with EOS | {sft['eos_fraction']:.0%} | {pol['eos_fraction']:.0%} | | |", "",
              f"KL(policy || SFT): {result['kl_to_ref']:.3f} ± {result['kl_to_ref_se']:.3f} nats per "
              f"response (k1 estimate on {result['n_prompts']} temperature-1 samples; budget "
              f"{result['kl_budget']:g}).", ""]
    if not gold:
        lines += ["Gold score unavailable: the data is not the demo task, so there is no hidden scorer.", ""]
    if not rm:
        lines += ["No reward model was given, so there is no reward-model score and no reward-hacking check "
                  "(it compares the reward-model score with the gold score).", ""]
    if len(result["reward_models"]) > 1:
        lines += ["Per reward model (z-scored):", "", "| model | SFT | policy |", "|---|---:|---:|"]
        lines += [f"| {name} | {sft['rm_scores'][name]:+.3f} | {pol['rm_scores'][name]:+.3f} |"
                  for name in pol["rm_scores"]]
        lines.append("")
    findings = [s for s in (result.get("reward_hacking_sentence"),
                            result.get("training_reward_hacking_sentence"),
                            kl_budget_sentence(result["kl_to_ref"], result["kl_budget"], algorithm)) if s]
    lines += ["## Findings", ""]
    if findings:
        lines += [f"- **{s.split(':', 1)[0]}**:{s.split(':', 1)[1]}" for s in findings]
    elif gold or rm:
        direction = ("improved" if (result["gold_delta"] if gold else result["rm_delta"]) > 0
                     else "did not improve")
        hacking = "no reward hacking seen" if rm else "no reward-hacking check without a reward model"
        lines.append(f"- The policy {direction} on the {'gold' if gold else 'reward-model'} score; {hacking} "
                     "and the KL is within budget.")
    else:
        lines.append("- No score measures the policy's quality here (no reward model, and no gold scorer "
                     "outside the demo task); the KL is within budget.")
    lines += ["", "## Training curves", ""]
    plots = result.get("plots", [])
    lines += [line for name in plots for line in (f"![{name}](plots/{name}.png)", "")] or [
        "metrics.jsonl has none of the plotted metrics.", ""]
    shown = samples[:n_shown]
    if shown:
        lines += [f"## Sample responses ({len(shown)} of {len(samples)})", ""]
        if rm:
            lines += ["| # | prompt | SFT response | RM | gold | policy response | RM | gold |",
                      "|---:|---|---|---:|---:|---|---:|---:|"]
        else:
            lines += ["| # | prompt | SFT response | gold | policy response | gold |",
                      "|---:|---|---|---:|---|---:|"]
        for i, s in enumerate(shown, start=1):
            cells = [str(i), _cell(s["prompt"], 80)]
            for side in ("sft", "policy"):
                cells.append(_cell(s[f"{side}_response"]))
                if rm:
                    cells.append(f"{s[f'{side}_rm']:+.2f}")
                cells.append(_num(s[f"{side}_gold"], "+.2f"))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------

def _points(history: list[dict[str, float]], key: str) -> list[tuple[float, float]]:
    """(iteration or step, value) of every row that has `key`."""
    return [(x, float(r[key])) for r in history if r.get(key) is not None and (x := history_x(r)) is not None]


def plots_to_draw(history: list[dict[str, float]]) -> list[str]:
    """The names of the `PLOTS` with at least one metric in the history (the RL ones for RL, the DPO ones for
    DPO)."""
    return [name for name, (_, _, series) in PLOTS.items() if any(_points(history, key) for key, _ in series)]


def plot_curves(history: list[dict[str, float]], out_dir: Path, kl_budget: float | None = None) -> list[Path]:
    """plots/<name>.png for each of `plots_to_draw(history)`, x = RL iteration or DPO step (Agg, no pyplot
    state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    x_label = "iteration" if any("iteration" in r for r in history) else "step"
    paths = []
    for name in plots_to_draw(history):
        title, ylabel, series = PLOTS[name]
        fig = Figure(figsize=(6.0, 3.6), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        for key, label in series:
            points = _points(history, key)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=label)
        if name == "kl" and kl_budget is not None:
            ax.axhline(kl_budget, color="grey", linestyle="--", linewidth=1, label="evaluate.kl_budget")
        ax.set_title(title)
        ax.set_xlabel(x_label)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / f"{name}.png"
        fig.savefig(path)
        paths.append(path)
    return paths


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------

def _generate(checkpoint: Path, engine_cfg: EngineConfig, dtype: str, device: str,
              prompt_ids: list[list[int]], *samplings: SamplingParams) -> list[Generation]:
    """Build an engine from `checkpoint` on `device`, answer every prompt once per sampling setting, free the
    engine."""
    engine = build_engine(checkpoint, engine_cfg, dtype=dtype, device=device)
    try:
        return [engine.generate(prompt_ids, sampling) for sampling in samplings]
    finally:
        engine.unload(keep_weights=False)
        close = getattr(engine, "close", None)
        if close is not None:
            close()  # vllm: one live engine per process, and the next checkpoint builds another


def _generate_each(engine_cfg: EngineConfig, dtype: str, device: str, prompt_ids: list[list[int]],
                   jobs: list[tuple[Path, tuple[SamplingParams, ...]]]) -> list[list[Generation]]:
    """`_generate` for each (checkpoint, samplings) in turn: in this process, or all in one child process
    under engine.worker_python (a venv with vllm; the stage itself keeps its scoring, tracking and publishing
    here)."""
    return [_generate(checkpoint, engine_cfg, dtype, device, prompt_ids, *samplings)
            for checkpoint, samplings in jobs]


@dataclass
class SideResults:
    """One policy's answers to the eval prompts, scored: every list has one entry per prompt."""

    texts: list[str]
    rm_total: list[float] | None  # weighted sum of z-scored reward-model scores; None without reward models
    rm_each: dict[str, list[float]]  # reward-model name -> z-scored score (empty without reward models)
    gold: list[float] | None  # None when the data is not the demo task
    lengths: list[int]  # response tokens, the finishing EOS included
    finish_reasons: list[str]

    def means(self) -> dict[str, Any]:
        n = len(self.lengths)
        return {"rm_score": sum(self.rm_total) / n if self.rm_total is not None else None,
                "rm_scores": {k: sum(v) / n for k, v in self.rm_each.items()},
                "gold_score": sum(self.gold) / n if self.gold is not None else None,
                "length": sum(self.lengths) / n,
                "eos_fraction": sum(r == "eos" for r in self.finish_reasons) / n}


def summarise(policy: SideResults, sft: SideResults, kl: list[float], history: list[dict[str, float]],
              kl_budget: float, algorithm: str | None = None) -> dict[str, Any]:
    """The numbers of eval.json: means per side, paired deltas, win rates, KL, and the reward-hacking checks.

    Without reward models the reward-model numbers are None and the held-out reward-hacking check is not run
    (`reward_hacking` is None: not checked, rather than False: checked and not found).
    """
    n = len(kl)
    gold = policy.gold is not None and sft.gold is not None
    rm = policy.rm_total is not None and sft.rm_total is not None
    rm_delta, rm_se = paired_delta(policy.rm_total, sft.rm_total) if rm else (None, None)
    gold_delta, gold_se = paired_delta(policy.gold, sft.gold) if gold else (None, None)
    trend_rm = early_late(history, "rollout/score_mean")
    trend_gold = early_late(history, "rollout/gold_score_mean")
    training_hacking = None
    if trend_rm and trend_gold:
        training_hacking = reward_hacking_sentence(
            trend_rm[1] - trend_rm[0], trend_gold[1] - trend_gold[0],
            where="during training (first vs last quarter of iterations)", algorithm=algorithm)
    eval_hacking = reward_hacking_sentence(rm_delta, gold_delta, gold_se, algorithm=algorithm) if rm else None
    kl_mean = sum(kl) / n
    return {
        "n_prompts": n, "gold_available": gold, "rm_available": rm,
        "policy": policy.means(), "sft": sft.means(),
        "rm_delta": rm_delta, "rm_delta_se": rm_se, "gold_delta": gold_delta, "gold_delta_se": gold_se,
        "win_rate_rm": win_rate(policy.rm_total, sft.rm_total) if rm else None,
        "win_rate_gold": win_rate(policy.gold, sft.gold) if gold else None,
        "kl_to_ref": kl_mean, "kl_to_ref_se": statistics.stdev(kl) / math.sqrt(n) if n > 1 else 0.0,
        "kl_budget": kl_budget, "kl_over_budget": kl_mean > kl_budget,
        "reward_hacking": (eval_hacking is not None) if rm else None, "reward_hacking_sentence": eval_hacking,
        "training_reward_hacking": training_hacking is not None,
        "training_reward_hacking_sentence": training_hacking,
    }


def sample_rows(ids: list[Any], prompts: list[str], policy: SideResults, sft: SideResults,
                kl: list[float]) -> list[dict[str, Any]]:
    """samples.jsonl: one row per prompt with both responses and their scores (reward-model ones only with
    models)."""
    rows = []
    for i, prompt in enumerate(prompts):
        row: dict[str, Any] = {"id": ids[i], "prompt": prompt}
        for name, side in (("sft", sft), ("policy", policy)):
            row.update({f"{name}_response": side.texts[i],
                        **({f"{name}_rm": side.rm_total[i]} if side.rm_total is not None else {}),
                        f"{name}_gold": side.gold[i] if side.gold is not None else None,
                        f"{name}_length": side.lengths[i], f"{name}_finish": side.finish_reasons[i],
                        **{f"{name}_rm_{k}": v[i] for k, v in side.rm_each.items()}})
        row["kl_sample"] = kl[i]
        rows.append(row)
    return rows


def eval_metrics(result: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics (eval/...) of an eval.json result; reward-model metrics only with reward models,
    gold metrics only when gold is available."""
    pol, sft = result["policy"], result["sft"]
    metrics = {"eval/kl_to_ref": result["kl_to_ref"], "eval/policy_length": pol["length"],
               "eval/sft_length": sft["length"], "eval/n_prompts": float(result["n_prompts"])}
    if result["rm_available"]:
        metrics.update({"eval/policy_rm_score": pol["rm_score"], "eval/sft_rm_score": sft["rm_score"],
                        "eval/rm_delta": result["rm_delta"], "eval/win_rate_rm": result["win_rate_rm"]})
    if result["gold_available"]:
        metrics.update({"eval/policy_gold_score": pol["gold_score"], "eval/sft_gold_score": sft["gold_score"],
                        "eval/gold_delta": result["gold_delta"],
                        "eval/win_rate_gold": result["win_rate_gold"]})
    if len(pol["rm_scores"]) > 1:
        for name in pol["rm_scores"]:
            metrics[f"eval/policy_rm_score_{name}"] = pol["rm_scores"][name]
            metrics[f"eval/sft_rm_score_{name}"] = sft["rm_scores"][name]
    return {k: float(v) for k, v in metrics.items()}


def run(spec: StageSpec) -> StageResult:
    cfg: EvaluateConfig = section(spec, EvaluateConfig, "evaluate")
    model_cfg: ModelConfig = section(spec, ModelConfig, "model")
    engine_cfg: EngineConfig = section(spec, EngineConfig, "engine")
    # `alignflow validate` runs the same checks before the pipeline starts.
    problems = start_checks.evaluate_stage(cfg, engine_cfg, spec.inputs)
    if problems:
        raise StageInputError(problems[0].message)
    ctx = StageContext(spec)
    with tracked(ctx):
        profiler = ctx.profiler
        profiler.iteration_word = "the evaluation"
        policy_name = policy_input(spec.inputs)
        trained_dir, sft_dir, data_dir = ctx.input(policy_name), ctx.input("sft"), ctx.input("data")
        policy_dir = trained_dir / "policy"
        if not (policy_dir / "config.json").is_file():
            raise StageInputError(f"the '{policy_name}' input {trained_dir} has no policy/ checkpoint; pass "
                                  f"a {policy_name} stage output")
        history = read_history(trained_dir / "metrics.jsonl", policy_name)
        run_file = trained_dir / "alignflow_run.json"
        run_info = json.loads(run_file.read_text()) if run_file.is_file() else {}
        training = training_summary(policy_name, run_info, history)
        with_rm = bool(reward_input_names(spec.inputs))
        tokenizer = load_tokenizer(policy_dir)
        pad_id = pad_token_id(tokenizer)
        device = ctx.compute_device()
        records = load_prompts(data_dir / "eval_prompts.jsonl")[: cfg.n_prompts]
        prompt_texts = [render_prompt(r.prompt, tokenizer) for r in records]
        prompt_ids = [encode_prompt(tokenizer, t) for t in prompt_texts]
        longest = max(len(p) for p in prompt_ids)
        if longest + cfg.max_new_tokens > engine_cfg.max_seq_len:
            raise StageInputError(f"the longest eval prompt has {longest} tokens; with "
                                  f"evaluate.max_new_tokens={cfg.max_new_tokens} that exceeds "
                                  f"engine.max_seq_len={engine_cfg.max_seq_len}: lower "
                                  f"evaluate.max_new_tokens to <= {engine_cfg.max_seq_len - longest} or "
                                  f"raise engine.max_seq_len")
        evaluator = load_evaluator(data_dir)
        gold_available = evaluator is not None
        n = len(records)
        profiler.facts = RunFacts(engine_backend=engine_cfg.backend, generate_device=device.type,
                                  cuda_graphs=engine_cfg.cuda_graphs,
                                  generate_calls=math.ceil(n / engine_cfg.max_batch_size))

        with profiler.phase("generate"):
            # Same per-prompt seeds for both policies: common random numbers make the comparison less noisy.
            sampling = SamplingParams(temperature=cfg.temperature, max_new_tokens=cfg.max_new_tokens,
                                      seed=GENERATION_SEED)
            kl_sampling = SamplingParams(temperature=1.0, max_new_tokens=cfg.max_new_tokens, seed=KL_SEED)
            jobs = [(policy_dir, (sampling, kl_sampling)), (sft_dir, (sampling,))]
            if "champion" in spec.inputs:
                # The registry's current champion, scored on the same prompts, seeds and reward models,
                # so the promotion gate compares like with like.
                jobs.append((ctx.input("champion") / "policy", (sampling,)))
            answers = call_in(resolve(engine_cfg.worker_python, engine_cfg.backend), _generate_each,
                              engine_cfg, model_cfg.dtype, str(device), prompt_ids, jobs,
                              what=f"the evaluation's {engine_cfg.backend} generation")
            ctx.record_device("generate", device)
            (policy_gen, kl_sample), (sft_gen,) = answers[:2]
            gen = {"policy": policy_gen, "sft": sft_gen}
            if len(answers) == 3:
                (gen["champion"],) = answers[2]
        profiler.count(tokens=sum(sum(g.lengths) for g in (*gen.values(), kl_sample)),
                       samples=(len(gen) + 1) * n)
        texts = {side: [tokenizer.decode(ids, skip_special_tokens=True) for ids in g.response_token_ids]
                 for side, g in gen.items()}

        with profiler.phase("score"):
            rm_info, rm = [], None
            if with_rm:
                reward_models = load_reward_models(ctx, dtype=model_cfg.dtype, device=device,
                                                   tokenizer=tokenizer)
                ctx.record_device("score", reward_models[0].model)
                rm_info = [{"name": m.name, "weight": m.weight, "score_mean": m.mean, "score_std": m.std}
                           for m in reward_models]
                rm = {side: score_with_reward_models(
                    reward_models, [p + r for p, r in zip(prompt_ids, g.response_token_ids, strict=True)],
                    pad_id) for side, g in gen.items()}
                del reward_models
            gold = {side: [evaluator(p, c) for p, c in zip(prompt_texts, texts[side], strict=True)]
                    if evaluator is not None else None for side in gen}

        with profiler.phase("kl"):
            policy = load_causal_lm(policy_dir, dtype=model_cfg.dtype).to(device).eval()
            reference = load_causal_lm(sft_dir, dtype=model_cfg.dtype).to(device).eval()
            ctx.record_device("reference", reference)
            kl = kl_to_reference(policy, reference, prompt_ids, kl_sample.response_token_ids, pad_id).tolist()
            del policy, reference

        sides = {side: SideResults(
            texts=texts[side], rm_total=rm[side].total.tolist() if rm else None,
            rm_each={k: v.tolist() for k, v in rm[side].per_model.items()} if rm else {}, gold=gold[side],
            lengths=g.lengths, finish_reasons=list(g.finish_reasons)) for side, g in gen.items()}
        result = summarise(sides["policy"], sides["sft"], kl, history, cfg.kl_budget, training["algorithm"])
        result.update({"temperature": cfg.temperature, "max_new_tokens": cfg.max_new_tokens,
                       "engine_backend": engine_cfg.backend, "reward_models": rm_info, "training": training,
                       "plots": plots_to_draw(history)})
        samples = sample_rows([r.extras.get("id", i) for i, r in enumerate(records)], prompt_texts,
                              sides["policy"], sides["sft"], kl)
        metrics = eval_metrics(result)
        if "champion" in gen:
            # The gate (flows/registry.py) compares the candidate with these: reward-model score when there
            # are reward models, else gold score.
            if rm:
                metrics["eval/champion_rm_score"] = float(rm["champion"].total.mean())
            if gold_available:
                metrics["eval/champion_gold_score"] = float(sum(gold["champion"]) / n)
            result["champion"] = {"uri": spec.inputs["champion"],
                                  "rm_score": metrics.get("eval/champion_rm_score"),
                                  "gold_score": metrics.get("eval/champion_gold_score")}
        result["metrics"] = metrics
        key_metric = "eval/gold_delta" if gold_available else "eval/rm_delta" if rm else "eval/kl_to_ref"

        with ctx.output_dir() as out:
            with profiler.phase("io"):
                dump_json(result, out / "eval.json")
                (out / "samples.jsonl").write_text(
                    "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in samples))
                (out / "eval_report.md").write_text(render_report(result, samples, cfg.n_samples_shown))
                plot_curves(history, out / "plots", cfg.kl_budget)
            if ctx.tracker is not None:
                ctx.tracker.log_metrics(metrics)
                for name in ("eval_report.md", "eval.json", "samples.jsonl"):
                    ctx.tracker.log_artifact(out / name)
                ctx.tracker.log_artifacts(out / "plots", "plots")
            manifest = ctx.publish_output(out, summary={"metrics": metrics, "key_metric": key_metric})
        return ctx.result(manifest, metrics, key_metric, message=headline(result))


def main(argv: list[str] | None = None) -> int:
    return stage_main("evaluate", run, argv)


if __name__ == "__main__":
    run_program(main)
