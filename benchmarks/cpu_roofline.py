"""The fastest the benchmark's generate call can be on this machine, and what that caps a speed-up at.

Measured here, on this machine with --threads threads:

    read bandwidth   best GB/s of reading a 512 MB tensor: torch.sum, or the engine's skinny_linear
                     kernel streaming it as a weight at 1 and 8 rows, whichever is faster
    peak GEMM        best GFLOP/s of square matmuls (1024, 2048, 3072) in each dtype (bf16 uses
                     AMX/AVX512-BF16 where present); the largest is taken, which favours the engine

One forward pass costs max(bytes / bandwidth, flops / peak GEMM): it reads every linear weight once
(plus the KV cache) and does 2 flops per weight per token. The floor of a whole generate call, which
is what engine_throughput.py times, is the sum over its passes: the prefill of the actual prompts
(their real lengths, not the padded width: an engine may skip padding) and new_tokens - 1 decode
steps, each row's cache one slot longer per step. It ignores sampling, norms, RoPE and the Python
loop and lets bytes and flops overlap perfectly, so no engine can beat it. Given the JSON of
engine_throughput.py, the table puts the floor beside hf's measured throughput: floor tokens/s / hf
tokens/s is the largest speed-up over hf any engine could show on this machine, in the same dtype.

    python benchmarks/engine_throughput.py --models llama-100m --json > /tmp/throughput.json
    python benchmarks/cpu_roofline.py --throughput-json /tmp/throughput.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import MODELS, make_prompts  # noqa: E402  (a sibling script, not a package)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def best_seconds(fn, repeats: int) -> float:
    fn()  # first touch, oneDNN primitive creation
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def read_bandwidth_gbs(repeats: int, megabytes: int = 512) -> float:
    """Best GB/s of reading `megabytes` once: torch.sum, or skinny_linear streaming it as a weight.

    The engine's own fp32 kernel (alignflow.kernels.skinny_linear) can read faster than torch.sum, and a
    floor that an engine beats is no floor.
    """
    import torch

    from alignflow.kernels import skinny_linear as skinny

    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    best = best_seconds(lambda: data.sum(), repeats)
    if skinny.available():
        in_features = 1024
        # [N / 16, K, 16]: one 16-column block per view row
        blocked = data.view(-1, in_features, skinny.BLOCK)
        out_features = blocked.shape[0] * skinny.BLOCK
        for rows in (1, 8):
            x = torch.ones(rows, in_features)
            best = min(
                best, best_seconds(lambda x=x: skinny.skinny_linear(x, blocked, out_features), repeats)
            )
    return data.numel() * 4 / best / 1e9


def gemm_gflops(dtype: str, repeats: int, sizes: tuple[int, ...] = (1024, 2048, 3072)) -> float:
    import torch

    best = 0.0
    for size in sizes:
        a = torch.randn(size, size).to(getattr(torch, dtype))
        b = torch.randn(size, size).to(getattr(torch, dtype))
        best = max(best, 2 * size**3 / best_seconds(lambda a=a, b=b: torch.mm(a, b), repeats) / 1e9)
    return best


def _spec(model: dict[str, Any]):
    """The architecture numbers of a MODELS entry (the RL stage's FLOP counts read the same)."""
    from transformers import LlamaConfig

    from alignflow.stages.common.generation.native.spec import spec_from_hf_config

    return spec_from_hf_config(LlamaConfig(**model), 1)


def step_cost(model: dict[str, Any], batch: int, kv_len: float, dtype: str) -> tuple[float, float]:
    """(bytes read, flops) of one decode step: every linear weight and the lm_head once,
    the KV cache up to kv_len."""
    from alignflow.stages.common.model_flops import forward_flops, linear_weights

    spec = _spec(model)
    linear_params = linear_weights(spec) + spec.vocab_size * spec.hidden_size
    kv_bytes = 2 * spec.num_layers * batch * kv_len * spec.kv_size * DTYPE_BYTES[dtype]
    flops = forward_flops(spec, batch, spec.num_layers * batch * kv_len, batch)  # each row: kv_len keys
    return linear_params * DTYPE_BYTES[dtype] + kv_bytes, flops


def prefill_cost(model: dict[str, Any], prompt_lens: list[int], dtype: str) -> tuple[float, float]:
    """(bytes read, flops) of the prefill: every weight once; each prompt token through every layer,
    causal attention over its own prompt, and the lm_head for each row's last token only."""
    from alignflow.stages.common.model_flops import linear_weights, spans_flops

    spec = _spec(model)
    tokens = sum(prompt_lens)
    kv_written = 2 * spec.num_layers * tokens * spec.kv_size * DTYPE_BYTES[dtype]
    flops = spans_flops(spec, [(0, n) for n in prompt_lens], head_rows=len(prompt_lens))
    weights = linear_weights(spec) + spec.vocab_size * spec.hidden_size
    return weights * DTYPE_BYTES[dtype] + kv_written, flops


def generate_floor_s(
    model: dict[str, Any],
    prompt_lens: list[int],
    new_tokens: int,
    dtype: str,
    bandwidth_gbs: float,
    peak_gflops: float,
) -> tuple[float, float]:
    """(floor seconds of a whole generate call, of which the prefill): the prefill, then new_tokens - 1
    decode steps (the prefill's logits give the first token) with every row's cache one slot longer each
    step."""

    def seconds(cost: tuple[float, float]) -> float:
        return max(cost[0] / (bandwidth_gbs * 1e9), cost[1] / (peak_gflops * 1e9))

    batch, mean_len = len(prompt_lens), sum(prompt_lens) / len(prompt_lens)
    prefill = seconds(prefill_cost(model, prompt_lens, dtype))
    # Step t attends to len_b + t keys per row; step_cost is linear in batch * kv_len, so the mean is exact.
    decode = sum(seconds(step_cost(model, batch, mean_len + t, dtype)) for t in range(1, new_tokens))
    return prefill + decode, prefill


def roofline(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth_gbs(args.repeats)
    peaks = {dtype: gemm_gflops(dtype, args.repeats) for dtype in args.dtypes}
    model = MODELS["llama-100m"]
    # engine_throughput.py generates from make_prompts(its largest batch)[:batch].
    prompts = make_prompts(args.prompts_of_batch, model["vocab_size"])
    measured: dict[tuple[str, int, str], float] = {}
    if args.throughput_json:
        for row in json.loads(Path(args.throughput_json).read_text())["throughput"]:
            if row["model"] == "llama-100m":
                measured[(row["dtype"], row["batch"], row["engine"])] = row["tokens_per_s"]
    rows = []
    for dtype in args.dtypes:
        for batch in args.batch_sizes:
            lens = [len(p) for p in prompts[:batch]]
            floor_s, prefill_s = generate_floor_s(
                model, lens, args.new_tokens, dtype, bandwidth, peaks[dtype]
            )
            step_bytes, step_flops = step_cost(model, batch, sum(lens) / batch + args.new_tokens / 2, dtype)
            floor_tps = batch * args.new_tokens / floor_s
            row = {
                "dtype": dtype,
                "batch": batch,
                "prompt_tokens": sum(lens),
                "mbytes_per_step": step_bytes / 1e6,
                "gflop_per_step": step_flops / 1e9,
                "bound": "memory" if step_bytes / bandwidth > step_flops / peaks[dtype] else "compute",
                "floor_s": floor_s,
                "floor_prefill_s": prefill_s,
                "floor_tokens_per_s": floor_tps,
            }
            hf = measured.get((dtype, batch, "hf"))
            native = measured.get((dtype, batch, "native+compile")) or measured.get((dtype, batch, "native"))
            row["hf_tokens_per_s"] = hf
            row["max_speedup_vs_hf"] = floor_tps / hf if hf else None
            row["native_tokens_per_s"] = native
            row["native_share_of_floor"] = native / floor_tps if native else None
            rows.append(row)
    return {
        "threads": args.threads,
        "read_bandwidth_gbs": bandwidth,
        "gemm_gflops": peaks,
        "new_tokens": args.new_tokens,
        "rows": rows,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--throughput-json", help="engine_throughput.py --json output: adds hf and native columns"
    )
    parser.add_argument("--batch-sizes", default="8,32,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument(
        "--prompts-of-batch",
        type=int,
        default=64,
        help="engine_throughput.py's largest --batch-sizes (its prompts are make_prompts(that)[:batch])",
    )
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if max(args.batch_sizes) > args.prompts_of_batch:
        parser.error(
            f"--batch-sizes {max(args.batch_sizes)} exceeds --prompts-of-batch {args.prompts_of_batch}: the "
            "floor needs that many prompts; raise --prompts-of-batch to engine_throughput.py's largest batch"
        )
    if not set(args.dtypes) <= set(DTYPE_BYTES):
        parser.error(f"--dtypes {args.dtypes}: valid are {', '.join(DTYPE_BYTES)}")
    return args


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    peaks = ", ".join(f"{d} {g:.0f}" for d, g in result["gemm_gflops"].items())
    table = Table(
        title=f"Floor of one generate call of llama-100m, {result['new_tokens']} new tokens "
        f"({result['threads']} threads): read {result['read_bandwidth_gbs']:.1f} GB/s, "
        f"peak GEMM GFLOP/s {peaks}"
    )
    columns = (
        "dtype",
        "batch",
        "prompt tokens",
        "MB/step",
        "GFLOP/step",
        "step bound",
        "floor s (prefill)",
        "floor tokens/s",
        "hf tokens/s",
        "max x hf",
        "native tokens/s",
        "native / floor",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("dtype", "step bound") else "right")

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for row in result["rows"]:
        table.add_row(
            row["dtype"],
            str(row["batch"]),
            str(row["prompt_tokens"]),
            f"{row['mbytes_per_step']:.0f}",
            f"{row['gflop_per_step']:.1f}",
            row["bound"],
            f"{row['floor_s']:.2f} ({row['floor_prefill_s']:.2f})",
            f"{row['floor_tokens_per_s']:.0f}",
            fmt(row["hf_tokens_per_s"], ".0f"),
            fmt(row["max_speedup_vs_hf"], ".2f"),
            fmt(row["native_tokens_per_s"], ".0f"),
            fmt(row["native_share_of_floor"], ".0%"),
        )
    Console(width=170).print(table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = roofline(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
