"""Start checks: every shipped config starts; each check a stage makes when it starts fails its config in
`alignflow validate` / `alignflow plan`, with the stage's message, its stage and key, all problems
together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from alignflow import start_checks
from alignflow.config import EngineConfig, EvaluateConfig, PPOConfig, load_config, validate_config
from alignflow.flows.plan import machine_findings, plan, start_problems

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted((REPO / "configs").glob("*.yaml"))


def config_with(tmp_path: Path, **sections) -> Path:
    """configs/tiny.yaml with `sections` merged in (one level deep), written to tmp_path (its workdir)."""
    data = yaml.safe_load((REPO / "configs/tiny.yaml").read_text())
    data["workdir"] = str(tmp_path)
    for name, values in sections.items():
        if isinstance(values, dict):
            data.setdefault(name, {}).update(values)
        else:
            data[name] = values
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def problems_of(path: Path) -> list[tuple[str, str, str]]:
    return [(p.stage, p.key, p.message) for p in start_problems(load_config(path))]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_every_shipped_config_starts(path, main, capsys):
    config = load_config(path)
    assert [c.stage for c in plan(config)], "the config runs no stage"
    assert start_problems(config) == []
    assert main(["validate", str(path)]) == 0
    assert main(["plan", str(path)]) == 0
    err = capsys.readouterr().err
    assert "error" not in err, err


def test_the_gpu_config_describes_its_node():
    """8 GPUs: SFT and the reward models on 8 ranks with ZeRO-3,
    PPO 4 trainer ranks + 4 vLLM replicas x TP 1."""
    config = load_config(REPO / "configs/llama3-8b-gpu.yaml")
    assert config.model.device == "cuda"
    assert config.sft.resources.world_size == config.reward.resources.world_size == 8
    assert config.sft.zero_stage == config.reward.zero_stage == config.ppo.zero_stage == 3
    engine, ppo = config.engine, config.ppo
    assert engine.backend == "vllm" and engine.rollout_workers >= 1
    assert ppo.resources.world_size + engine.rollout_workers * engine.tensor_parallel_size == 8
    assert config.max_parallel_stages == 1, "stages that each take the whole node run one at a time"


# ----------------------------------------------------------------------------------------------
# Each check, through a crafted config: the planner names the stage, the key and the stage's message
# ----------------------------------------------------------------------------------------------

TP_MESSAGE = (
    "engine.tensor_parallel_size=2 with engine.rollout_workers=0: tensor-parallel engines run in rollout "
    "workers; set engine.rollout_workers >= 1 (replicas of tensor_parallel_size processes each)"
)
VLLM_MESSAGE = (
    "engine.backend: vllm with engine.rollout_workers=0: the vLLM engine runs in rollout worker "
    "processes, never in the trainer's; set engine.rollout_workers >= 1"
)


def test_tensor_parallel_engine_without_rollout_workers(tmp_path):
    # A native build is planned at tensor_parallel_size 1 (the workers split it): only the RL stage refuses.
    assert problems_of(config_with(tmp_path, engine={"tensor_parallel_size": 2})) == [
        ("ppo", "engine.rollout_workers", TP_MESSAGE)
    ]
    assert problems_of(config_with(tmp_path, engine={"tensor_parallel_size": 2, "rollout_workers": 2})) == []


def test_vllm_without_rollout_workers(tmp_path):
    assert problems_of(config_with(tmp_path, engine={"backend": "vllm"})) == [
        ("ppo", "engine.rollout_workers", VLLM_MESSAGE)
    ]


def test_tensor_parallel_vllm_replicas(tmp_path):
    """The engine stage builds one process's engine, and the rollout workers split only native engines."""
    found = problems_of(
        config_with(tmp_path, engine={"backend": "vllm", "tensor_parallel_size": 2, "rollout_workers": 2})
    )
    assert found == [
        (
            "engine",
            "engine.tensor_parallel_size",
            "engine.tensor_parallel_size=2: the engine stage builds a one-process engine; tensor-parallel "
            "replicas run in the RL stage's rollout workers (engine.backend: native, engine.rollout_workers "
            ">= 1): set engine.tensor_parallel_size: 1 in this stage's spec",
        ),
        (
            "ppo",
            "engine.tensor_parallel_size",
            "engine.tensor_parallel_size=2 with rollout workers needs "
            "engine.backend: native (engine.backend is 'vllm'); set engine.tensor_parallel_size: 1",
        ),
    ]


@pytest.mark.parametrize("section", ["sft", "reward", "ppo", "dpo"])
def test_lora_with_zero_3(tmp_path, section):
    stages = ["data", "base", "sft", "dpo", "evaluate"] if section == "dpo" else None
    extra = {"stages": stages} if stages else {}
    found = problems_of(config_with(tmp_path, **{section: {"lora": {"rank": 8}, "zero_stage": 3}}, **extra))
    message = (
        f"{section}.lora with {section}.zero_stage 3: merging the adapters needs whole weights; use "
        "zero_stage 2 (LoRA's optimizer state is small anyway)"
    )
    stage = "reward-rm" if section == "reward" else section
    assert found == [(stage, f"{section}.lora", message)]


def test_batch_that_does_not_split_over_the_ranks(tmp_path):
    found = problems_of(
        config_with(
            tmp_path,
            sft={"batch_size": 24, "micro_batch_size": 8, "resources": {"nproc_per_node": 2}},
            reward={"batch_size": 30},
        )
    )
    assert found == [
        (
            "sft",
            "sft.batch_size",
            "sft.batch_size=24 must be a multiple of sft.micro_batch_size=8 x the 2 ranks of "
            "sft.resources (nproc_per_node x nnodes)",
        ),
        (
            "reward-rm",
            "reward.batch_size",
            "reward.batch_size=30 must be a multiple of reward.micro_batch_size=32",
        ),
    ]


def test_unload_during_training_with_async_rollouts(tmp_path):
    found = problems_of(
        config_with(tmp_path, engine={"unload_during_training": True}, ppo={"async_rollouts": True})
    )
    assert found == [
        (
            "ppo",
            "engine.unload_during_training",
            "engine.unload_during_training with "
            "ppo.async_rollouts: the engine is generating the next rollout while the trainer trains, so "
            "there is nothing to unload; turn one off",
        )
    ]


def test_torch_train_backend_with_zero(tmp_path):
    found = problems_of(config_with(tmp_path, ppo={"train_backend": "torch", "zero_stage": 2}))
    assert found == [
        (
            "ppo",
            "ppo.train_backend",
            "ppo.train_backend 'torch' trains one rank without ZeRO "
            "(zero_stage 2, WORLD_SIZE 1); use 'deepspeed' or 'auto'",
        )
    ]


def test_responses_that_leave_no_room_for_a_prompt(tmp_path):
    found = problems_of(
        config_with(
            tmp_path, engine={"max_seq_len": 32}, ppo={"max_new_tokens": 32}, evaluate={"max_new_tokens": 40}
        )
    )
    assert found == [
        (
            "ppo",
            "ppo.max_new_tokens",
            "ppo.max_new_tokens=32 leaves no room for a prompt in engine.max_seq_len=32 "
            "(prompt + response tokens); lower ppo.max_new_tokens or raise engine.max_seq_len",
        ),
        (
            "evaluate",
            "evaluate.max_new_tokens",
            "evaluate.max_new_tokens=40 leaves no room for a prompt in engine.max_seq_len=32 (prompt + "
            "response tokens); lower evaluate.max_new_tokens or raise engine.max_seq_len",
        ),
    ]
    assert (
        problems_of(
            config_with(
                tmp_path,
                engine={"max_seq_len": 33},
                ppo={"max_new_tokens": 32},
                evaluate={"max_new_tokens": 32},
            )
        )
        == []
    )


def test_local_base_model_folder(tmp_path):
    found = problems_of(config_with(tmp_path, model={"base": "models/missing"}))
    assert found == [
        (
            "base",
            "model.base",
            "model.base 'models/missing': no such directory; give a Hugging Face "
            "model folder or leave model.base empty for the tiny demo model",
        )
    ]
    (tmp_path / "models/missing").mkdir(parents=True)
    assert problems_of(config_with(tmp_path, model={"base": "models/missing"})) == []
    # the base stage's to find
    assert problems_of(config_with(tmp_path, model={"base": "s3://bucket/model"})) == []


def test_a_base_model_of_pickle_weights_fails_validate(tmp_path, main, capsys):
    (tmp_path / "models/bin").mkdir(parents=True)
    (tmp_path / "models/bin/config.json").write_text("{}")
    (tmp_path / "models/bin/pytorch_model.bin").write_bytes(b"never read")
    found = problems_of(config_with(tmp_path, model={"base": "models/bin"}))
    assert [(stage, key) for stage, key, _ in found] == [("base", "model.allow_pickle")]
    assert found[0][2].startswith(f"model.base: {tmp_path}/models/bin: refusing to load pickle files")
    assert main(["validate", str(tmp_path / "config.yaml")]) != 0
    assert "refusing to load pickle files (pytorch_model.bin)" in capsys.readouterr().err
    assert problems_of(config_with(tmp_path, model={"base": "models/bin", "allow_pickle": True})) == []


def test_checks_a_pipeline_config_cannot_reach():
    """The RL stage's and the evaluate stage's input checks (a valid pipeline always plans those inputs)."""
    ppo, engine = PPOConfig(), EngineConfig()
    assert [p.message for p in start_checks.rl_stage(ppo, engine, [])] == [
        "ppo needs at least one reward model input (reward_<name>) or ppo.reward_functions",
        "ppo.algorithm 'ppo' initialises its critic from a reward model: add one, or use grpo",
    ]
    assert start_checks.rl_stage(ppo, engine, ["reward_rm"]) == []
    grpo = PPOConfig(algorithm="grpo", group_size=2, reward_functions=["m:f"])
    assert start_checks.rl_stage(grpo, engine, []) == []
    assert start_checks.evaluate_stage(EvaluateConfig(), engine, ["sft", "data"])[0].message == (
        "stage 'evaluate' needs a policy input: 'ppo' (an RL stage output) or 'dpo' (a DPO stage output); "
        "spec inputs: ['data', 'sft']"
    )
    assert start_checks.policy_input(["ppo", "dpo"]).message == (
        "stage 'evaluate' evaluates one policy, but the spec has inputs ['ppo', 'dpo']: pass one"
    )


def test_the_stage_reports_the_first_problem_in_its_order():
    engine = EngineConfig(tensor_parallel_size=2, backend="vllm", unload_during_training=True)
    ppo = PPOConfig(async_rollouts=True, train_backend="torch", zero_stage=1)
    keys = [p.key for p in start_checks.rl_stage(ppo, engine, ["reward_rm"])]
    assert keys == [
        "engine.rollout_workers",
        "engine.rollout_workers",
        "engine.unload_during_training",
        "ppo.train_backend",
    ]


# ----------------------------------------------------------------------------------------------
# The CLI: all problems together, exit 2, nothing started
# ----------------------------------------------------------------------------------------------


def test_validate_reports_every_stage_problem_and_exits_non_zero(tmp_path, main, capsys):
    path = config_with(
        tmp_path,
        engine={"backend": "vllm", "unload_during_training": True},
        sft={"lora": {"rank": 4}, "zero_stage": 3},
        ppo={"async_rollouts": True},
    )
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"error: {path}: 3 stage start problem(s), as the stages would report them:" in err
    assert (
        "  - sft [sft.lora]: sft.lora with sft.zero_stage 3: merging the adapters needs whole weights; use "
        "zero_stage 2 (LoRA's optimizer state is small anyway)\n"
    ) in err
    assert f"  - ppo [engine.rollout_workers]: {VLLM_MESSAGE}\n" in err
    assert (
        "  - ppo [engine.unload_during_training]: engine.unload_during_training with ppo.async_rollouts"
        in err
    )
    assert "valid" not in err.split("error:")[0]
    assert not (tmp_path / "artifacts").exists()


def test_plan_prints_the_calls_then_the_problems(tmp_path, main, capsys):
    assert main(["plan", str(config_with(tmp_path, engine={"tensor_parallel_size": 2}))]) == 2
    out, err = capsys.readouterr()
    assert out.splitlines()[0].startswith("data ") and "stage=ppo" in out
    assert f"  - ppo [engine.rollout_workers]: {TP_MESSAGE}\n" in err


def test_run_refuses_before_anything_starts(tmp_path, main, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["run", str(config_with(tmp_path, engine={"backend": "vllm"}))]) == 2
    assert f"  - ppo [engine.rollout_workers]: {VLLM_MESSAGE}\n" in capsys.readouterr().err
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "mlflow.db").exists()


def test_the_config_schema_rules_fail_validate_too(tmp_path, main, capsys):
    path = config_with(tmp_path, ppo={"minibatch_size": 9, "resources": {"nproc_per_node": 2}})
    assert main(["validate", str(path)]) == 2
    assert "ppo.minibatch_size=9 must be a multiple of the 2 trainer ranks" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Machine checks: notes by default, problems with --here
# ----------------------------------------------------------------------------------------------


def test_a_gpu_config_on_a_machine_without_one(tmp_path, main, capsys, monkeypatch):
    monkeypatch.setattr(start_checks, "visible_gpus", lambda: 0)
    path = config_with(tmp_path, model={"device": "cuda"})
    assert main(["validate", str(path)]) == 0  # the stages may run elsewhere: a note
    err = capsys.readouterr().err
    assert (
        "note: sft, reward-rm, engine, ppo, evaluate [model.device]: model.device: cuda needs an NVIDIA GPU: "
        "this machine shows none; run the stage on a GPU node or set model.device: cpu (where the stage "
        "runs; pass --here when that is this machine)"
    ) in err
    assert main(["validate", "--here", str(path)]) == 2
    assert (
        "  - sft, reward-rm, engine, ppo, evaluate [model.device]: model.device: cuda needs an NVIDIA GPU: "
        "this machine shows none"
    ) in capsys.readouterr().err


def test_ranks_beyond_the_gpus_of_this_machine(tmp_path, main, capsys, monkeypatch):
    monkeypatch.setattr(start_checks, "visible_gpus", lambda: 2)
    path = config_with(tmp_path, model={"device": "cuda"}, sft={"resources": {"nproc_per_node": 4}})
    assert main(["plan", "--here", str(path)]) == 2
    assert (
        "  - sft [sft.resources.nproc_per_node]: sft.resources.nproc_per_node=4 ranks on model.device cuda "
        "need 4 GPUs: this machine shows 2; one rank per GPU"
    ) in capsys.readouterr().err


def test_the_engine_backend_package(tmp_path, main, capsys, monkeypatch):
    """The stage's own interpreter is looked at with find_spec;
    engine.worker_python is only started with --here."""
    real = start_checks.importlib.util.find_spec
    monkeypatch.setattr(
        start_checks.importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a)
    )
    path = config_with(tmp_path, engine={"backend": "vllm", "rollout_workers": 1})
    unmet, _ = machine_findings(load_config(path), gpus=0)
    assert [(f.stage, f.key) for f in unmet] == [
        ("engine", "engine.backend"),
        ("ppo", "engine.backend"),
        ("evaluate", "engine.backend"),
    ]
    assert unmet[0].message == (
        "engine.backend: vllm needs the vllm package in the stage's interpreter: not importable by this "
        f"interpreter ({sys.executable}); run the stage in the alignflow-engine-vllm image "
        "(containers/engine-vllm.Dockerfile), or set engine.worker_python to a venv with it"
    )
    # This interpreter as engine.worker_python: --here starts it, and it has no vllm either.
    path = config_with(
        tmp_path, engine={"backend": "vllm", "rollout_workers": 1, "worker_python": sys.executable}
    )
    assert main(["validate", str(path)]) == 0
    assert f"engine.worker_python={sys.executable} not probed" in capsys.readouterr().err
    assert main(["validate", "--here", str(path)]) == 2
    assert f"not importable by engine.worker_python={sys.executable}" in capsys.readouterr().err
    found = start_checks.machine_checks("engine", plan(load_config(path))[4].config, gpus=0)
    assert (
        found[0].unmet
        == f"engine.worker_python={sys.executable} not probed (alignflow validate --here starts it "
        "to look)"
    )
    missing = start_checks.find_package("vllm", str(tmp_path / "no-python"), probe=True)
    assert missing == f"engine.worker_python={tmp_path / 'no-python'}: no executable there"


def test_tensorrt_llm_needs_a_gpu():
    config = validate_config({"engine": {"backend": "tensorrt-llm"}})
    needs = {c.need: c.unmet for c in start_checks.machine_checks("engine", plan(config)[4].config, gpus=0)}
    assert needs["engine.backend: tensorrt-llm runs on NVIDIA GPUs only"] == "this machine shows none"
    assert "engine.backend: tensorrt-llm needs the tensorrt_llm package in the stage's interpreter" in needs
    with_gpu = start_checks.machine_checks("engine", plan(config)[4].config, gpus=1)
    assert "engine.backend: tensorrt-llm runs on NVIDIA GPUs only" not in {
        c.need for c in with_gpu if c.unmet
    }


def test_stages_that_run_as_their_own_deployments_are_not_checked_here(tmp_path, monkeypatch):
    monkeypatch.setattr(start_checks, "visible_gpus", lambda: 0)
    path = config_with(
        tmp_path,
        model={"device": "cuda"},
        deployment={"stage_infra": {"sft": {"work_pool": "gpu", "image": "alignflow/training"}}},
    )
    unmet, elsewhere = machine_findings(load_config(path))
    assert (
        elsewhere == ["sft"] and "sft" not in {f.stage for f in unmet} and "ppo" in {f.stage for f in unmet}
    )


def test_gpus_hidden_by_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert start_checks.visible_gpus() == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert start_checks.visible_gpus() == 0


def test_rollout_nodes_need_the_queues_secret_on_the_trainers_machine(tmp_path, main, capsys, monkeypatch):
    monkeypatch.delenv("ALIGNFLOW_ROLLOUT_SECRET", raising=False)
    engine = {"rollout_workers": 2, "rollout_nodes": 1, "rollout_endpoint": "trainer-0:29500"}
    config = validate_config({"engine": engine})
    ppo = next(call for call in plan(config) if call.stage == "ppo")
    need = "engine.rollout_nodes=1 needs the rollout queues' shared secret in ALIGNFLOW_ROLLOUT_SECRET"
    found = [c for c in start_checks.machine_checks("ppo", ppo.config, gpus=0) if c.need.startswith(need)]
    assert [c.unmet for c in found] == ["this machine's environment has none"]
    assert "--rollout-node I` (I < 1): the stage waits for them" in found[0].fix
    path = config_with(tmp_path, engine=engine)
    assert main(["validate", "--here", str(path)]) == 2
    assert "this machine's environment has none" in capsys.readouterr().err
    monkeypatch.setenv("ALIGNFLOW_ROLLOUT_SECRET", "s" * 16)
    assert [c.unmet for c in start_checks.machine_checks("ppo", ppo.config, gpus=0)
            if c.need.startswith(need)] == [None]
    assert main(["validate", "--here", str(path)]) == 0
