"""Time of one fp32 decode step's linears and attention by implementation and batch rows (not a test).

Linears, the ~110M engine's 49 weights (~440 MB, distinct tensors so every call reads its weight from
memory, as a decode step does): `skinny` (alignflow.kernels.skinny_linear, the AVX-512 or AVX2 C++
build), `onednn` (the packed copy oneDNN reorders for that row count), `F.linear` (MKL on the plain [N, K]
weight), `engine` (what the engine runs without the C++ kernel: oneDNN for the weights of at least
prepack.MIN_PACKED_BYTES, F.linear for the rest). Where the kernel cannot run the skinny column is left
out, and without AVX-512 the attention table (its kernel has no AVX2 build). Attention, the model's 12
layers with --kv-len of 88 cache slots filled: `kernel`
(alignflow.kernels.decode_attention), `torch` (its reference, eager), `compiled` (the reference under
torch.compile, what the compiled engine ran before). Best of --repeats; every implementation's output
is checked against F.linear / the reference first.

    python benchmarks/cpu_kernels_bench.py                    # two tables
    python benchmarks/cpu_kernels_bench.py --rows 8,64 --json
    python benchmarks/cpu_kernels_bench.py --model rl-4.7m --rows 4,16,32,64   # the RL benchmark's model
    python benchmarks/cpu_kernels_bench.py --model rl-4.7m --engine-floor-kib 1024   # another packing floor
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_roofline import best_seconds  # noqa: E402  (sibling scripts, not a package)
from engine_throughput import MODELS as ENGINE_MODELS  # noqa: E402
from rl_setup import BENCH_MODEL  # noqa: E402

MODELS = {
    **ENGINE_MODELS,
    "rl-4.7m": {k: v for k, v in BENCH_MODEL.items() if k != "max_position_embeddings"},
}

CACHE_SLOTS = 88  # the benchmark engine's max_seq_len: 24 prompt + 64 new tokens


def step_shapes(model: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear of one decode step in the engine's fused layout: qkv, o,
    gate_up, down, head."""
    hidden, inter = model["hidden_size"], model["intermediate_size"]
    head_dim = hidden // model["num_attention_heads"]
    qkv = hidden + 2 * model["num_key_value_heads"] * head_dim
    layer = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return layer * model["num_hidden_layers"] + [(model["vocab_size"], hidden)]


def bench_linears(
    model: dict, rows_list: list[int], repeats: int, with_skinny: bool = True, floor: int | None = None
) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from alignflow.kernels import skinny_linear as skinny
    from alignflow.stages.common.generation.native.prepack import MIN_PACKED_BYTES

    torch.manual_seed(0)
    shapes = step_shapes(model)
    weights = [torch.randn(n, k) / k**0.5 for n, k in shapes]
    blocked = [skinny.block_weight(w) for w in weights] if with_skinny else []
    floor = MIN_PACKED_BYTES["onednn"] if floor is None else floor
    engine_packs = [w.nbytes >= floor for w in weights]
    megabytes = sum(w.numel() * 4 for w in weights) / 1e6
    out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        kernels = (
            {"skinny": lambda i, x: skinny.skinny_linear(x, blocked[i], shapes[i][0])} if with_skinny else {}
        )

        def onednn(i, x, packed=packed):
            return torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none", [], "")

        def plain(i, x):
            return F.linear(x, weights[i])

        kernels |= {
            "onednn": onednn,
            "F.linear": plain,
            "engine": lambda i, x, onednn=onednn: (onednn if engine_packs[i] else plain)(i, x),
        }
        row: dict = {"rows": rows, "weights_mb": megabytes}
        for name, kernel in kernels.items():
            worst = max(
                (kernel(i, xs[k]) - F.linear(xs[k], weights[i])).abs().max().item()
                for i, (_, k) in enumerate(shapes[:5])
            )
            if worst > 1e-3:
                raise SystemExit(f"{name} disagrees with F.linear at {rows} rows: max abs error {worst:.2e}")
            row[f"{name}_ms"] = 1e3 * best_seconds(
                lambda kernel=kernel, xs=xs: [kernel(i, xs[k]) for i, (_, k) in enumerate(shapes)], repeats
            )
        out.append(row)
    return out


def bench_attention(model: dict, rows_list: list[int], kv_len: int, repeats: int) -> list[dict]:
    import torch

    from alignflow.kernels import decode_attention as da

    kv_heads, heads = model["num_key_value_heads"], model["num_attention_heads"]
    head_dim, layers = model["hidden_size"] // heads, model["num_hidden_layers"]
    compiled = torch.compile(da.reference, dynamic=True)
    scale = head_dim**-0.5
    torch.manual_seed(0)
    out = []
    for rows in rows_list:
        caches = [
            (
                torch.randn(max(rows_list), kv_heads, CACHE_SLOTS, head_dim),
                torch.randn(max(rows_list), kv_heads, CACHE_SLOTS, head_dim),
            )
            for _ in range(layers)
        ]
        q = torch.randn(rows, kv_heads, heads // kv_heads, head_dim)
        mask = torch.zeros(rows, kv_len)
        impls = {"kernel": da.decode_attention, "torch": da.reference, "compiled": compiled}
        megabytes = rows * kv_heads * kv_len * head_dim * 4 * 2 * layers / 1e6
        row: dict = {"rows": rows, "kv_len": kv_len, "cache_read_mb": megabytes}
        for name, impl in impls.items():
            k, v = caches[0][0][:rows, :, :kv_len], caches[0][1][:rows, :, :kv_len]
            worst = (impl(q, k, v, mask, scale) - da.reference(q, k, v, mask, scale)).abs().max().item()
            if worst > 1e-5:
                raise SystemExit(f"attention {name} disagrees with the reference at {rows} rows: {worst:.2e}")
            row[f"{name}_ms"] = 1e3 * best_seconds(
                lambda impl=impl, q=q, mask=mask, caches=caches, rows=rows: [
                    impl(q, kc[:rows, :, :kv_len], vc[:rows, :, :kv_len], mask, scale) for kc, vc in caches
                ],
                repeats,
            )
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128,512", help="batch rows of the linears")
    parser.add_argument("--attention-rows", default="8,32,64", help="batch rows of the attention")
    parser.add_argument("--kv-len", type=int, default=57, help="filled cache slots (57: mid-generation)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="llama-100m", choices=list(MODELS))
    parser.add_argument(
        "--engine-floor-kib",
        type=int,
        default=None,
        help="the engine column with this packing floor instead of prepack.MIN_PACKED_BYTES",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch

    from alignflow.kernels import _cpu_extension
    from alignflow.kernels import skinny_linear as skinny

    torch.set_num_threads(args.threads)
    kernels = skinny.available()
    if not kernels:
        print(
            f"skinny_linear is not available here ({skinny.unavailable_reason()}): no skinny column",
            file=sys.stderr,
        )
    attention = _cpu_extension.extension() is not None
    if not attention:
        print(
            f"the AVX-512 kernels are not available here ({_cpu_extension.unavailable_reason()}): no "
            "attention table",
            file=sys.stderr,
        )
    model = MODELS[args.model]
    result = {
        "model": args.model,
        "threads": args.threads,
        "linears": bench_linears(
            model,
            [int(r) for r in args.rows.split(",")],
            args.repeats,
            kernels,
            None if args.engine_floor_kib is None else args.engine_floor_kib << 10,
        ),
        "attention": bench_attention(
            model, [int(r) for r in args.attention_rows.split(",")], args.kv_len, args.repeats
        )
        if attention
        else [],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console(width=120)
    mb = result["linears"][0]["weights_mb"]
    table = Table(
        title=f"fp32 linears of one {args.model} decode step ({mb:.0f} MB of weights), "
        f"{args.threads} threads, best of {args.repeats}"
    )
    columns = (
        ("rows", "skinny ms", "onednn ms", "F.linear ms", "engine ms", "skinny GB/s", "skinny x onednn")
        if kernels
        else ("rows", "onednn ms", "F.linear ms", "engine ms", "onednn GB/s")
    )
    for column in columns:
        table.add_column(column, justify="right")
    for row in result["linears"]:
        times = [f"{row['onednn_ms']:.2f}", f"{row['F.linear_ms']:.2f}", f"{row['engine_ms']:.2f}"]
        if kernels:
            table.add_row(
                str(row["rows"]),
                f"{row['skinny_ms']:.1f}",
                *times,
                f"{mb / row['skinny_ms']:.1f}",
                f"{row['onednn_ms'] / row['skinny_ms']:.2f}",
            )
        else:
            table.add_row(str(row["rows"]), *times, f"{mb / row['onednn_ms']:.1f}")
    console.print(table)
    if not attention:
        return 0
    table = Table(
        title=f"fp32 decode attention of one {args.model} step, {args.kv_len} of {CACHE_SLOTS} cache "
        f"slots filled, {args.threads} threads, best of {args.repeats}"
    )
    for column in (
        "rows",
        "cache MB",
        "kernel ms",
        "torch ms",
        "compiled ms",
        "kernel GB/s",
        "kernel x compiled",
    ):
        table.add_column(column, justify="right")
    for row in result["attention"]:
        table.add_row(
            str(row["rows"]),
            f"{row['cache_read_mb']:.0f}",
            f"{row['kernel_ms']:.2f}",
            f"{row['torch_ms']:.2f}",
            f"{row['compiled_ms']:.2f}",
            f"{row['cache_read_mb'] / row['kernel_ms']:.1f}",
            f"{row['compiled_ms'] / row['kernel_ms']:.2f}",
        )
    console.print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
