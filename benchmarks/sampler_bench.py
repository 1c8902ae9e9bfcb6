"""Benchmark of alignflow.kernels.sample_tokens on CPU: the sort-based reference vs the chunked eager path (not a test).

Both give the same tokens bit for bit (tests/kernels/test_sampling.py); softmax + torch.multinomial
is printed beside them as the usual baseline, although it draws different tokens and no top-k/top-p.
Times are the best of --repeats calls on [B, V] fp32 logits, after two warm-up calls.

    python benchmarks/sampler_bench.py           # table
    python benchmarks/sampler_bench.py --json
"""

from __future__ import annotations

import argparse
import functools
import json
import time

MODES = {"plain": (1.0, 0, 1.0), "top_p 0.9": (1.0, 0, 0.9), "top_k 50": (0.8, 50, 1.0)}


def best_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--vocabs", default="32000,128256")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from alignflow.kernels import sample_tokens

    torch.set_num_threads(args.threads)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3
            seeds = torch.arange(batch)
            for mode, (temperature, top_k, top_p) in MODES.items():
                row = {"vocab": vocab, "batch": batch, "mode": mode}
                for impl in ("torch", "chunked"):
                    call = functools.partial(sample_tokens, logits, temperature, top_k, top_p, seeds, 3, impl=impl,
                                             validate=False)
                    row[f"{impl}_ms"] = best_ms(call, args.repeats)
                row["speedup"] = row["torch_ms"] / row["chunked_ms"]
                if mode == "plain":
                    row["multinomial_ms"] = best_ms(
                        functools.partial(lambda p: torch.multinomial(torch.softmax(p, dim=-1), 1), logits),
                        args.repeats)
                rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sample_tokens on CPU, {args.threads} threads, best of {args.repeats} (ms per call)")
    for column in ("vocab", "batch", "mode", "reference (torch)", "chunked", "speedup", "softmax+multinomial"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for r in rows:
        multinomial = r.get("multinomial_ms")
        table.add_row(str(r["vocab"]), str(r["batch"]), r["mode"], f"{r['torch_ms']:.2f}", f"{r['chunked_ms']:.2f}",
                      f"{r['speedup']:.1f}x", "" if multinomial is None else f"{multinomial:.2f}")
    Console(width=120).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
