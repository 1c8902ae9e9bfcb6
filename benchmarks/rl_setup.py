"""Upstream outputs for the RL benchmarks: the 4.7M-parameter benchmark model, SFT, reward model and engines.

    from rl_setup import prepare, ppo_spec

`prepare(workdir)` builds the benchmark checkpoint (random-init Llama, hidden 256, 4 layers, 4 heads,
FFN 1024, byte-level BPE vocab 2048, tied embeddings, 256 positions: 4.72M parameters, the model of
the TRL comparison in the RL-speed issue) into `<workdir>/bench-model`; `prepare(workdir, "llama-115m")`
builds the production-shaped one (hidden 768, 12 layers, 12 heads, FFN 3072: 114.8M parameters, the
GPU check's) into `<workdir>/bench-model-llama-115m`. It then runs the pipeline's
data, base (`model.base` pointing at that folder), SFT, reward and engine stages once per engine
variant (hf, native eager, native compiled, native with the C++ decode loop, and that on bf16 weights).
Everything is cached by the manifests, so a second call costs seconds. `ppo_spec` then writes a PPO-stage
spec for any RL config over those outputs.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

BENCH_MODEL = {  # llama-4.7m
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 2048,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
}
MODELS: dict[str, dict[str, Any]] = {
    "llama-4.7m": BENCH_MODEL,
    "llama-115m": {
        **BENCH_MODEL,
        "hidden_size": 768,
        "intermediate_size": 3072,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "num_key_value_heads": 12,
    },
}
DEFAULT_MODEL = "llama-4.7m"

# Engine variants of the ladder: name -> engine config overrides.
ENGINES: dict[str, dict[str, Any]] = {
    "hf": {"backend": "hf"},
    "native": {"backend": "native", "compile": False, "cpu_kernels": False, "cpu_prepack": False},
    "native_compiled": {
        "backend": "native",
        "compile": True,
        "cpu_kernels": True,
        "cpu_prepack": True,
        "cpu_decode_loop": False,
    },
    "native_loop": {
        "backend": "native",
        "compile": False,
        "cpu_kernels": True,
        "cpu_prepack": True,
        "cpu_decode_loop": True,
    },
    "native_loop_bf16": {
        "backend": "native",
        "compile": False,
        "cpu_kernels": True,
        "cpu_prepack": True,
        "cpu_decode_loop": True,
        "cpu_linear_weights": "bfloat16",
    },
}


@dataclass
class Upstream:
    """Published outputs the PPO stage reads: name -> (URI, manifest digest)."""

    workdir: Path
    model_dir: Path               # the benchmark checkpoint (also what TRL loads)
    sft: tuple[str, str]
    data: tuple[str, str]
    reward: tuple[str, str]
    engines: dict[str, tuple[str, str]]
    config: dict[str, Any]         # the pipeline config (resolved, JSON) the outputs came from
    code_version: str


def build_model(model_dir: Path, seed: int = 0, model: str = DEFAULT_MODEL) -> Path:
    """The benchmark checkpoint: a BPE tokenizer trained on the demo task's texts and a random-init Llama of
    the `model` shape (MODELS)."""
    from alignflow.config import DemoTaskConfig, TinyModelConfig
    from alignflow.stages.common.models.tiny import make_tiny_model, save_base_model, train_tokenizer
    from alignflow.stages.data.demo_task import demo_corpus

    if (model_dir / "config.json").is_file():
        return model_dir
    shape = MODELS[model]
    tokenizer = train_tokenizer(demo_corpus(DemoTaskConfig(seed=seed)), shape["vocab_size"])
    save_base_model(make_tiny_model(TinyModelConfig(**shape), tokenizer, seed=seed), tokenizer, model_dir)
    return model_dir


def prepare(workdir: Path, model: str = DEFAULT_MODEL, engines: list[str] | None = None) -> Upstream:
    """Build the `model` checkpoint and run data -> base -> sft -> reward -> engine (once per variant of
    `engines`, default every one of ENGINES) through the pipeline, cached."""
    from alignflow.config import load_config
    from alignflow.flows.pipeline import alignflow_pipeline

    if model not in MODELS:
        raise ValueError(f"unknown model '{model}'; models: {', '.join(MODELS)}")
    workdir = workdir.resolve()
    folder = "bench-model" if model == DEFAULT_MODEL else f"bench-model-{model}"
    model_dir = build_model(workdir / folder, model=model)
    overrides = [
        f"workdir={workdir}",
        "stages=[data,base,sft,reward,engine]",
        "tracking.enabled=false",
        f"model.base={model_dir}",
        "data.demo.n_sft=256",
        "data.demo.n_preferences=256",
        "sft.epochs=1",
        "reward.epochs=1",
        "engine.max_batch_size=16",
        "engine.max_seq_len=128",
    ]
    built: dict[str, tuple[str, str]] = {}
    rows: dict[str, dict[str, Any]] = {}
    config = None
    for name in engines or ENGINES:
        engine = ENGINES[name]
        config = load_config(
            REPO / "configs/tiny.yaml", overrides + [f"engine.{k}={v}" for k, v in engine.items()]
        )
        rows = {row["key"]: row for row in alignflow_pipeline(config)}
        built[name] = (rows["engine"]["output_uri"], rows["engine"]["manifest_digest"])
    assert config is not None
    from alignflow.manifest import code_version

    return Upstream(
        workdir=workdir,
        model_dir=model_dir,
        sft=(rows["sft"]["output_uri"], rows["sft"]["manifest_digest"]),
        data=(rows["data"]["output_uri"], rows["data"]["manifest_digest"]),
        reward=(rows["reward-rm"]["output_uri"], rows["reward-rm"]["manifest_digest"]),
        engines=built,
        config=config.model_dump(mode="json"),
        code_version=code_version(),
    )


def ppo_spec(up: Upstream, engine: str, ppo: dict[str, Any], with_reward_model: bool, path: Path) -> Path:
    """Write a PPO-stage spec over `up` (engine variant `engine`,
    PPO section `ppo`) to `path`; a fresh output."""
    from alignflow.contract import StageSpec

    engine_cfg = {**up.config["engine"], **ENGINES[engine]}
    inputs = {"engine": up.engines[engine], "sft": up.sft, "data": up.data}
    if with_reward_model:
        inputs["reward_rm"] = up.reward
    out = up.workdir / "runs" / f"ppo-{uuid.uuid4().hex[:12]}"
    spec = StageSpec(
        stage="ppo",
        config={"ppo": ppo, "model": up.config["model"], "engine": engine_cfg},
        inputs={k: v[0] for k, v in inputs.items()},
        input_digests={k: v[1] for k, v in inputs.items()},
        output_uri=f"file://{out}",
        code_version=up.code_version,
        workdir=str(up.workdir),
    )
    path.write_text(spec.model_dump_json(indent=2))
    return path


def run_output(spec_path: Path) -> Path:
    """The output folder of the run `spec_path` describes."""
    return Path(json.loads(spec_path.read_text())["output_uri"].removeprefix("file://"))


def read_metrics(spec_path: Path) -> list[dict[str, float]]:
    """The per-iteration metrics of the run `spec_path` described."""
    out = run_output(spec_path)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
