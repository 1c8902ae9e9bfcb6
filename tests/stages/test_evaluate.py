"""The evaluation stage on a fake pipeline (tiny random models, demo data); its measurements against loops."""

from __future__ import annotations

import importlib.util
import json
import shutil
import struct

import pytest
import torch

from alignflow.config import DemoTaskConfig, TinyModelConfig
from alignflow.contract import StageSpec
from alignflow.manifest import publish, read_manifest
from alignflow.stages import evaluate
from alignflow.stages.common.models.tiny import make_tiny_model, save_base_model, train_tokenizer
from alignflow.stages.common.runtime import StageInputError
from alignflow.stages.common.tokenization import collate_lm, encode_completion, encode_example
from alignflow.stages.data.demo_task import demo_corpus, generate_demo_task, gold_score
from alignflow.stages.data.formats import load_prompts
from alignflow.stages.evaluate import (
    SideResults,
    early_late,
    eval_metrics,
    headline,
    kl_to_reference,
    paired_delta,
    render_report,
    response_logprob_sums,
    reward_hacking_sentence,
    summarise,
    win_rate,
)

TINY = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=1, vocab_size=400, max_position_embeddings=128)
BACKEND = "native" if importlib.util.find_spec("alignflow.stages.common.generation.native.engine") else "hf"
N_PROMPTS = 8
NEW_TOKENS = 8
POLICY_ANSWER = "Lovely."  # what the fake policy learns to say (6 tokens + EOS: fits in NEW_TOKENS)


# ----------------------------------------------------------------------------------------------
# A fake pipeline: every input published with a manifest into a file:// store
# ----------------------------------------------------------------------------------------------

def _publish(folder, store, name):
    uri = f"file://{store}/{name}"
    publish(folder, uri, stage=name, config={}, inputs={}, version="test")
    return uri


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and two threads on a shared 2-core box run 30x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _fake_policy(tokenizer, prompts: list[str]):
    """A policy that differs from the random SFT model: 40 Adam steps teach it to answer POLICY_ANSWER +
    EOS."""
    model = make_tiny_model(TINY, tokenizer, seed=1).train()
    batch = collate_lm([encode_example(tokenizer, p, POLICY_ANSWER, 64) for p in prompts], 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(40):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def _history(iterations: int) -> list[dict[str, float]]:
    """Training curves where the reward-model score rises and the gold score falls (reward hacking)."""
    return [{"iteration": i, "rollout/score_mean": -0.5 + 0.2 * i,
             "rollout/reward_total_mean": -0.6 + 0.2 * i, "rollout/gold_score_mean": 0.5 - 0.1 * i,
             "kl/mean": 0.5 * i, "rollout/response_length_mean": 8.0 - i} for i in range(1, iterations + 1)]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from alignflow.stages.common.models.loading import load_sequence_classifier

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("evaluate")
    store = root / "store"
    demo = DemoTaskConfig(n_sft=10, n_preferences=10, n_prompts=4, n_eval_prompts=N_PROMPTS + 2)
    data = root / "data"
    generate_demo_task(demo, data)
    (data / "stats.json").write_text(json.dumps({"sources": {
        k: f"demo://seed=0/{k}" for k in ("sft", "preferences", "prompts", "eval_prompts")}}))
    tokenizer = train_tokenizer(demo_corpus(demo, n_texts=200), TINY.vocab_size)
    sft = save_base_model(make_tiny_model(TINY, tokenizer, seed=0), tokenizer, root / "sft")
    ppo = root / "ppo"
    eval_prompts = [r.prompt for r in load_prompts(data / "eval_prompts.jsonl")]
    save_base_model(_fake_policy(tokenizer, eval_prompts), tokenizer, ppo / "policy")
    (ppo / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _history(6)))
    (ppo / "alignflow_run.json").write_text(json.dumps({"algorithm": "ppo", "iterations": 6}))
    inputs = {"data": _publish(data, store, "data"), "sft": _publish(sft, store, "sft"),
              "ppo": _publish(ppo, store, "ppo")}
    for name, weight, seed in (("a", 1.0, 1), ("b", 0.5, 2)):
        rm_dir = root / f"reward_{name}"
        model = load_sequence_classifier(sft, seed=seed)  # a different random head per reward model
        model.save_pretrained(rm_dir)
        tokenizer.save_pretrained(rm_dir)
        (rm_dir / "alignflow_checkpoint.json").write_text(json.dumps(
            {"name": name, "weight": weight, "score_mean": 0.01 * seed, "score_std": 0.5 * seed}))
        inputs[f"reward_{name}"] = _publish(rm_dir, store, f"reward_{name}")
    return {"root": root, "store": store, "inputs": inputs, "tokenizer": tokenizer, "sft": sft,
            "policy": ppo / "policy"}


def _spec(pipeline, name: str, inputs: dict[str, str] | None = None, **evaluate_cfg) -> StageSpec:
    config = {"evaluate": {"n_prompts": N_PROMPTS, "max_new_tokens": NEW_TOKENS, "temperature": 0.0,
                           "n_samples_shown": 3, **evaluate_cfg},
              "model": {"dtype": "float32"},
              "engine": {"backend": BACKEND, "max_batch_size": 8, "max_seq_len": 96, "cuda_graphs": False}}
    return StageSpec(stage="evaluate", config=config, inputs=inputs or pipeline["inputs"],
                     output_uri=f"file://{pipeline['store']}/{name}", workdir=str(pipeline["root"]))


@pytest.fixture(scope="module")
def evaluated(pipeline):
    result = evaluate.run(_spec(pipeline, "evaluate-out", kl_budget=1e-3))
    out = pipeline["store"] / "evaluate-out"
    return result, out


# ----------------------------------------------------------------------------------------------
# The stage
# ----------------------------------------------------------------------------------------------

def _answer_length(pipeline) -> int:
    return len(encode_completion(pipeline["tokenizer"], POLICY_ANSWER))  # with its EOS


def test_stage_publishes_numbers_in_range(pipeline, evaluated):
    result, out = evaluated
    assert result.status == "ok" and result.key_metric == "eval/gold_delta"
    numbers = json.loads((out / "eval.json").read_text())
    assert numbers["n_prompts"] == N_PROMPTS and numbers["gold_available"] is True
    for key in ("win_rate_rm", "win_rate_gold"):
        assert 0.0 <= numbers[key] <= 1.0
        assert (numbers[key] * N_PROMPTS * 2) % 1 == 0  # wins count 1, ties 1/2: a multiple of 1/(2N)
    # The fake policy says "Lovely." and stops (gold -0.85 on every prompt). The random SFT model writes
    # no words of the task, whatever it writes instead (gold -2, the minimum).
    assert numbers["policy"]["eos_fraction"] == 1.0
    assert numbers["policy"]["length"] == _answer_length(pipeline) < NEW_TOKENS
    assert numbers["policy"]["gold_score"] == pytest.approx(gold_score("Write about the ocean.\n",
                                                                       POLICY_ANSWER))
    assert numbers["gold_delta"] > 0 and numbers["win_rate_gold"] > 0.5
    # Every summary number agrees with the per-prompt rows it is made of.
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    for side in ("policy", "sft"):
        assert numbers[side]["length"] == pytest.approx(sum(s[f"{side}_length"] for s in samples) / N_PROMPTS)
        assert numbers[side]["eos_fraction"] == sum(s[f"{side}_finish"] == "eos" for s in samples) / N_PROMPTS
    assert numbers["win_rate_gold"] == win_rate([s["policy_gold"] for s in samples],
                                                [s["sft_gold"] for s in samples])
    assert numbers["win_rate_rm"] == win_rate([s["policy_rm"] for s in samples],
                                              [s["sft_rm"] for s in samples])
    assert numbers["kl_to_ref"] == pytest.approx(sum(s["kl_sample"] for s in samples) / N_PROMPTS)
    # The policy puts nearly all its mass on one answer the random reference gives ~1/400 per token:
    # KL ~ 7 tokens x ln(400) ~ 42 nats; 5 is far below that and far above zero.
    assert numbers["kl_to_ref"] > 5.0
    for side in ("policy", "sft"):
        assert -2.0 <= numbers[side]["gold_score"] <= 2.0  # the gold scorer's range
        assert 1.0 <= numbers[side]["length"] <= NEW_TOKENS
        assert set(numbers[side]["rm_scores"]) == {"a", "b"}
        # total = 1.0 * z_a + 0.5 * z_b, also after averaging over prompts
        expected = numbers[side]["rm_scores"]["a"] + 0.5 * numbers[side]["rm_scores"]["b"]
        assert numbers[side]["rm_score"] == pytest.approx(expected, abs=1e-6)
    assert numbers["gold_delta"] == pytest.approx(
        numbers["policy"]["gold_score"] - numbers["sft"]["gold_score"], abs=1e-9)
    assert numbers["rm_delta"] == pytest.approx(numbers["policy"]["rm_score"] - numbers["sft"]["rm_score"],
                                                abs=1e-6)
    assert numbers["kl_to_ref"] == pytest.approx(numbers["metrics"]["eval/kl_to_ref"])
    assert torch.isfinite(torch.tensor(numbers["kl_to_ref"]))
    assert [m["name"] for m in numbers["reward_models"]] == ["a", "b"]
    expected_metrics = {f"eval/{k}" for k in ("policy_rm_score", "sft_rm_score", "policy_gold_score",
                                              "sft_gold_score", "gold_delta", "rm_delta", "kl_to_ref",
                                              "win_rate_rm", "win_rate_gold", "policy_length", "sft_length")}
    assert expected_metrics <= set(result.metrics)
    assert read_manifest(result.output_uri).digest == result.manifest_digest


def test_stage_writes_plots_samples_report_and_profile(pipeline, evaluated):
    _, out = evaluated
    # The RL stage's curves, none of the DPO stage's.
    assert sorted(p.name for p in (out / "plots").iterdir()) == ["kl.png", "length.png", "reward.png"]
    for name in ("reward", "kl", "length"):
        png = (out / "plots" / f"{name}.png").read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        width, height = struct.unpack(">II", png[16:24])
        assert (width, height) == (600, 360)  # 6.0 x 3.6 inches at 100 dpi
        assert len(png) > 5000  # axes, curves and labels, not an empty canvas
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == N_PROMPTS
    assert all(s["policy_response"] == POLICY_ANSWER for s in samples)  # the sides are not swapped
    assert all(s["policy_length"] == _answer_length(pipeline) for s in samples)
    assert {"prompt", "sft_response", "policy_response", "sft_rm", "policy_rm", "sft_gold", "policy_gold",
            "kl_sample"} <= set(samples[0])
    report = (out / "eval_report.md").read_text()
    assert "| reward-model score (z) |" in report and "| gold score |" in report
    assert "## Sample responses (3 of 8)" in report
    assert report.count("\n| 3 |") == 1 and "\n| 4 |" not in report  # n_samples_shown rows
    assert "**KL warning**" in report  # kl_budget=1e-3 is below any KL between two different random models
    assert "**Reward hacking during training" in report  # the fake curves: RM up, gold down
    profile = (out / "profile.md").read_text()
    for phase in ("generate", "score", "kl"):
        assert f"| {phase} | 1 |" in profile


DPO_STEPS = 6


@pytest.fixture(scope="module")
def evaluated_dpo(pipeline):
    """The same fake policy in the DPO stage's layout (metrics rows per step), evaluated with no reward
    model."""
    dpo = pipeline["root"] / "dpo"
    shutil.copytree(pipeline["policy"], dpo / "policy")
    history = [{"step": s, "train/loss": 0.7 - 0.05 * s, "rewards/chosen": 0.02 * s,
                "rewards/rejected": -0.01 * s, "rewards/margin": 0.03 * s, "rewards/accuracy": 0.5 + 0.05 * s,
                **({"eval/loss": 0.7 - 0.04 * s, "eval/rewards_margin": 0.02 * s,
                    "eval/rewards_accuracy": 0.6} if s % 3 == 0 else {})} for s in range(1, DPO_STEPS + 1)]
    (dpo / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
    (dpo / "alignflow_run.json").write_text(json.dumps({"algorithm": "dpo", "loss": "sigmoid", "beta": 0.1,
                                                        "steps": DPO_STEPS, "final": history[-1]}))
    inputs = {"dpo": _publish(dpo, pipeline["store"], "dpo"), "sft": pipeline["inputs"]["sft"],
              "data": pipeline["inputs"]["data"]}
    result = evaluate.run(_spec(pipeline, "evaluate-dpo", inputs=inputs))
    return result, pipeline["store"] / "evaluate-dpo"


def test_a_dpo_policy_without_reward_models_is_scored_as_a_ppo_policy(evaluated, evaluated_dpo):
    (ppo_result, ppo_out), (result, out) = evaluated, evaluated_dpo
    assert result.status == "ok" and result.key_metric == "eval/gold_delta"
    numbers = json.loads((out / "eval.json").read_text())
    ppo_numbers = json.loads((ppo_out / "eval.json").read_text())
    # The same weights, prompts and seeds as the PPO-layout policy: the same gold, KL, lengths and win rate.
    for key in ("gold_delta", "win_rate_gold", "kl_to_ref", "n_prompts"):
        assert numbers[key] == pytest.approx(ppo_numbers[key], rel=1e-6), key
    for side in ("policy", "sft"):
        for key in ("gold_score", "length", "eos_fraction"):
            assert numbers[side][key] == pytest.approx(ppo_numbers[side][key], rel=1e-6), (side, key)
    # Why these hold: test_stage_publishes_numbers_in_range.
    assert numbers["gold_delta"] > 0 and numbers["kl_to_ref"] > 5.0
    # Reward-model numbers are absent (null), not zero, and the reward-hacking check did not run.
    assert numbers["reward_models"] == [] and numbers["rm_available"] is False
    assert numbers["rm_delta"] is None and numbers["win_rate_rm"] is None
    assert numbers["policy"]["rm_score"] is None
    assert numbers["reward_hacking"] is None
    assert numbers["training"] == {"algorithm": "dpo", "loss": "sigmoid", "beta": 0.1, "steps": DPO_STEPS}
    assert not [k for k in result.metrics if "rm" in k]
    assert {k: result.metrics[k] for k in ("eval/gold_delta", "eval/kl_to_ref")} == pytest.approx(
        {k: ppo_result.metrics[k] for k in ("eval/gold_delta", "eval/kl_to_ref")}, rel=1e-6)
    assert result.message == (f"policy vs SFT on {N_PROMPTS} prompts: gold {numbers['gold_delta']:+.3f} "
                              f"(win rate {numbers['win_rate_gold']:.0%}), "
                              f"KL {numbers['kl_to_ref']:.2f} nats")
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all(s["policy_response"] == POLICY_ANSWER for s in samples)
    assert not [k for k in samples[0] if "_rm" in k]


def test_a_dpo_report_speaks_of_steps_and_draws_the_dpo_curves(evaluated_dpo):
    _, out = evaluated_dpo
    report = (out / "eval_report.md").read_text()
    assert f"dpo policy after {DPO_STEPS} steps" in report and "reward models: none given." in report
    assert "reward-model score (z)" not in report and "No reward model was given" in report
    assert "| # | prompt | SFT response | gold | policy response | gold |" in report
    drawn = sorted(p.name for p in (out / "plots").iterdir())
    assert drawn == ["accuracy.png", "implicit_rewards.png", "loss.png"]  # no empty RL plots
    for name in drawn:
        png = (out / "plots" / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
        assert f"(plots/{name})" in report


def test_max_new_tokens_that_overflow_the_engine_are_refused(pipeline):
    with pytest.raises(StageInputError, match="evaluate.max_new_tokens=200"):
        evaluate.run(_spec(pipeline, "too-long", max_new_tokens=200))


# ----------------------------------------------------------------------------------------------
# Measurements against plain references
# ----------------------------------------------------------------------------------------------

def test_win_rate_counts_ties_as_half():
    assert win_rate([1.0, 2.0, 3.0, 0.0], [0.0, 2.0, 4.0, -1.0]) == pytest.approx((1 + 0.5 + 0 + 1) / 4)
    assert win_rate([0.3] * 5, [0.3] * 5) == 0.5
    with pytest.raises(ValueError, match="equally long"):
        win_rate([1.0], [1.0, 2.0])


def test_paired_delta_is_the_mean_difference_with_its_standard_error():
    mean, se = paired_delta([1.0, 2.0, 4.0], [0.0, 1.0, 1.0])
    assert mean == pytest.approx(5 / 3)  # differences 1, 1, 3
    diffs = torch.tensor([1.0, 1.0, 3.0], dtype=torch.float64)
    assert se == pytest.approx(float(diffs.std() / 3**0.5), rel=1e-12)


def _loop_logprob_sum(model, prompt: list[int], response: list[int]) -> float:
    """The slow reference: one unpadded sequence, a full log-softmax, a Python loop over response tokens."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
    return sum(float(logp[len(prompt) + j - 1, tok]) for j, tok in enumerate(response))


def test_response_logprobs_and_kl_match_a_per_sequence_loop(pipeline):
    from alignflow.stages.common.models.loading import load_causal_lm

    policy = load_causal_lm(pipeline["policy"]).eval()
    reference = load_causal_lm(pipeline["sft"]).eval()
    g = torch.Generator().manual_seed(0)
    # Odd lengths so right-padding and the prompt/response boundary differ between rows.
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (3, 7, 1, 5)]
    responses = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 1, 6, 2)]
    fast = response_logprob_sums(policy, prompts, responses, pad_id=2, batch_size=3)
    slow = torch.tensor([_loop_logprob_sum(policy, p, r) for p, r in zip(prompts, responses, strict=True)])
    # fp32 logits summed over <= 6 tokens of a 400-way softmax: agreement to 1e-4 nats.
    torch.testing.assert_close(fast, slow.float(), rtol=0, atol=1e-4)
    kl = kl_to_reference(policy, reference, prompts, responses, pad_id=2)
    slow_kl = torch.tensor([_loop_logprob_sum(policy, p, r) - _loop_logprob_sum(reference, p, r)
                            for p, r in zip(prompts, responses, strict=True)])
    torch.testing.assert_close(kl, slow_kl.float(), rtol=0, atol=2e-4)
    assert kl.abs().max() > 1e-3  # two different random models: the check above is not 0 == 0
    same = kl_to_reference(policy, policy, prompts, responses, pad_id=2)
    assert same.abs().max() == 0.0


# ----------------------------------------------------------------------------------------------
# Words
# ----------------------------------------------------------------------------------------------

def test_reward_hacking_is_named_only_when_rm_rises_and_gold_falls():
    sentence = reward_hacking_sentence(0.8, -0.3, gold_se=0.1)
    assert sentence.startswith("Reward hacking on held-out prompts: the reward-model score rose by +0.800 "
                               "while the gold score fell by -0.300 (the gold drop is 3.0 standard errors)")
    assert "within noise" in reward_hacking_sentence(0.8, -0.1, gold_se=0.1)
    assert reward_hacking_sentence(0.8, 0.2) is None
    assert reward_hacking_sentence(-0.1, -0.5) is None
    assert reward_hacking_sentence(0.8, None) is None


def _side(rm: list[float], gold: list[float] | None, length: int = 5) -> SideResults:
    n = len(rm)
    return SideResults(texts=["text"] * n, rm_total=rm, rm_each={"rm": rm}, gold=gold, lengths=[length] * n,
                       finish_reasons=["eos"] * n)


def _result(rm_delta: float, gold_delta: float | None, kl: float = 1.0) -> dict:
    """eval.json content for 4 prompts where the policy's RM and gold scores move by the given deltas."""
    base = [0.1, -0.2, 0.3, 0.0]
    policy = _side([b + rm_delta for b in base],
                   None if gold_delta is None else [b + gold_delta for b in base])
    sft = _side(base, None if gold_delta is None else base)
    result = summarise(policy, sft, kl=[kl] * 4, history=[], kl_budget=5.0)
    result.update({"temperature": 0.0, "max_new_tokens": 8, "reward_models": [{"name": "rm", "weight": 1.0}],
                   "training": {"algorithm": "ppo", "iterations": 3}})
    return result


def test_summarise_computes_paired_numbers():
    policy = _side([1.0, 0.0, 2.0, 0.5], [1.0, -1.0, 0.0, 0.5], length=3)
    sft = _side([0.0, 0.0, 1.0, 1.0], [0.5, -0.5, 0.0, 0.0], length=6)
    result = summarise(policy, sft, kl=[2.0, 4.0, -1.0, 3.0], history=_history(8), kl_budget=1.5)
    assert result["win_rate_rm"] == pytest.approx((1 + 0.5 + 1 + 0) / 4)
    assert result["win_rate_gold"] == pytest.approx((1 + 0 + 0.5 + 1) / 4)
    assert result["rm_delta"] == pytest.approx(0.375) and result["gold_delta"] == pytest.approx(0.125)
    assert result["kl_to_ref"] == pytest.approx(2.0) and result["kl_over_budget"] is True
    assert result["policy"]["length"] == 3.0 and result["sft"]["length"] == 6.0
    assert result["reward_hacking"] is False  # both scores rose
    assert result["training_reward_hacking"] is True  # the fake curves: RM up, gold down
    metrics = eval_metrics(result)
    assert metrics["eval/gold_delta"] == pytest.approx(0.125) and metrics["eval/win_rate_rm"] == 0.625


def test_without_gold_the_numbers_and_report_say_unavailable():
    result = _result(rm_delta=0.5, gold_delta=None)
    assert result["gold_available"] is False
    assert result["gold_delta"] is None and result["win_rate_gold"] is None
    assert not any("gold" in k for k in eval_metrics(result))
    report = render_report(result, [], n_shown=0)
    assert "| gold score | n/a | n/a | n/a | n/a |" in report
    assert "Gold score unavailable" in report
    assert "improved on the reward-model score" in report


def test_report_says_reward_hacking_in_words_when_rm_rises_and_gold_falls():
    hacked_result = _result(rm_delta=1.2, gold_delta=-0.4)
    assert hacked_result["reward_hacking"] is True
    hacked = render_report(hacked_result, [], n_shown=0)
    assert ("- **Reward hacking on held-out prompts**: the reward-model score rose by +1.200 while the gold "
            "score fell by -0.400") in hacked
    assert "REWARD HACKING" in headline(hacked_result)
    honest = render_report(_result(rm_delta=1.2, gold_delta=0.4), [], n_shown=0)
    assert "Reward hacking" not in honest
    assert "The policy improved on the gold score" in honest
    over = render_report(_result(rm_delta=1.2, gold_delta=0.4, kl=7.5), [], n_shown=0)
    assert "**KL warning**: the policy is 7.50 nats per response" in over


def test_report_escapes_table_cells():
    sample = {"prompt": "a|b\nc", "sft_response": "x | y", "policy_response": "line1\nline2", "sft_rm": 0.1,
              "policy_rm": 0.2, "sft_gold": None, "policy_gold": 1.0}
    text = render_report(_result(0.1, 0.1), [sample], n_shown=1)
    row = next(line for line in text.splitlines() if line.startswith("| 1 |"))
    assert "a\\|b<br>c" in row and "x \\| y" in row and "line1<br>line2" in row
    assert row.count(" | ") == 7  # eight cells, none split by the escaped pipes


def test_early_late_compares_the_first_and_last_quarter():
    history = _history(8)
    first, last = early_late(history, "rollout/score_mean")
    assert first == pytest.approx((-0.3 + -0.1) / 2) and last == pytest.approx((0.9 + 1.1) / 2)
    assert early_late(history, "missing/key") is None


