"""Time of one decode step's linears (the ~110M engine's 49 weights, fp32) by kernel and batch rows (not a test).

Kernels: `skinny` (alignflow.kernels.skinny_linear, AVX-512 C++), `onednn` (the packed copy oneDNN
reorders for that row count, what engine.cpu_prepack used before), `F.linear` (MKL on the plain
[N, K] weight). Weights are distinct tensors (~440 MB), so every call reads its weight from memory,
as a decode step does. Best of --repeats chains; each kernel's output is checked against F.linear.

    python benchmarks/linear_bench.py                    # table
    python benchmarks/linear_bench.py --rows 8,64 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_throughput import MODELS  # noqa: E402  (a sibling script, not a package)


def step_shapes(model: dict) -> list[tuple[int, int]]:
    """(out, in) of every linear of one decode step in the engine's fused layout: qkv, o, gate_up, down, head."""
    hidden, inter = model["hidden_size"], model["intermediate_size"]
    head_dim = hidden // model["num_attention_heads"]
    qkv = hidden + 2 * model["num_key_value_heads"] * head_dim
    layer = [(qkv, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    return layer * model["num_hidden_layers"] + [(model["vocab_size"], hidden)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,16,32,64,128,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="llama-100m", choices=list(MODELS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from alignflow.kernels import skinny_linear as skinny

    torch.set_num_threads(args.threads)
    if not skinny.available():
        print(f"skinny_linear is not available here: {skinny.unavailable_reason()}", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    shapes = step_shapes(MODELS[args.model])
    weights = [torch.randn(n, k) / k**0.5 for n, k in shapes]
    blocked = [skinny.block_weight(w) for w in weights]
    megabytes = sum(w.numel() * 4 for w in weights) / 1e6

    def best(chain) -> float:
        chain()  # warm-up
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            chain()
            times.append(time.perf_counter() - started)
        return min(times)

    rows_out = []
    for rows in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(rows, k) for k in {k for _, k in shapes}}
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
        kernels = {
            "skinny": lambda i, x: skinny.skinny_linear(x, blocked[i], shapes[i][0]),
            "onednn": lambda i, x, packed=packed: torch.ops.mkldnn._linear_pointwise(x, packed[i], None, "none",
                                                                                     [], ""),
            "F.linear": lambda i, x: F.linear(x, weights[i]),
        }
        row = {"rows": rows}
        for name, kernel in kernels.items():
            worst = max((kernel(i, xs[k]) - F.linear(xs[k], weights[i])).abs().max().item()
                        for i, (_, k) in enumerate(shapes[:5]))
            if worst > 1e-3:
                raise SystemExit(f"{name} disagrees with F.linear at {rows} rows: max abs error {worst:.2e}")
            seconds = best(lambda kernel=kernel, xs=xs: [kernel(i, xs[k]) for i, (_, k) in enumerate(shapes)])
            row[f"{name}_ms"] = seconds * 1e3
        row["read_gb_s_skinny"] = megabytes / row["skinny_ms"]
        rows_out.append(row)
        del packed

    if args.json:
        print(json.dumps({"model": args.model, "threads": args.threads, "weights_mb": megabytes, "rows": rows_out},
                         indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(shapes)} fp32 linears of one {args.model} decode step ({megabytes:.0f} MB), "
                        f"{args.threads} threads, best of {args.repeats}")
    for column in ("rows", "skinny ms", "onednn ms", "F.linear ms", "skinny GB/s", "skinny x onednn"):
        table.add_column(column, justify="right")
    for row in rows_out:
        table.add_row(str(row["rows"]), f"{row['skinny_ms']:.1f}", f"{row['onednn_ms']:.1f}",
                      f"{row['F.linear_ms']:.1f}", f"{row['read_gb_s_skinny']:.1f}",
                      f"{row['onednn_ms'] / row['skinny_ms']:.2f}")
    Console(width=120).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
