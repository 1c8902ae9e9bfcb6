"""LoRA in the SFT and reward stages: only adapters in the optimiser, merged HF checkpoints, adapter files."""

from __future__ import annotations

import pytest
import torch

from alignflow.contract import StageSpec
from alignflow.manifest import output_uri
from alignflow.stages.common.models.loading import load_sequence_classifier
from tests.stages.ppo.test_ppo import finish, local, start_stage

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 8,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def stage_spec(upstream, stage: str, section: dict, inputs: dict[str, str]) -> StageSpec:
    workdir, config, rows = upstream
    config_part = {**section, "model": config.model.model_dump(mode="json")}
    return StageSpec(stage=stage, config=config_part,
                     inputs={k: rows[v]["output_uri"] for k, v in inputs.items()},
                     input_digests={k: rows[v]["manifest_digest"] for k, v in inputs.items()},
                     output_uri=output_uri(f"file://{workdir}/tests", stage, {"lora": True, **config_part},
                                           {}, "t"),
                     code_version="test", workdir=str(workdir))


def test_sft_with_lora_learns_and_publishes_a_merged_checkpoint(upstream):
    import peft
    from transformers import AutoModelForCausalLM

    workdir, config, rows = upstream
    sft = {**config.sft.model_dump(mode="json"), "lr": 1e-2, "lora": LORA}
    spec = stage_spec(upstream, "sft", {"sft": sft}, {"base": "base", "data": "data"})
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    assert 0 < result.metrics["perf/trainable_share"] < 0.2
    # From a random-init base with the (tied) embeddings frozen, rank-4 adapters lower the loss by ~0.1 nats
    # in these 27 steps (full SFT: ~2 nats); untrained adapters (B = 0) would leave it exactly where it
    # started.
    assert result.metrics["eval/loss"] < result.metrics["eval/loss_initial"] - 0.05
    out = local(result.output_uri)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    base = AutoModelForCausalLM.from_pretrained(local(rows["base"]["output_uri"])).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    ids = torch.randint(3, 300, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, with_adapter(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


def test_reward_model_with_lora_trains_its_head_whole(upstream):
    from transformers import AutoModelForSequenceClassification

    workdir, config, rows = upstream
    reward = {k: v for k, v in config.reward.model_dump(mode="json").items() if k != "models"}
    section = {"reward": {**reward, "lr": 1e-2, "lora": LORA},
               "reward_model": config.reward.models[0].model_dump(mode="json")}
    spec = stage_spec(upstream, "reward", section, {"sft": "sft", "data": "data"})
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    assert 0 < result.metrics["perf/trainable_share"] < 0.2
    # (Accuracy is no test here: this 9-step, 144-pair reward model is at chance with full fine-tuning too.)
    out = local(result.output_uri)
    model = AutoModelForSequenceClassification.from_pretrained(out)
    initial = load_sequence_classifier(local(rows["sft"]["output_uri"]), seed=config.reward.models[0].seed)
    sft_layer, lora_layer = initial.model.layers[0], model.model.layers[0]
    assert not torch.equal(model.score.weight, initial.score.weight)  # the head trained whole
    # The adapters are merged into the weights.
    assert not torch.equal(lora_layer.self_attn.q_proj.weight, sft_layer.self_attn.q_proj.weight)
    torch.testing.assert_close(model.model.embed_tokens.weight, initial.model.embed_tokens.weight,
                               rtol=0, atol=0)
    assert (out / "adapter" / "adapter_config.json").is_file()
