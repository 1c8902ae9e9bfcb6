"""Config schema: shipped YAMLs validate, overrides apply, and errors name key, value and choices."""

from __future__ import annotations

from pathlib import Path

import pytest

from alignflow.config import (
    ConfigError,
    PipelineConfig,
    apply_overrides,
    flatten,
    load_config,
    validate_config,
)
from alignflow.flows.plan import plan

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


def test_there_are_shipped_configs():
    assert any(p.name == "tiny.yaml" for p in SHIPPED)
    assert len(SHIPPED) >= 2, "a realistic GPU example config must ship beside tiny.yaml"


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_validates(path):
    config = load_config(path)
    assert isinstance(config, PipelineConfig)


def test_overrides_apply_and_parse_types():
    config = load_config(REPO / "configs/tiny.yaml", ["sft.lr=1e-4", "storage.root=s3://bucket/prefix",
                                                      "reward.epochs=3", "engine.compile=true"])
    assert config.sft.lr == pytest.approx(1e-4)
    assert config.storage.root == "s3://bucket/prefix"
    assert config.reward.epochs == 3.0
    assert config.engine.compile is True


def test_unknown_key_is_named_with_the_valid_keys():
    with pytest.raises(ConfigError) as err:
        validate_config({"sft": {"lrr": 0.1}}, source="my.yaml")
    text = str(err.value)
    assert text.startswith("my.yaml: 1 config error(s):")
    assert "sft.lrr: unknown key (remove it or check its spelling; valid keys: lr, weight_decay," in text


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError) as err:
        validate_config({"sft": {"epochs": "many"}})
    assert (
        'sft.epochs: Input should be a valid number, unable to parse string as a number (got "many")'
        in str(err.value)
    )


def test_bad_choice_lists_valid_choices():
    with pytest.raises(ConfigError) as err:
        validate_config({"engine": {"backend": "fast"}})
    assert "engine.backend: Input should be 'native', 'hf', 'vllm' or 'tensorrt-llm' (got \"fast\")" in str(
        err.value
    )


def test_all_errors_reported_together():
    with pytest.raises(ConfigError) as err:
        validate_config({"sft": {"lr": -1, "bogus": 1}, "ppo": {"top_p": 2}})
    text = str(err.value)
    assert "3 config error(s)" in text
    assert "sft.lr:" in text and "sft.bogus:" in text and "ppo.top_p:" in text


def test_unknown_top_level_section():
    with pytest.raises(
        ConfigError,
        match=r"sftt: unknown key .*valid keys: name, workdir, stages, max_parallel_stages, storage",
    ):
        validate_config({"sftt": {}})


def test_stage_dependencies_checked():
    with pytest.raises(ConfigError, match="stage 'ppo' needs 'engine'"):
        validate_config({"stages": ["data", "base", "sft", "reward", "ppo"]})


def test_grpo_on_reward_functions_alone_needs_no_reward_stage():
    grpo = {
        "algorithm": "grpo",
        "group_size": 4,
        "reward_functions": ["alignflow.stages.ppo.reward_functions:letter_share"],
    }
    config = validate_config({"stages": ["data", "base", "sft", "engine", "ppo"], "ppo": grpo})
    assert [call.key for call in plan(config)] == ["data", "base", "sft", "engine", "ppo"]
    assert plan(config)[-1].inputs == {"engine": "engine", "sft": "sft", "data": "data"}
    # PPO's critic starts from a reward model
    with pytest.raises(ConfigError, match="stage 'ppo' needs 'reward'"):
        validate_config(
            {"stages": ["data", "base", "sft", "engine", "ppo"], "ppo": {**grpo, "algorithm": "ppo"}}
        )
    with pytest.raises(ConfigError, match="stage 'ppo' needs 'reward'"):  # GRPO with nothing to score it
        validate_config(
            {
                "stages": ["data", "base", "sft", "engine", "ppo"],
                "ppo": {"algorithm": "grpo", "group_size": 4},
            }
        )
    # The evaluate stage scores with reward models where there are some, with the gold scorer and KL always.
    config = validate_config({"stages": ["data", "base", "sft", "engine", "ppo", "evaluate"], "ppo": grpo})
    assert plan(config)[-1].inputs == {"ppo": "ppo", "sft": "sft", "data": "data"}


def before_ppo_identity(config) -> dict:
    return next(c for c in plan(config) if c.key == "ppo").identity()


def test_how_the_rl_stage_runs_the_engine_does_not_rebuild_it():
    """engine.rollout_workers and its kin reach the RL stage only:
    the engine and evaluate calls are unchanged."""
    base = validate_config({})
    workers = validate_config(
        {"engine": {"rollout_workers": 2, "queue_chunk": 4, "unload_during_training": True}}
    )
    before, after = ({call.key: call.config for call in plan(c)} for c in (base, workers))
    assert after["engine"] == before["engine"] and after["evaluate"] == before["evaluate"]
    assert after["ppo"]["engine"]["rollout_workers"] == 2 and after["ppo"] != before["ppo"]
    # The native engine is saved whole and split by the rollout workers: its tensor_parallel_size reaches the
    # RL stage only, and the engine stage's key is the one-process run's (the cached engine is reused).
    tp = {
        call.key: call.config
        for call in plan(validate_config({"engine": {"rollout_workers": 1, "tensor_parallel_size": 2}}))
    }
    assert tp["engine"] == before["engine"] and tp["evaluate"] == before["evaluate"]
    assert tp["ppo"]["engine"]["tensor_parallel_size"] == 2
    # Where the RL stage runs is not part of its output's key: its checkpoints resume on other machines.
    placed = validate_config({"ppo": {"minibatch_size": 8, "resources": {"nproc_per_node": 2}},
                              "engine": {"rollout_workers": 2, "tensor_parallel_size": 2, "queue_chunk": 4}})
    assert next(c for c in plan(placed) if c.key == "ppo").identity() == next(
        c for c in plan(validate_config({"ppo": {"minibatch_size": 8}})) if c.key == "ppo").identity()
    seeded = validate_config({"ppo": {"seed": 5}})
    assert next(c for c in plan(seeded) if c.key == "ppo").identity() != before_ppo_identity(base)
    assert validate_config({"engine": {"max_seq_len": 512}}).engine.max_seq_len == 512
    assert {call.key: call.config for call in plan(validate_config({"engine": {"max_seq_len": 512}}))}[
        "engine"
    ] != before["engine"]


def test_dpo_pipeline_needs_no_reward_model_or_engine():
    config = validate_config({"stages": ["data", "base", "sft", "dpo", "evaluate"]})
    assert [call.key for call in plan(config)] == ["data", "base", "sft", "dpo", "evaluate"]
    assert plan(config)[-2].inputs == {"sft": "sft", "data": "data"}
    assert plan(config)[-1].inputs == {"dpo": "dpo", "sft": "sft", "data": "data"}
    with pytest.raises(ConfigError, match="'ppo' and 'dpo' both train the policy"):
        validate_config({"stages": ["data", "base", "sft", "reward", "engine", "ppo", "dpo", "evaluate"]})
    with pytest.raises(ConfigError, match="stage 'evaluate' needs a policy stage: 'ppo' or 'dpo'"):
        validate_config({"stages": ["data", "base", "sft", "evaluate"]})
    with pytest.raises(ConfigError, match="list them in pipeline order: data, base, sft, dpo"):
        validate_config({"stages": ["data", "base", "dpo", "sft"]})


def test_bad_dpo_and_lora_settings_name_the_key():
    with pytest.raises(ConfigError, match=r"dpo.beta: Input should be greater than 0 \(got 0\)"):
        validate_config({"dpo": {"beta": 0}})
    with pytest.raises(ConfigError, match="dpo.label_smoothing must be > 0 when dpo.loss is 'cdpo'"):
        validate_config({"dpo": {"loss": "cdpo"}})
    with pytest.raises(ConfigError, match=r"dpo.loss: Input should be 'sigmoid', 'ipo' or 'cdpo'"):
        validate_config({"dpo": {"loss": "kto"}})
    with pytest.raises(ConfigError, match=r"sft.lora.rank: Input should be greater than or equal to 0"):
        validate_config({"sft": {"lora": {"rank": -1}}})
    assert validate_config({"ppo": {"lora": {"rank": 8}}}).ppo.lora.enabled


def test_resources_of_a_training_stage():
    config = validate_config(
        {
            "sft": {"resources": {"nproc_per_node": 2}},
            "reward": {
                "resources": {"nproc_per_node": 4, "nnodes": 2, "rdzv_endpoint": "trainer-0.alignflow:29400"}
            },
        }
    )
    assert (
        config.sft.resources.world_size,
        config.reward.resources.world_size,
        config.dpo.resources.world_size,
    ) == (2, 8, 1)
    with pytest.raises(ConfigError, match=r"resources.nnodes=2 needs resources.rdzv_endpoint"):
        validate_config({"sft": {"resources": {"nnodes": 2}}})
    with pytest.raises(ConfigError, match=r"sft.resources.rdzv_endpoint: String should match pattern"):
        validate_config({"sft": {"resources": {"nnodes": 2, "rdzv_endpoint": "no port"}}})


def test_rl_trainer_ranks_need_equal_shares_on_any_number_of_nodes():
    two = {"nproc_per_node": 2}
    assert validate_config({"ppo": {"minibatch_size": 8, "resources": two}}).ppo.resources.world_size == 2
    with pytest.raises(ConfigError, match=r"ppo.minibatch_size=9 must be a multiple of the 2 trainer ranks"):
        validate_config({"ppo": {"minibatch_size": 9, "prompts_per_iteration": 18, "resources": two}})
    with pytest.raises(ConfigError, match=r"divide the 12 rollouts of an iteration"):
        validate_config({"ppo": {"minibatch_size": 8, "prompts_per_iteration": 12, "resources": two}})
    nodes = {"nnodes": 2, "nproc_per_node": 2, "rdzv_endpoint": "trainer-0.alignflow:29400"}
    assert validate_config({"ppo": {"minibatch_size": 8, "resources": nodes}}).ppo.resources.world_size == 4
    with pytest.raises(ConfigError, match=r"ppo.minibatch_size=6 must be a multiple of the 4 trainer ranks"):
        validate_config({"ppo": {"minibatch_size": 6, "prompts_per_iteration": 12, "resources": nodes}})


def test_unquoted_yaml_off_means_autocast_off():
    assert load_config(REPO / "configs/tiny.yaml", ["ppo.autocast=off"]).ppo.autocast == "off"  # YAML: false
    ppo = load_config(
        REPO / "configs/tiny.yaml", ["ppo.critic_process=off", "ppo.overlap_passes=on"]
    ).ppo  # and true
    assert (ppo.critic_process, ppo.overlap_passes) == ("off", "on")
    with pytest.raises(
        ConfigError, match=r"ppo.autocast: Input should be 'auto', 'bf16' or 'off' \(got true\)"
    ):
        load_config(REPO / "configs/tiny.yaml", ["ppo.autocast=on"])


def test_override_into_value_is_rejected():
    with pytest.raises(ConfigError, match="'lr' is a value, not a section"):
        apply_overrides({"sft": {"lr": 1}}, ["sft.lr.x=2"])


def test_override_without_equals_is_rejected():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["sft.lr"])


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_flatten_makes_dotted_params():
    flat = flatten(PipelineConfig().model_dump(mode="json"))
    assert flat["sft.lr"] == PipelineConfig().sft.lr
    assert flat["model.tiny.hidden_size"] == 64
    assert flat["reward.models"].startswith("[")


def test_grpo_needs_groups():
    with pytest.raises(ConfigError, match="group_size must be >= 2"):
        validate_config({"ppo": {"algorithm": "grpo", "group_size": 1}})
