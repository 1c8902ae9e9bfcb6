"""The engine stage: build the generation engine once from the SFT checkpoint, check it against hf, publish.

Parity check: on a fixed prompt set (the first `engine.parity_prompts` RL prompts) the engine
decodes greedily and returns its logits; an hf forward pass over the same tokens must give the
same log-softmaxed logits (max abs error <= 1e-3 in fp32, 5e-2 in 16-bit) and the same greedy tokens as hf
`generate`. The published artifact is the engine's own save() (engine config, weights in the
inference layout, tokenizer files) plus build_report.json with build time, parity, memory and the
engine's execution paths (which code runs each part here: the same config runs C++ kernels on one
machine and torch on another), the latter also as `alignflow.engine.*` tags of the MLflow run.

With engine.worker_python (a venv with vllm) the build, the parity check and the save run in a one-shot child
process under that interpreter, and this process keeps the stage's tracking and publishing.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psutil
import torch

from alignflow import start_checks
from alignflow.config import EngineConfig, ModelConfig
from alignflow.contract import StageResult, StageSpec
from alignflow.stages.common.generation.interface import (
    SamplingParams,
    UnsupportedArchitectureError,
    build_engine,
    check_greedy_parity,
)
from alignflow.stages.common.generation.worker_python import call_in, resolve
from alignflow.stages.common.models.loading import load_causal_lm, load_tokenizer
from alignflow.stages.common.runtime import (
    StageContext,
    StageInputError,
    dump_json,
    run_program,
    section,
    stage_main,
    tracked,
)
from alignflow.stages.common.tokenization import encode_prompt
from alignflow.stages.data.formats import load_prompts, render_prompt

# Logit tolerance of the parity check: fp32 kernels agree to ~1e-5 on these models; 16-bit
# matmuls round differently in fused and unfused layouts, so they get a looser bound.
LOGIT_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}


@torch.no_grad()
def logit_error(engine, model, prompt_ids: list[list[int]], new_tokens: int) -> float:
    """Max abs difference between the engine's and an hf forward pass's log-softmaxed logits over the same
    tokens.

    Log-softmax on both sides: it is what sampling sees, and the vllm engine hands out log-probs, not raw
    logits (they differ by one constant per row)."""
    generation = engine.generate(prompt_ids, SamplingParams(temperature=0.0, max_new_tokens=new_tokens),
                                 return_logits=True)
    worst = 0.0
    device = next(model.parameters()).device
    for prompt, response, logits in zip(
        prompt_ids, generation.response_token_ids, generation.logits, strict=True
    ):
        tokens = torch.tensor([prompt + response], device=device)
        reference = model(input_ids=tokens).logits[0, len(prompt) - 1 : len(prompt) + len(response) - 1]
        worst = max(
            worst,
            float(
                (logits.float().to(device).log_softmax(-1) - reference.float().log_softmax(-1)).abs().max()
            ),
        )
    return worst


@torch.no_grad()
def round_linear_weights(model: torch.nn.Module) -> None:
    """Round every linear weight of an hf causal LM to bfloat16 and back, in place: the model a native
    engine with engine.cpu_linear_weights=bfloat16 computes (float32 activations, embeddings and norms).
    A head tied to the embedding gets a rounded copy of its own; the embedding stays as the engine
    reads it."""
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.weight = torch.nn.Parameter(module.weight.bfloat16().to(module.weight.dtype), False)


def build_and_check(
    sft_dir: Path,
    cfg: EngineConfig,
    dtype: str,
    prompt_ids: list[list[int]],
    out: Path,
    device: str | None = None,
) -> dict:
    """Build the engine on `device` (None: the GPU when there is one), check it against hf on the same device,
    save it into `out`; returns the build report. Runs where the backend is importable: in the stage's
    process, or under engine.worker_python (a venv with vllm) in a one-shot child."""
    rss_before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    try:
        engine = build_engine(sft_dir, cfg, dtype=dtype, device=device)
    except UnsupportedArchitectureError as exc:
        raise StageInputError(str(exc)) from None
    except NotImplementedError as exc:
        raise StageInputError(f"engine.backend: {exc}") from None
    build_s = time.perf_counter() - started
    footprint_mb = (psutil.Process().memory_info().rss - rss_before) / 2**20
    report: dict = {
        "backend": cfg.backend,
        "dtype": dtype,
        "build_s": round(build_s, 3),
        "footprint_mb": round(footprint_mb, 1),
        "execution_paths": engine.execution_paths(),
    }
    if cfg.worker_python:
        report["execution_paths"]["python"] = sys.executable
    if cfg.backend != "hf":
        reference = build_engine(
            sft_dir, EngineConfig(**{**cfg.model_dump(), "backend": "hf"}), dtype=dtype, device=device
        )
        model = load_causal_lm(sft_dir, dtype=dtype).to(reference.device).eval()
        if getattr(engine, "linear_weights_dtype", None) == torch.bfloat16:
            # engine.cpu_linear_weights: the engine runs the bf16-rounded model, so the reference does too
            round_linear_weights(reference.model)
            round_linear_weights(model)
        parity = check_greedy_parity(engine, reference, prompt_ids, cfg.parity_new_tokens)
        error = logit_error(engine, model, prompt_ids, cfg.parity_new_tokens)
        tolerance = LOGIT_TOLERANCE[dtype]
        report["parity"] = {
            "prompts": len(prompt_ids),
            "new_tokens": cfg.parity_new_tokens,
            "greedy_matching_sequences": parity.matching_sequences,
            "first_mismatch": parity.first_mismatch,
            "max_abs_logit_error": error,
            "tolerance": tolerance,
            "ok": bool(parity.ok and error <= tolerance),
        }
        if not report["parity"]["ok"]:
            raise RuntimeError(
                f"engine parity check failed: {parity.matching_sequences}/{len(prompt_ids)} greedy sequences "
                f"match hf, max abs logit error {error:.2e} (tolerance {tolerance:.0e}); first mismatch "
                f"{parity.first_mismatch}. Use engine.backend: hf while this is investigated"
            )
    else:
        report["parity"] = {"ok": True, "note": "hf is the reference backend"}
    engine.save(out)
    return report


def run(spec: StageSpec) -> StageResult:
    cfg: EngineConfig = section(spec, EngineConfig, "engine")
    model_cfg: ModelConfig = section(spec, ModelConfig, "model")
    # what `alignflow validate` and `alignflow plan` check of it too
    problems = start_checks.engine_stage(cfg)
    if problems:
        raise StageInputError(problems[0].message)
    ctx = StageContext(spec)
    with tracked(ctx):
        sft_dir, data_dir = ctx.input("sft"), ctx.input("data")
        tokenizer = load_tokenizer(sft_dir)
        prompts = load_prompts(data_dir / "prompts.jsonl")[: cfg.parity_prompts]
        prompt_ids = [encode_prompt(tokenizer, render_prompt(p.prompt, tokenizer)) for p in prompts]
        dtype = cfg.dtype or model_cfg.dtype
        # The stage (tracking, storage) stays in this interpreter; with engine.worker_python the build runs in
        # a child under that one, which has the backend's package (the RL stage's rollout workers use the
        # same).
        interpreter = resolve(cfg.worker_python, cfg.backend)
        with ctx.output_dir() as out:
            device = str(ctx.compute_device())
            report = call_in(
                interpreter,
                build_and_check,
                sft_dir,
                cfg,
                dtype,
                prompt_ids,
                out,
                device,
                what=f"the {cfg.backend} engine build",
            )
            ctx.record_device("generate", report["execution_paths"].get("device", device))
            build_s = report["build_s"]
            metrics = {
                "engine/build_s": build_s,
                "engine/footprint_mb": report["footprint_mb"],
                "engine/parity_ok": float(report["parity"]["ok"]),
            }
            if "max_abs_logit_error" in report["parity"]:
                metrics["engine/max_abs_logit_error"] = report["parity"]["max_abs_logit_error"]
            dump_json(report, out / "build_report.json")
            if ctx.tracker is not None:
                ctx.tracker.log_metrics(metrics)
                ctx.tracker.set_tags(
                    {f"alignflow.engine.{part}": how for part, how in report["execution_paths"].items()}
                )
                ctx.tracker.log_artifact(out / "build_report.json", "reports")
            manifest = ctx.publish_output(
                out, summary={"metrics": metrics, "key_metric": "engine/build_s", "report": report}
            )
        return ctx.result(
            manifest,
            metrics,
            "engine/build_s",
            message=f"{cfg.backend} engine built in {build_s:.1f} s, parity "
            f"{'ok' if report['parity']['ok'] else 'FAILED'}",
        )


def main(argv: list[str] | None = None) -> int:
    return stage_main("engine", run, argv)


if __name__ == "__main__":
    run_program(main)
