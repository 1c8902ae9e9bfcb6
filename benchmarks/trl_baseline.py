"""TRL baseline: wall seconds per RL iteration of TRL's own GRPO or PPO trainer on a local model.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/trl_baseline.py --model-dir DIR --shape grpo \\
        [--iterations 10] [--threads 2] [--prompts-file FILE] [--device cpu|cuda] [--json]
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/trl_baseline.py --model-dir DIR --shape grpo_rm \\
        --reward-model-dir RM [--iterations 10] ...
    OMP_NUM_THREADS=2 /opt/trl112/bin/python benchmarks/trl_baseline.py --model-dir DIR --shape ppo \\
        [--iterations 10] [--threads 2] [--prompts-file FILE] [--json]

For comparing alignflow's RL loop with TRL per iteration (one generation batch plus its updates),
fp32 on CPU (--device cpu, the default) or on one GPU with bf16 autocast over fp32 weights (--device cuda,
TrainingArguments(bf16=True): what alignflow's RL stage does there with ppo.autocast auto), nothing saved,
reported or evaluated, seed fixed. DIR is a local Hugging Face folder
(causal LM with a tokenizer; pad/eos/bos set); nothing is downloaded. --prompts-file is a JSONL
whose records have a "prompt" field; without it a few fixed short prompts are used.

Shapes (16 completions of at most 32 new tokens per iteration in both):
  grpo  trl>=1.16 GRPOTrainer: 4 prompts x 4 completions, one update per generation
        (num_iterations=1, gradient_accumulation_steps=1), beta=0 (no reference model),
        lr 1e-5, temperature 1.0, reward = share of the letter "e" in the completion text.
  grpo_rm the same, the reward from the sequence-classification model in --reward-model-dir (a
        reward stage's output: GRPOTrainer scores prompt + completion with it and its tokenizer).
  ppo   trl 1.12 PPOTrainer (trl.experimental.ppo; trl 1.16 dropped it): 16 prompts x 1
        completion, 4 PPO epochs over one minibatch of 16, value and reward models are
        AutoModelForSequenceClassification(num_labels=1) from DIR (random score head),
        reference = a copy of the policy, lr 1e-5, temperature 1.0.

An iteration is timed from one optimisation step's end to the next (the first from the start of
training), via a TrainerCallback, so it covers TRL's whole per-step work including its logging.
The median leaves out iteration 1 (warm-up). With --json the last stdout line is one JSON object;
TRL's own console output goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

# total_s starts here: torch/transformers/trl are imported later, inside functions, so their import time
# (part of what a user waits for) is counted; the stdlib above costs milliseconds.
START = time.perf_counter()

REPO = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = (
    "Write about the sea.\n",
    "Describe a forest.\n",
    "Say something about the city.\n",
    "Write about the weather.\n",
    "Tell me about the library.\n",
    "Describe the mountains.\n",
    "Write about football.\n",
    "Say something about music.\n",
)
COMPLETIONS_PER_ITERATION = 16
MAX_NEW_TOKENS = 32
GRPO_GENERATIONS = 4
PPO_EPOCHS = 4
LEARNING_RATE = 1e-5
SEED = 0
MIN_TRL = {
    "grpo": "trl>=1.16",
    "grpo_rm": "trl>=1.16",
    "ppo": "trl==1.12 (trl.experimental.ppo.PPOTrainer; trl 1.16 dropped it)",
}


class MissingTrainer(RuntimeError):
    """The installed trl cannot run the requested shape (exit status 2)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, required=True, help="local Hugging Face model folder")
    parser.add_argument("--shape", choices=("grpo", "grpo_rm", "ppo"), required=True)
    parser.add_argument(
        "--reward-model-dir", type=Path, default=None, help="grpo_rm: the local reward model folder"
    )
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--prompts-file", type=Path, default=None, help='JSONL with a "prompt" field per record'
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: fp32; cuda: the first GPU, bf16 autocast over fp32 weights",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last stdout line")
    args = parser.parse_args(argv)
    if args.iterations < 1:
        parser.error("--iterations must be at least 1")
    if (args.shape == "grpo_rm") != (args.reward_model_dir is not None):
        parser.error("--reward-model-dir goes with --shape grpo_rm, and only with it")
    return args


def isolate_from_repo() -> None:
    """Keep the repo root off sys.path before transformers is imported.

    The repo's top-level `kernels/` package has the import name of the Hub `kernels` library.
    transformers' availability probe imports whatever `kernels` it finds when no package metadata
    matches, and /work/main/kernels imports `alignflow.kernels`, which only exists where alignflow is
    installed, so in another venv (/opt/trl112) every model import fails ("Could not import module
    'PreTrainedModel' ... hub_kernels"). This script needs nothing from the repo.
    """
    sys.path[:] = [entry for entry in sys.path if Path(entry or ".").resolve() != REPO]  # "" is the cwd


def offline_env() -> None:
    """Never reach the Hub or a tracker: the model is local and the run must not phone home."""
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "DO_NOT_TRACK": "true",
        "TRL_EXPERIMENTAL_SILENCE": "1",
    }.items():  # PPO lives in trl.experimental; we know
        os.environ.setdefault(key, value)


def load_prompts(path: Path | None, at_least: int) -> list[str]:
    """Prompts from the JSONL (or the fixed ones), repeated until one iteration's batch is full."""
    if path is None:
        prompts = list(DEFAULT_PROMPTS)
    else:
        records = (json.loads(line) for line in path.read_text().splitlines() if line.strip())
        prompts = [record["prompt"] for record in records if record.get("prompt")]
        if not prompts:
            raise SystemExit(f"error: no records with a 'prompt' field in {path}")
    # PPO's dataloader drops a ragged last batch, so fewer prompts than a batch would yield no iteration.
    while len(prompts) < at_least:
        prompts += prompts[: at_least - len(prompts)]
    return prompts


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def import_trl(shape: str):
    """The trl module, or MissingTrainer naming the version the shape needs."""
    try:
        import trl
    except Exception as exc:  # broken installs raise more than ImportError (see isolate_from_repo)
        first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise MissingTrainer(
            f"trl is not importable ({first_line}); --shape {shape} needs {MIN_TRL[shape]}"
        ) from exc
    return trl


def version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def grpo_classes(trl):
    # GRPOTrainer exists in older trl too, but the config fields used here (steps_per_generation, no vLLM
    # by default, beta=0 skipping the reference model) are those of 1.16.
    if version_tuple(trl.__version__) < (1, 16):
        raise MissingTrainer(f"--shape grpo needs {MIN_TRL['grpo']}, found trl {trl.__version__}")
    try:
        from trl import GRPOConfig, GRPOTrainer
    except Exception as exc:
        raise MissingTrainer(
            f"trl {trl.__version__} has no GRPOTrainer; --shape grpo needs {MIN_TRL['grpo']}"
        ) from exc
    return GRPOConfig, GRPOTrainer


def ppo_classes(trl):
    # PPO moved from trl.trainer to trl.experimental.ppo before being removed; accept either home.
    for module in ("trl.experimental.ppo", "trl"):
        try:
            imported = __import__(module, fromlist=["PPOConfig", "PPOTrainer"])
            return imported.PPOConfig, imported.PPOTrainer
        except (ImportError, AttributeError):
            continue
    raise MissingTrainer(f"trl {trl.__version__} has no PPOTrainer; --shape ppo needs {MIN_TRL['ppo']}")


def iteration_timer():
    """A TrainerCallback that records wall seconds between consecutive optimisation step ends.

    Step end to step end (not step begin to end) because trl 1.12's PPOTrainer never calls
    on_step_begin, and because the work between steps (logging, data) is part of an iteration.
    """
    from transformers import TrainerCallback

    class IterationTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._last: float | None = None

        def on_train_begin(self, args, state, control, **kwargs):
            self._last = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            self.seconds.append(now - self._last)
            self._last = now

    return IterationTimer()


def common_args(output_dir: str, device: str = "cpu") -> dict:
    """TrainingArguments shared by both shapes: fp32 CPU or bf16-autocast GPU,
    no saving/eval/reporting, quiet, seeded."""
    import dataclasses

    from transformers import TrainingArguments

    # TRL defaults checkpointing to True, which would add a recompute to every backward; transformers 5.23
    # renamed the field (the old name still works but warns).
    names = {field.name for field in dataclasses.fields(TrainingArguments)}
    checkpointing = (
        "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    )
    return dict(
        output_dir=output_dir,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        use_cpu=device == "cpu",
        bf16=device == "cuda",
        fp16=False,  # TRL defaults bf16 to True, also on a CPU
        **{checkpointing: False},
        learning_rate=LEARNING_RATE,
        lr_scheduler_type="constant",
        seed=SEED,
        data_seed=SEED,
        per_device_train_batch_size=COMPLETIONS_PER_ITERATION,
        gradient_accumulation_steps=1,
        dataloader_num_workers=0,
        disable_tqdm=True,
        temperature=1.0,
    )


def e_share(completions, **kwargs) -> list[float]:
    """Reward: share of the letter "e" in each completion's text
    (conversational ones use their last message)."""
    texts = [c if isinstance(c, str) else (c[-1]["content"] if c else "") for c in completions]
    return [text.count("e") / len(text) if text else 0.0 for text in texts]


def build_grpo(
    trl,
    model_dir: Path,
    prompts: list[str],
    iterations: int,
    output_dir: str,
    device: str = "cpu",
    reward_model_dir: Path | None = None,
):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    GRPOConfig, GRPOTrainer = grpo_classes(trl)
    config = GRPOConfig(
        **common_args(output_dir, device),
        max_steps=iterations,
        logging_strategy="no",
        num_generations=GRPO_GENERATIONS,
        max_completion_length=MAX_NEW_TOKENS,
        num_iterations=1,
        beta=0.0,
        use_vllm=False,
        log_completions=False,
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    timer = iteration_timer()
    reward: dict = {"reward_funcs": e_share}
    if reward_model_dir is not None:
        reward = {
            "reward_funcs": AutoModelForSequenceClassification.from_pretrained(
                reward_model_dir, num_labels=1, dtype=torch.float32
            ),
            "reward_processing_classes": AutoTokenizer.from_pretrained(reward_model_dir),
        }
    trainer = GRPOTrainer(
        model=model,
        **reward,
        args=config,
        processing_class=tokenizer,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        callbacks=[timer],
    )
    return trainer, timer


def build_ppo(
    trl, model_dir: Path, prompts: list[str], iterations: int, output_dir: str, device: str = "cpu"
):
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    PPOConfig, PPOTrainer = ppo_classes(trl)
    config = PPOConfig(
        **common_args(output_dir, device),
        total_episodes=iterations * COMPLETIONS_PER_ITERATION,
        num_mini_batches=1,
        num_ppo_epochs=PPO_EPOCHS,
        response_length=MAX_NEW_TOKENS,
        local_rollout_forward_batch_size=COMPLETIONS_PER_ITERATION,
        num_sample_generations=0,  # else it samples the eval set every few iterations
        stop_token=None,  # no truncation at EOS: every response is scored at full length
    )
    # PPOTrainer generates from the raw padded batch, so prompts must be padded on the left.
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    reference = copy.deepcopy(policy)
    value = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})
    timer = iteration_timer()
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=reference,
        reward_model=reward,
        value_model=value,
        train_dataset=dataset,
        callbacks=[timer],
    )
    return trainer, timer


def run(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)  # before any other torch work, so every op uses the asked count
    trl = import_trl(args.shape)
    import transformers

    transformers.logging.set_verbosity_warning()
    transformers.set_seed(SEED)
    prompts = load_prompts(args.prompts_file, COMPLETIONS_PER_ITERATION)
    with tempfile.TemporaryDirectory(prefix="trl-baseline-") as output_dir:
        # TRL and accelerate print progress and metric dicts to stdout; keep stdout for our result.
        with contextlib.redirect_stdout(sys.stderr):
            common = (trl, args.model_dir, prompts, args.iterations, output_dir, args.device)
            if args.shape == "ppo":
                trainer, timer = build_ppo(*common)
            else:
                trainer, timer = build_grpo(*common, args.reward_model_dir)
            trainer.train()
    seconds = timer.seconds
    if len(seconds) != args.iterations:
        print(f"warning: timed {len(seconds)} iterations, asked for {args.iterations}", file=sys.stderr)
    median = statistics.median(seconds[1:] if len(seconds) > 1 else seconds)
    return {
        "trl_version": trl.__version__,
        "shape": args.shape,
        "iterations": [round(s, 4) for s in seconds],
        "median_s": round(median, 4),
        "completions_per_s": round(COMPLETIONS_PER_ITERATION / median, 3),
        "total_s": round(time.perf_counter() - START, 2),
        "cpu": cpu_model(),
        "device": args.device,
        "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
        "completions_per_iteration": COMPLETIONS_PER_ITERATION,
        "threads": args.threads,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
    }


def print_table(result: dict) -> None:
    print(
        f"TRL {result['trl_version']} {result['shape']} (transformers {result['transformers_version']}, "
        f"torch {result['torch_version']}, {result['threads']} threads, {result['gpu'] or result['cpu']})"
    )
    for index, seconds in enumerate(result["iterations"], start=1):
        print(f"  iteration {index:>3}  {seconds:8.3f} s{'  (warm-up, not in median)' if index == 1 else ''}")
    print(
        f"  median {result['median_s']:.3f} s/iteration, {result['completions_per_s']:.2f} completions/s "
        f"({result['completions_per_iteration']} per iteration), total {result['total_s']:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    isolate_from_repo()
    offline_env()
    try:
        result = run(args)
    except MissingTrainer as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
