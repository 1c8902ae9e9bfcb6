"""The stages refuse a config that cannot start with the very message `alignflow validate` / `plan` print for
it: each stage, given the spec the flow would give it, raises before it loads anything
(alignflow/start_checks.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from alignflow.config import DPOConfig, RewardConfig, SFTConfig, validate_config
from alignflow.contract import StageSpec
from alignflow.flows.plan import plan, start_problems
from alignflow.stages.common.runtime import StageInputError

TINY = {"model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "num_key_value_heads": 1}}}


def planned(tmp_path, stage: str, **sections):
    """(the spec the flow would give `stage`,
    the planner's messages for it) for the default pipeline + sections."""
    config = validate_config({**TINY, "workdir": str(tmp_path), **sections})
    call = next(c for c in plan(config) if c.stage == stage)
    messages = [p.message for p in start_problems(config) if p.stage == call.key]
    spec = StageSpec(
        stage=stage,
        config=call.config,
        output_uri=f"file://{tmp_path}/out",
        inputs={name: f"file://{tmp_path}/missing-{name}" for name in call.inputs},
    )
    return spec, messages


RL_CASES = {
    "tensor parallel without workers": {"engine": {"tensor_parallel_size": 2}},
    "vllm without workers": {"engine": {"backend": "vllm"}},
    "unload with async": {"engine": {"unload_during_training": True}, "ppo": {"async_rollouts": True}},
    "lora with zero 3": {"ppo": {"lora": {"rank": 4}, "zero_stage": 3}},
    "torch backend with ranks": {"ppo": {"train_backend": "torch", "resources": {"nproc_per_node": 2}}},
    "tensor parallel vllm replicas": {
        "engine": {"backend": "vllm", "tensor_parallel_size": 2, "rollout_workers": 2}
    },
    "no room for a prompt": {"ppo": {"max_new_tokens": 300}},
}


@pytest.mark.parametrize("case", sorted(RL_CASES))
def test_the_rl_stage_says_what_the_planner_said(tmp_path, case):
    from alignflow.stages.ppo import stage as ppo

    spec, messages = planned(tmp_path, "ppo", **RL_CASES[case])
    assert messages, "the planner finds the problem"
    with pytest.raises(StageInputError) as refused:
        ppo.run(spec)
    assert str(refused.value) == messages[0]


def test_the_engine_stage_says_what_the_planner_said(tmp_path):
    from alignflow.stages import engine

    spec, messages = planned(
        tmp_path, "engine", engine={"backend": "vllm", "tensor_parallel_size": 2, "rollout_workers": 2}
    )
    with pytest.raises(StageInputError) as refused:
        engine.run(spec)
    assert [str(refused.value)] == messages


def test_the_evaluate_stage_says_what_the_planner_said(tmp_path):
    from alignflow.stages import evaluate

    spec, messages = planned(tmp_path, "evaluate", evaluate={"max_new_tokens": 256})
    with pytest.raises(StageInputError) as refused:
        evaluate.run(spec)
    assert [str(refused.value)] == messages
    with pytest.raises(StageInputError) as refused:
        evaluate.policy_input({"sft": "x"})
    assert str(refused.value).startswith("stage 'evaluate' needs a policy input")


@pytest.mark.parametrize(
    ("stage", "model", "sections"),
    [
        (
            "sft",
            SFTConfig,
            {"sft": {"batch_size": 24, "micro_batch_size": 8, "resources": {"nproc_per_node": 2}}},
        ),
        ("sft", SFTConfig, {"sft": {"lora": {"rank": 4}, "zero_stage": 3}}),
        ("reward", RewardConfig, {"reward": {"batch_size": 30}}),
        (
            "dpo",
            DPOConfig,
            {
                "dpo": {"lora": {"rank": 4}, "zero_stage": 3},
                "stages": ["data", "base", "sft", "dpo", "evaluate"],
            },
        ),
    ],
)
def test_the_supervised_stages_say_what_the_planner_said(tmp_path, stage, model, sections):
    from alignflow.stages.common.training.loop import check_training_section

    spec, messages = planned(tmp_path, stage, **sections)
    with pytest.raises(StageInputError) as refused:
        check_training_section(model.model_validate(spec.config[stage]), stage)
    assert [str(refused.value)] == messages


def test_the_torch_trainer_says_what_the_planner_said(tmp_path, monkeypatch):
    from alignflow.stages.common.training.plain_trainer import resolve_train_backend

    _, messages = planned(tmp_path, "ppo", ppo={"train_backend": "torch", "zero_stage": 2})
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError) as refused:
        resolve_train_backend("torch", 2)
    assert [str(refused.value)] == messages


def test_the_base_stage_says_what_the_planner_said(tmp_path):
    from alignflow.stages.base_model import _import_dir

    spec, messages = planned(tmp_path, "base", model={**TINY["model"], "base": "no/such/model"})
    with pytest.raises(StageInputError) as refused:
        _import_dir(SimpleNamespace(spec=SimpleNamespace(workdir=str(tmp_path))), "no/such/model")
    assert [str(refused.value)] == messages
    (tmp_path / "no/such/model").mkdir(parents=True)
    assert (
        _import_dir(SimpleNamespace(spec=SimpleNamespace(workdir=str(tmp_path))), "no/such/model")
        == tmp_path / "no/such/model"
    )


def test_the_base_stage_refuses_pickle_weights_as_the_planner_does(tmp_path):
    from alignflow.stages.base_model import _import_dir

    folder = tmp_path / "models/bin"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"not read: the check looks at names")
    ctx = SimpleNamespace(spec=SimpleNamespace(workdir=str(tmp_path)))
    _, messages = planned(tmp_path, "base", model={**TINY["model"], "base": "models/bin"})
    assert messages == [
        f"model.base: {folder}: refusing to load pickle files (pytorch_model.bin): unpickling runs any code "
        "their author put in them; convert them to safetensors (load and save_pretrained them where you "
        "trust the source), or set model.allow_pickle=true if you trust the source"
    ]
    with pytest.raises(StageInputError) as refused:
        _import_dir(ctx, "models/bin")
    assert [str(refused.value)] == messages
    allowed = {**TINY["model"], "base": "models/bin", "allow_pickle": True}
    assert planned(tmp_path, "base", model=allowed)[1] == []
    assert _import_dir(ctx, "models/bin", allow_pickle=True) == folder
