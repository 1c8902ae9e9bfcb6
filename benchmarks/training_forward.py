"""The RL training step with transformers' forward against llama_forward's, on the demo and the RL-benchmark models.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/training_forward.py [--rounds 30] [--models demo,bench] [--json]

One step = the actor's forward (the RL layout: left-padded prompts, right-padded responses, LM head on
the response columns), selective log-softmax, backward, global-norm clip and foreach AdamW, as the RL
stage's fast step runs it; also the no-grad forward of the reference / value passes. Both variants
run on the same model and batch, interleaved round by round; the table has the median milliseconds
(wall and process CPU time: CPU time is what to compare on a shared box) and the lean/plain ratio.
Also checks the two forwards agree (max |diff| of the log-probs).
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

from alignflow.stages.rl.experience import Experience, policy_logprobs

MODELS: dict[str, dict[str, Any]] = {
    # configs/tiny.yaml's model; 16 rows is one of its minibatches.
    "demo": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    # benchmarks/rl_setup.py's 4.72M-parameter model (the RL-speed issue's TRL comparison).
    "bench": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=2048, tie_word_embeddings=True),
}


def rl_batch(vocab: int, rows: int = 16, seed: int = 0) -> Experience:
    """Prompts of 8-24 tokens and responses of 12-32 tokens (the demo's rollouts average ~23)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 25, (rows,), generator=generator), torch.randint(12, 33, (rows,), generator=generator)
    prompts = [torch.randint(3, vocab, (int(n),), generator=generator).tolist() for n in lengths[0]]
    responses = [torch.randint(3, vocab, (int(n),), generator=generator).tolist() for n in lengths[1]]
    return Experience.of_sequences(prompts, responses, 0)


def measure(name: str, rounds: int) -> list[dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # Eager attention for transformers: what the RL stage's fast step sets up to 512 tokens (training_attention).
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=256, **MODELS[name]))
    model.set_attn_implementation("eager")
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), foreach=True)
    exp = rl_batch(model.config.vocab_size)
    with torch.no_grad():
        agree = float((policy_logprobs(model, exp, 1.0, lean=True)[0]
                       - policy_logprobs(model, exp, 1.0, lean=False)[0]).abs().max())

    def step(lean: bool) -> None:
        logp = policy_logprobs(model, exp, 1.0, lean=lean)[0]
        (-(logp.sum() / exp.response_mask.sum())).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def forward(lean: bool) -> None:
        with torch.no_grad():
            policy_logprobs(model, exp, 1.0, lean=lean)

    cases = {(what, lean): (fn, lean) for what, fn in (("train step", step), ("no-grad forward", forward))
             for lean in (False, True)}
    times: dict[tuple[str, bool], dict[str, list[float]]] = {key: {"wall": [], "cpu": []} for key in cases}
    for fn, lean in cases.values():
        for _ in range(3):
            fn(lean)
    for _ in range(rounds):
        for key, (fn, lean) in cases.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn(lean)
            times[key]["wall"].append(time.perf_counter() - wall)
            times[key]["cpu"].append(time.process_time() - cpu)
    rows = []
    for what in ("train step", "no-grad forward"):
        plain = {k: statistics.median(v) * 1e3 for k, v in times[what, False].items()}
        lean = {k: statistics.median(v) * 1e3 for k, v in times[what, True].items()}
        rows.append({"model": name, "what": what, "plain_ms": plain["wall"], "lean_ms": lean["wall"],
                     "plain_cpu_ms": plain["cpu"], "lean_cpu_ms": lean["cpu"],
                     "cpu_ratio": plain["cpu"] / lean["cpu"], "max_abs_diff": agree,
                     "tokens": int(exp.attention_mask.sum())})
    return rows


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
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
               "threads": torch.get_num_threads()}
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows}, indent=2))
        return 0
    table = Table(title=f"RL training step, transformers vs llama_forward ({args.rounds} rounds, "
                        f"{machine['threads']} threads, medians)")
    for column in ("model", "what", "plain ms", "lean ms", "plain CPU ms", "lean CPU ms", "plain/lean (CPU)",
                   "max |diff|"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(r["model"], r["what"], f"{r['plain_ms']:.2f}", f"{r['lean_ms']:.2f}", f"{r['plain_cpu_ms']:.2f}",
                      f"{r['lean_cpu_ms']:.2f}", f"{r['cpu_ratio']:.2f}x", f"{r['max_abs_diff']:.1e}")
    Console(file=sys.stdout, width=160).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
