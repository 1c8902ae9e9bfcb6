"""The RL training step with transformers' forward, llama_forward's, and llama_forward's on packed rows.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/training_forward.py [--rounds 30] \\
        [--models demo,bench] [--json]

One step = the actor's forward (the RL layout: left-padded prompts, right-padded responses, LM head on
the response columns), selective log-softmax, backward, global-norm clip and foreach AdamW, as the RL
stage's fast step runs it; also the no-grad forward of the reference / value passes. The variants run
on the same model and batch, interleaved round by round: plain (transformers), lean (llama_forward on
the padded rows) and packed (llama_forward on the rows packed end to end, stages/common/training/packing.py);
the table has the median milliseconds (wall and process CPU time: CPU time is what to compare on a shared
machine) and the plain/lean and lean/packed CPU ratios. Also checks the forwards agree (max |diff| of the
log-probs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from alignflow.stages.ppo.experience import Experience, policy_logprobs

VARIANTS = ("plain", "lean", "packed")
MODELS: dict[str, dict[str, Any]] = {
    # configs/tiny.yaml's model; 16 rows is one of its minibatches.
    "demo": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    # benchmarks/rl_setup.py's 4.72M-parameter model (the RL-speed issue's TRL comparison).
    "bench": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=2048, tie_word_embeddings=True),
}


def rl_batch(vocab: int, rows: int = 16, seed: int = 0) -> Experience:
    """Prompts of 7-17 tokens and responses of 8-32 tokens: the demo's rollouts (one iteration's parquet)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = (
        torch.randint(7, 18, (rows,), generator=generator),
        torch.randint(8, 33, (rows,), generator=generator),
    )
    prompts = [torch.randint(3, vocab, (int(n),), generator=generator).tolist() for n in lengths[0]]
    responses = [torch.randint(3, vocab, (int(n),), generator=generator).tolist() for n in lengths[1]]
    return Experience.of_sequences(prompts, responses, 0)


def measure(name: str, rounds: int) -> list[dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # Eager attention for transformers: what the RL stage's fast step sets up to 512 tokens
    # (training_attention).
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=256, **MODELS[name]))
    model.set_attn_implementation("eager")
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), foreach=True)
    exp = rl_batch(model.config.vocab_size)
    packed = exp.packed
    with torch.no_grad():
        plain_logp = policy_logprobs(model, exp, 1.0, lean=False)[0]
        agree = max(
            float((policy_logprobs(model, exp, 1.0, lean=True, packed=p)[0] - plain_logp).abs().max())
            for p in (None, packed)
        )

    def logprobs(variant: str) -> torch.Tensor:
        return policy_logprobs(
            model, exp, 1.0, lean=variant != "plain", packed=packed if variant == "packed" else None
        )[0]

    def step(variant: str) -> None:
        logp = logprobs(variant)
        (-(logp.sum() / exp.response_mask.sum())).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def forward(variant: str) -> None:
        with torch.no_grad():
            logprobs(variant)

    cases = {
        (what, variant): (fn, variant)
        for what, fn in (("train step", step), ("no-grad forward", forward))
        for variant in VARIANTS
    }
    times: dict[tuple[str, str], dict[str, list[float]]] = {key: {"wall": [], "cpu": []} for key in cases}
    for fn, variant in cases.values():
        for _ in range(3):
            fn(variant)
    for _ in range(rounds):
        for key, (fn, variant) in cases.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn(variant)
            times[key]["wall"].append(time.perf_counter() - wall)
            times[key]["cpu"].append(time.process_time() - cpu)
    rows = []
    for what in ("train step", "no-grad forward"):
        row: dict[str, Any] = {
            "model": name,
            "what": what,
            "max_abs_diff": agree,
            "tokens": int(exp.attention_mask.sum()),
            "padded_slots": exp.input_ids.numel(),
            "packed_slots": packed.input_ids.numel(),
        }
        for variant in VARIANTS:
            row[f"{variant}_ms"] = statistics.median(times[what, variant]["wall"]) * 1e3
            row[f"{variant}_cpu_ms"] = statistics.median(times[what, variant]["cpu"]) * 1e3
        row["cpu_ratio"] = row["plain_cpu_ms"] / row["lean_cpu_ms"]
        row["packed_cpu_ratio"] = row["lean_cpu_ms"] / row["packed_cpu_ms"]
        rows.append(row)
    return rows


def machine_info() -> dict[str, Any]:
    """The CPU, its core count and the torch threads the timings ran with (the tables' and JSON's header)."""
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--models", default="demo,bench")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    rows = [row for name in names for row in measure(name, args.rounds)]
    machine = machine_info()
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows}, indent=2))
        return 0
    table = Table(
        title=f"RL training step, transformers vs llama_forward, padded and packed ({args.rounds} rounds, "
        f"{machine['threads']} threads, medians)"
    )
    for column in (
        "model",
        "what",
        "slots padded/packed",
        "plain ms",
        "lean ms",
        "packed ms",
        "plain CPU ms",
        "lean CPU ms",
        "packed CPU ms",
        "plain/lean (CPU)",
        "lean/packed (CPU)",
        "max |diff|",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["model"],
            r["what"],
            f"{r['padded_slots']}/{r['packed_slots']}",
            *(f"{r[f'{v}_ms']:.2f}" for v in VARIANTS),
            *(f"{r[f'{v}_cpu_ms']:.2f}" for v in VARIANTS),
            f"{r['cpu_ratio']:.2f}x",
            f"{r['packed_cpu_ratio']:.2f}x",
            f"{r['max_abs_diff']:.1e}",
        )
    Console(file=sys.stdout, width=160).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
