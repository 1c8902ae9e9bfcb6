"""LoRA in the RL stage: only adapted modules refit (exactly: the engine's log-probs stay the actor's), the
reference is the adapter-free base, merged policy and critic checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from tests.stages.test_ppo import finish, local, ppo_spec, start_stage

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj", "down_proj"]}


def adapted_bytes(sft_dir, target_modules: list[str]) -> int:
    """Bytes of the fp32 weights of every module LoRA adapts (what a LoRA refit must send)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(sft_dir)
    return sum(module.weight.numel() * 4 for name, module in model.named_modules()
               if name.rsplit(".", 1)[-1] in target_modules)


def test_ppo_with_lora_refits_only_the_adapted_modules(upstream):
    import peft
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    workdir, _, rows = upstream
    # kl_coef > 0: the reference (the actor with its adapters off) is used every iteration.
    spec = ppo_spec(upstream, "lora-ppo", lora=LORA, kl_coef=0.1, actor_lr=5e-3, critic_lr=5e-3)
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    assert "(LoRA rank 4: the refit sends the adapted modules' merged weights only)" in stderr
    out = local(result.output_uri)
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    sft_dir = local(rows["sft"]["output_uri"])
    # Every refit sent exactly the adapted modules' weights, and the engine then sampled with the actor's
    # log-probs (the `auto` check on the next iteration's first minibatch: within 1e-4 or it recomputes).
    assert {row["refit/bytes"] for row in history} == {adapted_bytes(sft_dir, LORA["target_modules"])}
    assert all(row["rollout/old_logprobs_recomputed"] == 0.0 for row in history)
    # Iteration 1 samples from the untrained adapters (B = 0): the reference (adapters off) is the same model.
    assert abs(history[0]["kl/mean"]) < 1e-5 and history[-1]["kl/mean"] > 0.05  # then the policy moved
    policy = AutoModelForCausalLM.from_pretrained(out / "policy").eval()
    with_adapter = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sft_dir),
                                                  out / "policy" / "adapter").eval()
    ids = torch.randint(3, 300, (2, 15), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(policy(input_ids=ids).logits, with_adapter(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic")
    assert critic.score.weight.shape[0] == 1 and (out / "critic" / "adapter" / "adapter_config.json").is_file()


def test_grpo_with_lora_and_a_full_run_side_by_side(upstream):
    workdir, _, _ = upstream
    grpo = {"algorithm": "grpo", "group_size": 4, "prompts_per_iteration": 4, "minibatch_size": 16, "kl_coef": 0.0,
            "iterations": 2, "checkpoint_every": 2}
    full = finish(start_stage(ppo_spec(upstream, "full-grpo", reward_model=True, **grpo), workdir))
    lora = finish(start_stage(ppo_spec(upstream, "lora-grpo", reward_model=True, lora=LORA, **grpo), workdir))
    for code, _, stderr in (full, lora):
        assert code == 0, stderr[-3000:]
    full_rows, lora_rows = ([json.loads(line) for line in (local(r.output_uri) / "metrics.jsonl").read_text()
                             .splitlines()] for _, r, _ in (full, lora))
    assert lora_rows[-1]["refit/bytes"] < full_rows[-1]["refit/bytes"] / 2
    assert "(LoRA rank 4" in lora[2] and "(LoRA" not in full[2]


def test_unknown_lora_target_is_a_one_line_error(upstream):
    workdir, _, _ = upstream
    code, result, _ = finish(start_stage(ppo_spec(upstream, "lora-bad", lora={"rank": 4, "target_modules": ["qkv"]}),
                                         workdir))
    assert code == 2
    assert result.message.startswith("ppo.lora.target_modules: 'qkv' matches no linear layer of the model"), \
        result.message
