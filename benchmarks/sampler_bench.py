"""Benchmark of kernels.sample_tokens on CPU: the torch reference vs the eager fast paths (not a test).

`torch` is the sort-based reference, `compiled` the same under torch.compile (what a compiled engine
ran before the C++ kernel; plain mode only, one compile per shape), `chunked` the eager torch-op path
(bit-identical tokens and log-probs), `cpp` the AVX-512 C++ kernel (identical tokens, log-probs within
a few ulps; only where the extension builds). softmax + torch.multinomial is printed beside them as
the usual baseline, although it draws different tokens and no top-k/top-p. Times are the best of
--repeats calls on [B, V] fp32 logits, after two warm-up calls. With top-k or top-p on, the kept-set
thresholds alone are also timed both ways: by sorting every row and by the sorted prefixes that the
impls use (same thresholds, see sampling.kept_thresholds).

    python benchmarks/sampler_bench.py           # table
    python benchmarks/sampler_bench.py --json
"""

from __future__ import annotations

import argparse
import functools
import json
import time

MODES = {"plain": (1.0, 0, 1.0), "top_p 0.9": (1.0, 0, 0.9), "top_k 50": (0.8, 50, 1.0),
         "top_k 50, top_p 0.9": (1.0, 50, 0.9)}


def best_ms(fn, repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def threshold_ms(logits, temperature: float, top_k: int, top_p: float, repeats: int) -> tuple[float, float]:
    """(sort, prefix) milliseconds for the kept-set thresholds of one batch; they must agree."""
    import torch

    from alignflow.kernels import sampling

    rows = sampling.sampling_rows("bench", logits, temperature, top_k, top_p, 0, 0)
    inv_t, _, k, p = sampling.normalised_rows(rows, logits.shape[1])
    args = (sampling.ordered_keys32(logits), logits * inv_t[:, None], k, p)
    by_sort = sampling.kept_thresholds(*args, method="sort")
    by_prefix = sampling.kept_thresholds(*args)
    if not torch.equal(by_sort, by_prefix):
        raise SystemExit(f"prefix thresholds differ from the sort at top_k={top_k}, top_p={top_p}")
    return (best_ms(functools.partial(sampling.kept_thresholds, *args, method="sort"), repeats),
            best_ms(functools.partial(sampling.kept_thresholds, *args), repeats))


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
    from alignflow.kernels._triton_dispatch import cpp_available
    from alignflow.kernels.sampling import uniform_flags

    torch.set_num_threads(args.threads)
    impls = ("torch", "chunked", "cpp") if cpp_available() else ("torch", "chunked")
    compiled = torch.compile(sample_tokens, dynamic=False)
    rows = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(batch)) * 3
            seeds = torch.arange(batch)
            for mode, (temperature, top_k, top_p) in MODES.items():
                row = {"vocab": vocab, "batch": batch, "mode": mode}
                outputs = {}
                for impl in impls:
                    call = functools.partial(
                        sample_tokens, logits, temperature, top_k, top_p, seeds, 3, impl=impl, validate=False
                    )
                    outputs[impl] = call()
                    row[f"{impl}_ms"] = best_ms(call, args.repeats)
                if any(not torch.equal(out.tokens, outputs["torch"].tokens) for out in outputs.values()):
                    raise SystemExit(f"tokens differ between impls at batch {batch}, vocab {vocab}, {mode}")
                if mode == "plain":
                    flags = uniform_flags(temperature, top_k, top_p, vocab)
                    row["compiled_ms"] = best_ms(
                        functools.partial(
                            compiled,
                            logits,
                            torch.full((batch,), temperature),
                            torch.zeros(batch, dtype=torch.long),
                            torch.ones(batch),
                            seeds,
                            torch.full((batch,), 3),
                            "torch",
                            validate=False,
                            flags=flags,
                        ),
                        args.repeats,
                    )
                row["speedup"] = row["torch_ms"] / min(row[f"{impl}_ms"] for impl in impls[1:])
                if top_k or top_p < 1:
                    row["sort_thresholds_ms"], row["prefix_thresholds_ms"] = threshold_ms(
                        logits, temperature, top_k, top_p, args.repeats
                    )
                if mode == "plain":
                    row["multinomial_ms"] = best_ms(
                        functools.partial(lambda p: torch.multinomial(torch.softmax(p, dim=-1), 1), logits),
                        args.repeats,
                    )
                rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"sample_tokens on CPU, {args.threads} threads, best of {args.repeats} (ms per call)")
    for column in (
        "vocab",
        "batch",
        "mode",
        "reference (torch)",
        "compiled",
        "chunked",
        "cpp",
        "speedup",
        "softmax+multinomial",
        "thresholds: sort",
        "by prefix",
    ):
        table.add_column(column, justify="left" if column == "mode" else "right")

    def cell(r, key):
        return "" if r.get(key) is None else f"{r[key]:.2f}"

    for r in rows:
        table.add_row(
            str(r["vocab"]),
            str(r["batch"]),
            r["mode"],
            cell(r, "torch_ms"),
            cell(r, "compiled_ms"),
            cell(r, "chunked_ms"),
            cell(r, "cpp_ms"),
            f"{r['speedup']:.1f}x",
            cell(r, "multinomial_ms"),
            cell(r, "sort_thresholds_ms"),
            cell(r, "prefix_thresholds_ms"),
        )
    Console(width=150).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
