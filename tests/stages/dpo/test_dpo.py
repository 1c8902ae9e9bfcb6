"""The DPO stage as a program: it learns the preferences, starts from the reference, merges LoRA weights."""

from __future__ import annotations

import json
import math

import pytest
import torch

from alignflow.config import DPOConfig
from alignflow.contract import StageSpec
from alignflow.manifest import output_uri, read_manifest
from alignflow.stages.common.models.loading import load_tokenizer
from alignflow.stages.data.formats import PreferenceRecord
from alignflow.stages.dpo.stage import encode_pairs
from tests.stages.ppo.test_ppo import finish, local, stage_device, start_stage

pytestmark = pytest.mark.slow

DPO_TEST = {"epochs": 2, "batch_size": 16, "micro_batch_size": 8, "max_length": 64, "eval_every": 4,
            "warmup_steps": 2, "lr": 2e-3}


def dpo_spec(upstream, name: str, **dpo) -> StageSpec:
    workdir, config, rows = upstream
    section = {"dpo": DPOConfig(**{**DPO_TEST, **dpo}).model_dump(mode="json"),
               "model": config.model.model_dump(mode="json")}
    inputs = {"sft": "sft", "data": "data"}
    return StageSpec(stage="dpo", config=section,
                     inputs={k: rows[v]["output_uri"] for k, v in inputs.items()},
                     input_digests={k: rows[v]["manifest_digest"] for k, v in inputs.items()},
                     output_uri=output_uri(f"file://{workdir}/tests", "dpo", {"name": name, **section}, {},
                                           "t"),
                     code_version="test", workdir=str(workdir))


def test_dpo_learns_the_preferences_from_the_reference(upstream, request):
    workdir, _, _ = upstream
    spec = dpo_spec(upstream, "dpo-sigmoid")
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    assert result.devices == {"train": stage_device(request)}  # the policy trained where the session computes
    out = local(result.output_uri)
    listed = {entry.path for entry in read_manifest(result.output_uri).files}
    assert {"policy/config.json", "policy/model.safetensors", "metrics.jsonl", "alignflow_run.json"} <= listed
    history = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = int(result.metrics["train/steps"])
    assert [row["step"] for row in history] == list(range(1, steps + 1))
    # Before the first update the policy is the reference: every margin is 0 and the sigmoid loss is log 2.
    assert result.metrics["eval/loss_initial"] == pytest.approx(math.log(2), abs=1e-6)
    assert result.metrics["eval/loss"] < result.metrics["eval/loss_initial"] - 0.02
    assert result.metrics["eval/rewards_accuracy"] > 0.6
    assert result.metrics["eval/rewards_margin"] > 0
    assert result.metrics["perf/trainable_share"] == 1.0
    run = json.loads((out / "alignflow_run.json").read_text())
    assert run["algorithm"] == "dpo" and run["steps"] == steps and run["loss"] == "sigmoid"
    assert (out / "policy" / "config.json").is_file() and not (out / "policy" / "adapter").exists()
    assert "dpo: sigmoid loss, beta 0.1" in stderr


def test_dpo_with_lora_publishes_merged_weights_equal_to_base_plus_adapter(upstream):
    import peft
    from transformers import AutoModelForCausalLM

    workdir, _, rows = upstream
    spec = dpo_spec(upstream, "dpo-ipo-lora", loss="ipo",
                    lora={"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]})
    code, result, stderr = finish(start_stage(spec, workdir))
    assert code == 0, stderr[-3000:]
    assert 0 < result.metrics["perf/trainable_share"] < 0.15
    assert "(LoRA rank 4)" in stderr
    policy_dir = local(result.output_uri) / "policy"
    merged = AutoModelForCausalLM.from_pretrained(policy_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(local(rows["sft"]["output_uri"])).eval()
    with_adapter = peft.PeftModel.from_pretrained(base, policy_dir / "adapter").eval()
    ids = torch.randint(3, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = with_adapter(input_ids=ids).logits
        torch.testing.assert_close(merged(input_ids=ids).logits, expected, rtol=1e-5, atol=1e-5)
        # The adapters were trained: the merged policy is not the SFT policy.
        with with_adapter.disable_adapter():
            assert (expected - with_adapter(input_ids=ids).logits).abs().max() > 1e-3


@pytest.mark.parametrize("dpo, message", [
    ({"lora": {"rank": 4, "target_modules": ["q_proj", "query"]}},
     "dpo.lora.target_modules: 'query' matches no linear layer of the model"),
    ({"max_length": 8}, "dpo: no usable preference pair in preferences_train.jsonl"),
])
def test_bad_dpo_settings_are_one_line_errors(upstream, dpo, message):
    workdir, _, _ = upstream
    code, result, stderr = finish(start_stage(dpo_spec(upstream, f"bad-{sorted(dpo)[0]}", **dpo), workdir))
    assert code == 2 and message in result.message, (result.message, stderr[-2000:])


def test_identical_and_overlong_pairs_are_dropped_and_counted(upstream):
    _, _, rows = upstream
    tokenizer = load_tokenizer(local(rows["sft"]["output_uri"]))
    records = [PreferenceRecord(prompt="write about cats", chosen="cats purr", rejected="dogs bark"),
               PreferenceRecord(prompt="write about cats", chosen="same", rejected="same"),
               PreferenceRecord(prompt="write about cats " * 40, chosen="a", rejected="b")]
    pairs, dropped = encode_pairs(tokenizer, records, max_length=48)
    assert len(pairs) == 1 and dropped == {"identical": 1, "no_room": 1}
    assert pairs[0].chosen[-1] == tokenizer.eos_token_id and len(pairs[0].prompt) + len(pairs[0].chosen) <= 48
