"""The fastest a decode step of the ~100M benchmark model can be on this machine, and what that caps a speed-up at.

A decode step reads every linear weight once (plus the KV cache) and does 2 flops per weight per
row. Measured here, on this machine with --threads threads:

    read bandwidth   best GB/s of torch.sum over a 512 MB tensor (a pure streaming read)
    peak GEMM        best GFLOP/s of a 2048^3 matmul in each dtype (bf16 uses AMX/AVX512-BF16 where present)

The floor of one step is max(bytes / bandwidth, flops / peak GEMM): no engine can beat it (it
ignores prefill, sampling, norms, RoPE and the Python loop, so it is optimistic). Given the JSON of
engine_throughput.py, the table puts that floor beside hf's measured step: hf ms / floor ms is the
largest speed-up over hf any engine could show on this machine, in the same dtype.

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
from engine_throughput import MODELS  # noqa: E402  (a sibling script, not a package)

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
    import torch

    data = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    return data.numel() * 4 / best_seconds(lambda: data.sum(), repeats) / 1e9


def gemm_gflops(dtype: str, repeats: int, size: int = 2048) -> float:
    import torch

    a = torch.randn(size, size).to(getattr(torch, dtype))
    b = torch.randn(size, size).to(getattr(torch, dtype))
    return 2 * size**3 / best_seconds(lambda: torch.mm(a, b), repeats) / 1e9


def step_cost(model: dict[str, Any], batch: int, kv_len: float, dtype: str) -> tuple[float, float]:
    """(bytes read, flops) of one decode step: every linear weight and the lm_head once, the KV cache up to kv_len."""
    hidden, inter, layers = model["hidden_size"], model["intermediate_size"], model["num_hidden_layers"]
    head_dim = hidden // model["num_attention_heads"]
    kv_dim = model["num_key_value_heads"] * head_dim
    per_layer = hidden * (hidden + 2 * kv_dim) + hidden * hidden + 3 * hidden * inter  # qkv, o, gate/up, down
    linear_params = layers * per_layer + model["vocab_size"] * hidden
    kv_bytes = 2 * layers * batch * kv_len * kv_dim * DTYPE_BYTES[dtype]
    flops = batch * (2 * linear_params + 4 * layers * kv_len * hidden)  # GEMMs, then q.k and p.v
    return linear_params * DTYPE_BYTES[dtype] + kv_bytes, flops


def roofline(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth_gbs(args.repeats)
    peaks = {dtype: gemm_gflops(dtype, args.repeats) for dtype in args.dtypes}
    model = MODELS["llama-100m"]
    kv_len = args.prompt_len + args.new_tokens / 2  # the cache length averaged over the decode steps
    measured: dict[tuple[str, int, str], float] = {}
    if args.throughput_json:
        for row in json.loads(Path(args.throughput_json).read_text())["throughput"]:
            if row["model"] == "llama-100m":
                measured[(row["dtype"], row["batch"], row["engine"])] = row["tokens_per_s"]
    rows = []
    for dtype in args.dtypes:
        for batch in args.batch_sizes:
            nbytes, flops = step_cost(model, batch, kv_len, dtype)
            floor_s = max(nbytes / (bandwidth * 1e9), flops / (peaks[dtype] * 1e9))
            row = {"dtype": dtype, "batch": batch, "mbytes_per_step": nbytes / 1e6, "gflop_per_step": flops / 1e9,
                   "bound": "memory" if nbytes / bandwidth > flops / peaks[dtype] else "compute",
                   "floor_ms_per_step": floor_s * 1e3, "floor_tokens_per_s": batch / floor_s}
            hf = measured.get((dtype, batch, "hf"))
            native = measured.get((dtype, batch, "native+compile")) or measured.get((dtype, batch, "native"))
            row["hf_tokens_per_s"] = hf
            row["max_speedup_vs_hf"] = batch / floor_s / hf if hf else None
            row["native_tokens_per_s"] = native
            row["native_share_of_floor"] = native * floor_s / batch if native else None
            rows.append(row)
    return {"threads": args.threads, "read_bandwidth_gbs": bandwidth, "gemm_gflops": peaks, "kv_len": kv_len,
            "rows": rows}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--throughput-json", help="engine_throughput.py --json output: adds hf and native columns")
    parser.add_argument("--batch-sizes", default="8,32,64")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-len", type=int, default=24, help="padded prompt width (engine_throughput: 24)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(args.dtypes) <= set(DTYPE_BYTES):
        parser.error(f"--dtypes {args.dtypes}: valid are {', '.join(DTYPE_BYTES)}")
    return args


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    peaks = ", ".join(f"{d} {g:.0f}" for d, g in result["gemm_gflops"].items())
    table = Table(title=f"Decode-step floor of llama-100m ({result['threads']} threads): read "
                        f"{result['read_bandwidth_gbs']:.1f} GB/s, peak GEMM GFLOP/s {peaks}, "
                        f"mean KV length {result['kv_len']:.0f}")
    columns = ("dtype", "batch", "MB/step", "GFLOP/step", "bound", "floor ms/step", "floor tokens/s",
               "hf tokens/s", "max x hf", "native tokens/s", "native / floor")
    for column in columns:
        table.add_column(column, justify="left" if column in ("dtype", "bound") else "right")

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for row in result["rows"]:
        table.add_row(row["dtype"], str(row["batch"]), f"{row['mbytes_per_step']:.0f}", f"{row['gflop_per_step']:.1f}",
                      row["bound"], f"{row['floor_ms_per_step']:.1f}", f"{row['floor_tokens_per_s']:.0f}",
                      fmt(row["hf_tokens_per_s"], ".0f"), fmt(row["max_speedup_vs_hf"], ".2f"),
                      fmt(row["native_tokens_per_s"], ".0f"), fmt(row["native_share_of_floor"], ".0%"))
    Console(width=160).print(table)


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
