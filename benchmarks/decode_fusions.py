"""What each fused op of the GPU decode step buys: the CUDA-graph step with one more Triton kernel per row.

    python benchmarks/decode_fusions.py --device cuda [--model llama-1b] [--dtype bfloat16]
        [--batch-sizes 1,64] [--new-tokens 64] [--repeats 3] [--json]

Rows, on one random model, the same prompts and sampling (temperature 1, EOS ignored), each cumulative:

    eager ops              the engine's default captured step (engine.gpu_decode_kernels: torch)
    fused step, no Triton  gpu_decode_kernels: triton with engine.gpu_fused_ops empty: the fused step's
                           layout with every op its torch reference (what the restructuring alone does)
    + rope_cache_write     ... then each op of kernels/decode_step.py in the order the step runs them
    + live_attention
    + add_rms_norm
    + silu_mul             all four: what gpu_decode_kernels: triton runs by default
    + sampler in graph     and engine.cuda_graph_loop (the sampler and the loop's bookkeeping captured too)

Each row gives ms per decode step (generate's wall time over the new tokens, prefill included), its share of
the HBM roofline (benchmarks/engine_throughput.py's: the weights and live KV cache at the bandwidth of a
device-to-device copy in the same run) and `bought`: the previous row's ms per step minus this one's. Runs
are interleaved, the fastest of --repeats reported. `make gpu-check` runs it (its `fusions` step).

--device cpu is a smoke run for the tests: the static step runs uncaptured with the kernels in Triton's
interpreter (TRITON_INTERPRET=1 must be set before the first import of triton); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import engine_throughput as bench  # noqa: E402  (a sibling script: the models, roofline and timing helpers)

from alignflow.kernels.decode_step import FUSED_OPS  # noqa: E402  (in the order the step runs them)

ROWS = ("eager ops", "fused step, no Triton", *(f"+ {op}" for op in FUSED_OPS), "+ sampler in graph")


def row_configs(base: Any) -> dict[str, Any]:
    """Row label -> its EngineConfig, each adding one change to the row before it."""
    configs = {"eager ops": base.model_copy(update={"gpu_decode_kernels": "torch"})}
    for count in range(len(FUSED_OPS) + 1):
        label = "fused step, no Triton" if count == 0 else f"+ {FUSED_OPS[count - 1]}"
        configs[label] = base.model_copy(
            update={"gpu_decode_kernels": "triton", "gpu_fused_ops": list(FUSED_OPS[:count])}
        )
    configs["+ sampler in graph"] = configs[f"+ {FUSED_OPS[-1]}"].model_copy(update={"cuda_graph_loop": True})
    return configs


def measure(args: argparse.Namespace, root: Path, log) -> list[dict[str, Any]]:
    from alignflow.config import EngineConfig
    from alignflow.stages.common.generation import SamplingParams
    from alignflow.stages.common.generation.native import NativeEngine

    on_gpu = args.device.startswith("cuda")
    path, n_params = bench.make_checkpoint(root, args.model, args.device if on_gpu else "cpu", args.dtype)
    # On CPU the torch step, not the C++ decode loop that would replace it there.
    base = EngineConfig(max_batch_size=max(args.batch_sizes), max_seq_len=24 + args.new_tokens,
                        cpu_decode_loop=False)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True, seed=0)
    prompts = bench.make_prompts(max(args.batch_sizes), bench.MODELS[args.model]["vocab_size"])
    log(f"[{args.model} {args.dtype}] {n_params / 1e6:.1f}M parameters on {args.device}: building engines")
    engines = {}
    for label, config in row_configs(base).items():
        engine = NativeEngine.build(path, config, dtype=args.dtype, device=args.device)
        if not on_gpu:
            # The smoke run: the static (graph) step uncaptured, as the engine tests run it on CPU.
            engine._use_graphs = True
        engines[label] = engine

    def run(label: str, batch: int, new_tokens: int) -> float:
        started = time.perf_counter()
        params = sampling.model_copy(update={"max_new_tokens": new_tokens})
        gen = engines[label].generate(prompts[:batch], params)
        assert sum(gen.lengths) == batch * new_tokens, f"{label}: {sum(gen.lengths)} tokens"
        return time.perf_counter() - started

    for label in ROWS:  # warm-up: Triton's compiles, the graphs' capture, first calls
        for batch in args.batch_sizes:
            run(label, batch, min(4, args.new_tokens))
    times: dict[tuple[str, int], list[float]] = {}
    for repeat in range(args.repeats):
        for batch in args.batch_sizes:
            for label in ROWS:
                times.setdefault((label, batch), []).append(run(label, batch, args.new_tokens))
        log(f"  repeat {repeat + 1}/{args.repeats} done")
    rows = []
    for batch in args.batch_sizes:
        lens = [len(p) for p in prompts[:batch]]
        floor_s = bench.roofline_s(args.model, lens, args.new_tokens, args.dtype, args.bandwidth_gbs)
        previous = None
        for label in ROWS:
            seconds = min(times[(label, batch)])
            ms = seconds / args.new_tokens * 1e3
            rows.append({
                "model": args.model,
                "dtype": args.dtype,
                "batch": batch,
                "row": label,
                "ms_per_token_step": ms,
                "roofline_pct": 100 * floor_s / seconds,
                "bought_ms": None if previous is None else previous - ms,
                "runs_s": [round(t, 4) for t in times[(label, batch)]],
                "decode_step": engines[label].execution_paths()["decode_step"],
            })
            previous = ms
    return rows


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="auto", help="cuda, cuda:N, cpu (a smoke run) or auto")
    parser.add_argument("--model", default="llama-1b", choices=list(bench.MODELS))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bandwidth-mb", type=int, default=None,
                        help="MiB of the copy that measures the roofline's bandwidth (default 1024 on a GPU)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    return args


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GPU decode step, one fused op at a time ({result['model']}, {result['dtype']}, "
                        f"{result['new_tokens']} new tokens, best of {result['repeats']} interleaved runs)")
    for column in ("batch", "step", "ms/step", "% roofline", "bought ms/step"):
        table.add_column(column, justify="left" if column == "step" else "right")
    for row in result["rows"]:
        bought = "-" if row["bought_ms"] is None else f"{row['bought_ms']:+.3f}"
        table.add_row(str(row["batch"]), row["row"], f"{row['ms_per_token_step']:.3f}",
                      f"{row['roofline_pct']:.1f}", bought)
    console = Console(width=120)
    console.print(table)
    on_gpu = result["device"].startswith("cuda")
    console.print(f"Roofline: {result['bandwidth_gbs']:.0f} GB/s, a device-to-device copy on "
                  f"{result['device']}"
                  + (f" ({result['gpu']})" if result["gpu"] else "")
                  + ("" if on_gpu else "; a CPU smoke run: the times mean nothing"), highlight=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    args.device = bench.resolve_device(args.device)
    on_gpu = args.device.startswith("cuda")
    if not on_gpu and os.environ.get("TRITON_INTERPRET", "0") != "1":
        print("decode_fusions.py --device cpu runs the Triton kernels in Triton's interpreter: set "
              "TRITON_INTERPRET=1 in the environment (the figures are a GPU's: use --device cuda)",
              file=sys.stderr)
        return 2
    args.bandwidth_gbs = bench.copy_bandwidth_gbs(args.device, args.bandwidth_mb or (1024 if on_gpu else 64))

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # Libraries log to stdout (accelerate, through save_pretrained), which carries only the result.
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        rows = measure(args, Path(tmp), log)
    result = {
        "model": args.model,
        "dtype": args.dtype,
        "new_tokens": args.new_tokens,
        "repeats": args.repeats,
        "device": args.device,
        "gpu": bench.gpu_name(args.device),
        "torch": torch.__version__,
        "bandwidth_gbs": args.bandwidth_gbs,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
