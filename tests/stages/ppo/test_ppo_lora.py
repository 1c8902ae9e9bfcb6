"""LoRA in the RL stage: only adapted modules refit (exactly: the engine's log-probs stay the actor's), the
reference is the adapter-free base (the SFT model's log-probs), merged policy and critic checkpoints, resume
from a LoRA checkpoint (torch and DeepSpeed trainers), a compiled LoRA backbone, one-line config errors."""

from __future__ import annotations

import json
import math
import shutil

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file

from tests.stages.ppo.test_ppo import finish, local, ppo_spec, start_stage

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}
GRPO = {
    "algorithm": "grpo",
    "group_size": 4,
    "prompts_per_iteration": 4,
    "minibatch_size": 16,
    "kl_coef": 0.0,
    "iterations": 2,
    "checkpoint_every": 1,
}
# kl_coef > 0: the reference (the actor with its adapters off) is used every iteration.
LORA_PPO = {"lora": LORA, "kl_coef": 0.1, "actor_lr": 5e-3, "critic_lr": 5e-3}
# DeepSpeed trainers (zero_stage 0): their checkpoints of a peft model, beside the torch trainer's of the PPO
# run.
LORA_GRPO = {**GRPO, "lora": LORA, "reward_model": True, "train_backend": "deepspeed"}


def history_of(out) -> list[dict[str, float]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def adapted_bytes(sft_dir, target_modules: list[str]) -> int:
    """Bytes of the fp32 weights of every module LoRA adapts (what a LoRA refit must send)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sft_dir)
    return sum(
        module.weight.numel() * 4
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in target_modules
    )


def adapter_parameters(sft_dir, lora: dict) -> int:
    """LoRA's A (r x in) and B (out x r) of every adapted linear layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sft_dir)
    return sum(
        lora["rank"] * (module.in_features + module.out_features)
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] in lora["target_modules"]
    )


def run_ok(upstream, name: str, **ppo):
    workdir, _, _ = upstream
    spec = ppo_spec(upstream, name, **ppo)
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    return spec, result, stderr


@pytest.fixture(scope="module")
def lora_ppo(upstream):
    return run_ok(upstream, "lora-ppo", **LORA_PPO)


@pytest.fixture(scope="module")
def lora_grpo(upstream):
    return run_ok(upstream, "lora-grpo", **LORA_GRPO)


def test_ppo_with_lora_refits_only_the_adapted_modules(upstream, lora_ppo):
    import peft
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    _, rows = upstream[0], upstream[2]
    _, result, stderr = lora_ppo
    assert "(LoRA rank 4: the refit sends the adapted modules' merged weights only)" in stderr
    out = local(result.output_uri)
    history = history_of(out)
    sft_dir = local(rows["sft"]["output_uri"])
    # Every refit sent exactly the adapted modules' weights, and the engine then sampled with the actor's
    # log-probs (the `auto` check on the next iteration's first minibatch: within 1e-4 or it recomputes).
    assert {row["refit/bytes"] for row in history} == {adapted_bytes(sft_dir, LORA["target_modules"])}
    assert all(row["rollout/old_logprobs_recomputed"] == 0.0 for row in history)
    # Iteration 1 samples from the untrained adapters (B = 0): the reference (adapters off) is the same model.
    assert abs(history[0]["kl/mean"]) < 1e-5 and history[-1]["kl/mean"] > 0.05  # then the policy moved
    # The adapters alone train: r * (in + out) per adapted module; a few % of the ~0.1M-parameter actor.
    assert result.metrics["perf/trainable_parameters"] == adapter_parameters(sft_dir, LORA)
    assert 0 < result.metrics["perf/trainable_share"] < 0.1
    policy = AutoModelForCausalLM.from_pretrained(out / "policy").eval()
    with_adapter = peft.PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(sft_dir), out / "policy" / "adapter"
    ).eval()
    ids = torch.randint(3, 300, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            policy(input_ids=ids).logits, with_adapter(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic")
    assert (
        critic.score.weight.shape[0] == 1 and (out / "critic" / "adapter" / "adapter_config.json").is_file()
    )


def test_lora_reference_logprobs_are_the_sft_models(upstream, lora_ppo):
    """The last iteration's reference log-probs (trained actor, adapters disabled) are those of the SFT model
    loaded on its own: the frozen base is exactly SFT, and no second model is needed.

    Tolerance: the same fp32 forward of the same batch; measured 0. The adapters left on would move them by
    about the final KL per token (kl/mean > 0.05 over a sequence, asserted above)."""
    from alignflow.stages.common.models.loading import load_causal_lm, load_tokenizer
    from alignflow.stages.common.tokenization import pad_token_id
    from alignflow.stages.ppo.experience import Experience, assemble, policy_logprobs

    _, _, rows = upstream
    spec, result, _ = lora_ppo
    sft_dir = local(rows["sft"]["output_uri"])
    frame = pd.read_parquet(local(result.output_uri) / "rollouts" / "iter_00004.parquet")
    pad = pad_token_id(load_tokenizer(sft_dir))
    input_ids, attention_mask, position_ids, response_ids, mask, width_p = assemble(
        [list(p) for p in frame["prompt_token_ids"]], [list(r) for r in frame["response_token_ids"]], pad
    )
    zeros = torch.zeros_like(mask)
    exp = Experience(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_ids=response_ids,
        response_mask=mask,
        rollout_logprobs=zeros,
        old_logprobs=zeros,
        ref_logprobs=zeros,
        values=None,
        scores=torch.zeros(len(frame)),
        token_rewards=zeros,
        kl=zeros,
        advantages=zeros,
        returns=None,
        prompt_width=width_p,
    )
    with torch.no_grad():
        sft_logprobs = policy_logprobs(
            load_causal_lm(sft_dir).eval(), exp, spec.config["ppo"]["temperature"]
        )[0]
    worst = max(
        float((torch.tensor(list(ref)) - sft_logprobs[b, : len(ref)]).abs().max())
        for b, ref in enumerate(frame["ref_logprobs"])
    )
    assert worst <= 1e-6, worst
    moved = max(
        float((torch.tensor(list(lp)) - torch.tensor(list(ref))).abs().max())
        for lp, ref in zip(frame["logprobs"], frame["ref_logprobs"], strict=True)
    )
    assert moved > 1e-2, "the policy that sampled iteration 4 should differ from the reference"


@pytest.mark.parametrize("run, iteration", [("lora_ppo", 2), ("lora_grpo", 1)])
def test_lora_run_resumed_from_a_checkpoint_repeats_the_uninterrupted_one(upstream, request, run, iteration):
    """A copy of the run's checkpoint in a fresh output: the resumed run loads the peft actor (and critic)
    and their optimizers, refits the engine with the adapted modules (the first refit), and samples the same
    tokens as the run that never stopped, with the engine's log-probs still the actor's."""
    workdir, _, _ = upstream
    spec, result, _ = request.getfixturevalue(run)
    name = f"iter_{iteration:05d}"
    resumed_spec = spec.model_copy(update={"output_uri": spec.output_uri + "-resumed"})
    shutil.copytree(
        local(result.output_uri) / "checkpoints" / name, local(resumed_spec.output_uri) / "checkpoints" / name
    )
    code, resumed, stderr = finish(start_stage(resumed_spec, workdir))
    assert code == 0, stderr[-3000:]
    first, again = local(result.output_uri), local(resumed_spec.output_uri)
    iterations = int(spec.config["ppo"]["iterations"])
    later = [f"iter_{i:05d}.parquet" for i in range(iteration + 1, iterations + 1)]
    assert sorted(p.name for p in (again / "rollouts").iterdir()) == later, (
        "it resumed: earlier ones never ran"
    )
    for file in later:
        before, after = pd.read_parquet(first / "rollouts" / file), pd.read_parquet(again / "rollouts" / file)
        assert (
            before["response_token_ids"].map(list).tolist() == after["response_token_ids"].map(list).tolist()
        )
    history = history_of(again)
    assert [row["iteration"] for row in history] == list(range(1, iterations + 1))
    assert all(row["rollout/old_logprobs_recomputed"] == 0.0 for row in history[iteration:])
    # Same tokens, same updates: the merged policies agree to fp32 noise (a lost optimizer state or adapter
    # would move them by about the learning rate, 5e-3, or more).
    expected, actual = (load_file(folder / "policy" / "model.safetensors") for folder in (first, again))
    assert expected.keys() == actual.keys()
    worst = max(float((expected[k] - actual[k]).abs().max()) for k in expected)
    assert worst <= 1e-6, worst


def test_grpo_with_lora_and_a_full_run_side_by_side(upstream, lora_grpo):
    _, result, stderr = lora_grpo
    full_spec, full, full_stderr = run_ok(upstream, "full-grpo", **{**LORA_GRPO, "lora": {"rank": 0}})
    full_rows, lora_rows = history_of(local(full.output_uri)), history_of(local(result.output_uri))
    assert lora_rows[-1]["refit/bytes"] < full_rows[-1]["refit/bytes"] / 2
    assert all(row["rollout/old_logprobs_recomputed"] == 0.0 for row in lora_rows)
    assert "(LoRA rank 4" in stderr and "(LoRA" not in full_stderr
    assert result.metrics["perf/trainable_share"] < 0.1 and full.metrics["perf/trainable_share"] == 1.0
    assert (local(result.output_uri) / "policy" / "adapter" / "adapter_model.safetensors").is_file()
    assert not (local(full.output_uri) / "policy" / "adapter").exists()


@pytest.mark.parametrize(
    "name, ppo, message",
    [
        (
            "lora-bad-target",
            {"lora": {"rank": 4, "target_modules": ["qkv"]}},
            "ppo.lora.target_modules: 'qkv' matches no linear layer of the model",
        ),
        (
            "lora-zero-3",
            {"lora": {"rank": 4}, "zero_stage": 3},
            "ppo.lora with ppo.zero_stage 3: merging the adapters needs whole weights; use zero_stage 2",
        ),
    ],
)
def test_bad_lora_settings_are_one_line_errors(upstream, name, ppo, message):
    workdir, _, _ = upstream
    code, result, _ = finish(start_stage(ppo_spec(upstream, name, **ppo), workdir))
    assert code == 2
    assert result.message.startswith(message), result.message


@pytest.mark.heavy
def test_compiled_lora_backbone_trains_like_eager_and_its_reference_is_the_base(tmp_path):
    """ppo.compile_train with LoRA compiles the HF backbone under the peft wrapper (its LoRA layers inside):
    the loss and the adapters' gradients are eager's, and the reference forward (adapters disabled: a flag
    dynamo guards on, so it compiles a second graph) is the SFT model's.

    Tolerance: inductor fuses and reorders fp32 sums (~2e-6 measured on the logits); 1e-4 relative catches
    the adapters being skipped or left on (logits move by ~1)."""
    from alignflow.config import LoRAConfig
    from alignflow.stages.common.models.loading import load_causal_lm
    from alignflow.stages.common.training.lora import AdaptersDisabled, apply_lora, unwrap_lora
    from alignflow.stages.ppo import losses as rl
    from alignflow.stages.ppo.experience import Experience, assemble, policy_logprobs
    from tests.stages.common.generation.engine_test_models import random_prompts, save_tiny_model

    checkpoint = save_tiny_model(tmp_path / "llama", "llama_mha_untied")
    cfg = LoRAConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    eager = apply_lora(load_causal_lm(checkpoint), cfg, "ppo.lora")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # non-zero B: a trained adapter (peft starts B at 0, the base's own outputs)
        for name, param in eager.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    compiled = apply_lora(load_causal_lm(checkpoint), cfg, "ppo.lora")
    compiled.load_state_dict(eager.state_dict())
    unwrap_lora(compiled).base_model.compile(dynamic=True)
    sft = load_causal_lm(checkpoint).eval()

    prompts = random_prompts(4, seed=3)
    responses = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in (5, 9, 2, 7)]
    input_ids, attention_mask, position_ids, response_ids, mask, width_p = assemble(prompts, responses, 0)
    zeros = torch.zeros_like(mask)
    exp = Experience(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_ids=response_ids,
        response_mask=mask,
        rollout_logprobs=zeros,
        old_logprobs=zeros,
        ref_logprobs=zeros,
        values=None,
        scores=torch.zeros(4),
        token_rewards=zeros,
        kl=zeros,
        advantages=torch.linspace(-1, 1, mask.numel()).reshape(mask.shape) * mask,
        returns=None,
        prompt_width=width_p,
    )
    with torch.no_grad():
        exp.old_logprobs = policy_logprobs(eager, exp, 1.0)[0] - 0.05 * mask  # some tokens clip
        base = policy_logprobs(sft, exp, 1.0)[0]
    losses, grads = [], []
    for model in (eager, compiled):
        model.zero_grad(set_to_none=True)
        loss, _ = rl.policy_loss_ppo(
            policy_logprobs(model, exp, 1.0)[0], exp.old_logprobs, exp.advantages, mask, clip_range=0.2
        )
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert math.isclose(losses[0], losses[1], rel_tol=1e-4, abs_tol=1e-7)
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0])
    scale = max(float(g.abs().max()) for g in grads[0].values())
    assert max(float((grads[0][n] - grads[1][n]).abs().max()) for n in grads[0]) <= 1e-4 * scale
    with torch.no_grad():
        reference = policy_logprobs(AdaptersDisabled(compiled), exp, 1.0)[0]
        torch.testing.assert_close(reference, base, rtol=0, atol=1e-4)
        assert float((policy_logprobs(compiled, exp, 1.0)[0] - base).abs().max()) > 1e-2  # adapters back on
