"""Rollout workers under skewed response lengths: work queue vs static split, wall time and imbalance.

    .venv/bin/python benchmarks/rollout_balance.py [--model small] [--sequences 64] [--batch 8]
        [--new-tokens 64] [--workers 2] [--chunk 8] [--repeats 3] [--layouts grouped,shuffled]
        [--schedules static,queue,in-process] [--tensor-parallel 1] [--json]

What runs: the native engine, built once from a random Llama (`--model`), loaded by R worker processes
(stages/ppo/rollout_workers.py, `--worker-threads` torch threads each; on 2 cores 2 workers x 1 thread is
the honest configuration: the trainer process waits while they generate). Sampling is temperature 1
with one seed per sequence, as in the RL stage.

Where the skew comes from (nothing is faked or slowed): a calibration pass samples a pool of 4 x
`--sequences` prompt/seed pairs for `--new-tokens` tokens, then picks a set of stop tokens large enough
that half of the pool stops within a quarter of the budget (a stop token ends a sequence, and a decode
batch ends when its last sequence does). The request takes the longest half and the shortest half of
the pool. Layout `grouped` puts the long sequences first, as GRPO's group-contiguous batches do when
some prompts draw long answers; `shuffled` mixes them (static split is at its best there).

Schedules, over the same workers and the same request:
  static   the request cut into R equal contiguous parts, one per worker (the checker below confirms
           each worker took exactly one part)
  queue    chunks of `--chunk` sequences on one queue; a free worker takes the next (NeMo-Aligner's design)
and, for scale, `in-process`: one engine in this process with all the cores' threads.

`--tensor-parallel k`: each of the R workers is a replica of k processes (engine.tensor_parallel_size);
the refit then sends TP rank j of every replica only its slices.

Reported per row: wall seconds (median of `--repeats`, interleaved with the other schedule), imbalance
(busiest worker's generate seconds / the mean over all R workers; 1.0 is even), each worker's busy
seconds and chunk count, and generated tokens (identical across schedules: per-sequence seeds). Then the
refit of the whole checkpoint (median of `--repeats`): the bytes of the stream, of its split and its
replicated tensors (the engine's sharding rules), the bytes sent (`refit/bytes_sent`), what sending the
whole stream to all R x k processes would be, and seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    # The pipeline's demo model (alignflow.config.TinyModelConfig defaults): for the smoke test.
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    # ~11M parameters: a decode step at batch 8 is a few ms on one core, long enough that the schedule,
    # not Python overhead, decides the wall time.
    "small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=8192, tie_word_embeddings=True),
}


def machine() -> dict[str, Any]:
    """The CPU model (/proc/cpuinfo) and its core count: the figures depend on both."""
    import platform

    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return {"cpu": model, "cpus": os.cpu_count()}


def build(root: Path, name: str, batch: int, max_seq_len: int, torch_step: bool = False) -> tuple[Path, int]:
    """A random Llama of `name`, built into a saved native engine (what the engine stage publishes).

    torch_step: engine.cpu_decode_loop false, the torch decode step instead of the C++ loop."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from alignflow.config import EngineConfig
    from alignflow.stages.common.generation.interface import build_engine

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=max_seq_len, bos_token_id=1, eos_token_id=2,
                                         **MODELS[name]))
    model.save_pretrained(root / "checkpoint")
    engine = build_engine(
        root / "checkpoint",
        EngineConfig(
            max_batch_size=batch,
            max_seq_len=max_seq_len,
            cuda_graphs=False,
            parity_prompts=2,
            parity_new_tokens=4,
            cpu_decode_loop=not torch_step,
        ),
    )
    engine.save(root / "engine")
    return root / "engine", sum(p.numel() for p in model.parameters())


def first_stop(tokens: list[int], stops: set[int]) -> int:
    """The length a response of these tokens has when any of `stops` ends it."""
    return next((i + 1 for i, t in enumerate(tokens) if t in stops), len(tokens))


def skewed_request(engine, n: int, new_tokens: int, vocab: int, seed: int = 0):
    """(prompts, seeds, stop tokens, lengths) of n sequences: the pool's n/2 longest and n/2 shortest under a
    stop set that ends half of the pool within new_tokens / 4 (see the module docstring)."""
    from alignflow.stages.common.generation.interface import SamplingParams

    rng = random.Random(seed)
    pool = 4 * n
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(8, 25))] for _ in range(pool)]
    seeds = [rng.randrange(2**62) for _ in range(pool)]
    free = engine.generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seeds=seeds, ignore_eos=True)
    ).response_token_ids
    candidates = list(range(3, vocab))
    rng.shuffle(candidates)
    for k in range(1, len(candidates)):
        stops = set(candidates[:k])
        lengths = [first_stop(t, stops) for t in free]
        if statistics.median(lengths) <= new_tokens / 4:
            break
    order = sorted(range(pool), key=lambda i: lengths[i])
    chosen = order[-(n - n // 2) :][::-1] + order[: n // 2]  # long half first, then the short half
    return (
        [prompts[i] for i in chosen],
        [seeds[i] for i in chosen],
        sorted(stops),
        [lengths[i] for i in chosen],
    )


def run_schedule(workers, prompts, sampling, chunk: int) -> dict[str, Any]:
    from alignflow.stages.ppo.rollout_client import RolloutRequest

    workers.chunk_size = chunk
    rows = list(range(len(prompts)))
    rollout = workers.result(workers.submit(RolloutRequest(0, rows, rows, prompts, sampling)))
    busy = workers.last_busy
    return {
        "wall_s": rollout.seconds,
        "imbalance": max(busy) / (sum(busy) / len(busy)),
        "busy_s": busy,
        "chunks_per_worker": [workers.last_chunks.count(w) for w in range(len(busy))],
        "tokens": sum(rollout.generation.lengths),
        "token_ids": rollout.generation.response_token_ids,
    }


def bench(args: argparse.Namespace, log) -> dict[str, Any]:
    import torch

    from alignflow.stages.common.generation.interface import SamplingParams, load_engine
    from alignflow.stages.common.generation.native.tensor_parallel import sharding_rule
    from alignflow.stages.common.generation.native.weights import checkpoint_tensors
    from alignflow.stages.ppo.rollout_workers import RolloutWorkers

    result: dict[str, Any] = {
        "model": args.model,
        "sequences": args.sequences,
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "workers": args.workers,
        "tensor_parallel": args.tensor_parallel,
        "chunk": args.chunk,
        "worker_threads": args.worker_threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": machine(),
        "load_before": os.getloadavg()[0],
        "rows": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        log(f"building the {args.model} engine")
        engine_dir, params = build(Path(tmp), args.model, args.batch, 32 + args.new_tokens, args.torch_step)
        result["parameters"] = params
        # One thread outside the in-process row: an OpenMP team of 2 on a machine that other processes load
        # stalls at every barrier, many times slower than the workers.
        torch.set_num_threads(1)
        in_process = load_engine(engine_dir)
        prompts, seeds, stops, lengths = skewed_request(
            in_process, args.sequences, args.new_tokens, MODELS[args.model]["vocab_size"]
        )
        result["stop_tokens"] = len(stops)
        log(
            f"request: {len(prompts)} sequences, calibrated lengths {lengths[0]}..{lengths[-1]}, "
            f"{len(stops)} stop tokens"
        )
        static_chunk = math.ceil(args.sequences / args.workers)
        with RolloutWorkers(
            engine_dir,
            args.workers,
            chunk_size=args.chunk,
            threads=args.worker_threads,
            tensor_parallel_size=args.tensor_parallel,
        ) as workers:
            for layout in args.layouts:
                order = list(range(len(prompts)))
                if layout == "shuffled":
                    random.Random(1).shuffle(order)
                p = [prompts[i] for i in order]
                sampling = SamplingParams(
                    temperature=1.0,
                    max_new_tokens=args.new_tokens,
                    seeds=[seeds[i] for i in order],
                    stop_token_ids=stops,
                    ignore_eos=True,
                )
                runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.schedules}
                run_schedule(workers, p, sampling, args.chunk)  # warm both workers' first batch shapes
                # interleaved: a disturbance of the shared machine hits every schedule
                for _ in range(args.repeats):
                    if "static" in runs:
                        runs["static"].append(run_schedule(workers, p, sampling, static_chunk))
                    if "queue" in runs:
                        runs["queue"].append(run_schedule(workers, p, sampling, args.chunk))
                    if "in-process" in runs:
                        torch.set_num_threads(os.cpu_count() or 1)
                        started = time.perf_counter()
                        generation = in_process.generate(p, sampling)
                        runs["in-process"].append(
                            {
                                "wall_s": time.perf_counter() - started,
                                "tokens": sum(generation.lengths),
                                "token_ids": generation.response_token_ids,
                            }
                        )
                        torch.set_num_threads(1)
                first = next(iter(runs.values()))[0]
                same = all(r["token_ids"] == first["token_ids"] for rs in runs.values() for r in rs)
                for schedule, rs in runs.items():
                    median = statistics.median(r["wall_s"] for r in rs)
                    row = {
                        "layout": layout,
                        "schedule": schedule,
                        "wall_s": median,
                        "wall_min_s": min(r["wall_s"] for r in rs),
                        "tokens": rs[0]["tokens"],
                        "tokens_per_s": rs[0]["tokens"] / median,
                        "same_tokens": same,
                    }
                    if schedule == "in-process":
                        row.update(chunk=args.sequences, threads=os.cpu_count() or 1)
                    else:
                        mid = sorted(rs, key=lambda r: r["wall_s"])[len(rs) // 2]
                        row.update(
                            chunk=static_chunk if schedule == "static" else args.chunk,
                            threads=workers.threads,
                            imbalance=statistics.median(r["imbalance"] for r in rs),
                            busy_s=mid["busy_s"],
                            chunks_per_worker=mid["chunks_per_worker"],
                        )
                        if schedule == "static":
                            # The split is static only if every worker took exactly one part, every time.
                            row["one_part_each"] = all(
                                r["chunks_per_worker"] == [1] * args.workers for r in rs
                            )
                    result["rows"].append(row)
                    log(json.dumps(row))
                if "static" in runs and "queue" in runs:
                    static = next(
                        r for r in result["rows"] if r["layout"] == layout and r["schedule"] == "static"
                    )
                    queue = next(
                        r for r in result["rows"] if r["layout"] == layout and r["schedule"] == "queue"
                    )
                    queue["speedup_vs_static"] = static["wall_s"] / queue["wall_s"]
            # The refit the RL loop does after every update: the whole checkpoint over the workers' gloo
            # group, each worker copying every tensor into its engine as it arrives.
            refits = [
                workers.refit(checkpoint_tensors(Path(tmp) / "checkpoint")) for _ in range(args.repeats)
            ]
            middle = sorted(refits, key=lambda r: r.seconds)[len(refits) // 2]
            replicated = sum(
                t.numel() * t.element_size()
                for n, t in checkpoint_tensors(Path(tmp) / "checkpoint")
                if sharding_rule(n).kind == "replicated"
            )
            result["refit"] = {
                "tensors": middle.tensors,
                "bytes": middle.bytes,
                "split_bytes": middle.bytes - replicated,
                "replicated_bytes": replicated,
                "bytes_sent": middle.bytes_sent,
                # The whole stream to every one of the R x k processes (the refit before it was sharded).
                "whole_stream_to_every_process_bytes": middle.bytes * args.workers * args.tensor_parallel,
                "seconds": middle.seconds,
                "worker_copy_seconds": max(w.seconds for w in middle.workers),
            }
            log(json.dumps(result["refit"]))
    # Other processes on the machine slow whichever schedule they overlap: compare runs with a load near 0.
    result["load_after"] = os.getloadavg()[0]
    return result


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=150)
    table = Table(
        title=f"Rollouts of {result['sequences']} sequences (half long, half short) on {result['workers']} "
        f"workers x {result['worker_threads']} thread(s): {result['model']} model "
        f"({result['parameters'] / 1e6:.1f}M), engine batch {result['batch']}, up to "
        f"{result['new_tokens']} new tokens, median of {result['repeats']} interleaved runs"
    )
    for column in (
        "layout",
        "schedule",
        "chunk",
        "wall s",
        "x static",
        "imbalance",
        "busy s per worker",
        "chunks per worker",
        "tokens",
        "tokens/s",
    ):
        table.add_column(column, justify="left" if column in ("layout", "schedule") else "right")
    for row in result["rows"]:
        table.add_row(
            row["layout"],
            row["schedule"] + (f" ({row['threads']} threads)" if row["schedule"] == "in-process" else ""),
            str(row["chunk"]),
            f"{row['wall_s']:.3f}",
            f"{row['speedup_vs_static']:.2f}" if "speedup_vs_static" in row else "-",
            f"{row['imbalance']:.2f}" if "imbalance" in row else "-",
            " / ".join(f"{b:.2f}" for b in row.get("busy_s", [])) or "-",
            " / ".join(map(str, row.get("chunks_per_worker", []))) or "-",
            str(row["tokens"]),
            f"{row['tokens_per_s']:.0f}",
        )
    console.print(table)
    refit = result["refit"]
    queue_walls = [r["wall_s"] for r in result["rows"] if r["schedule"] == "queue"]
    mib = 2**20
    refit_table = Table(
        title=f"Refit of the whole checkpoint over gloo, {result['workers']} replica(s) x "
        f"{result['tensor_parallel']} TP rank(s), median of {result['repeats']}"
    )
    columns = ("tensors", "stream MiB", "split MiB", "replicated MiB", "sent MiB", "whole stream to every "
               "process MiB", "sent / that", "seconds", "workers' copy s", "of fastest queue rollout")
    for column in columns:
        refit_table.add_column(column, justify="right")
    refit_table.add_row(
        str(refit["tensors"]),
        f"{refit['bytes'] / mib:.2f}",
        f"{refit['split_bytes'] / mib:.2f}",
        f"{refit['replicated_bytes'] / mib:.3f}",
        f"{refit['bytes_sent'] / mib:.2f}",
        f"{refit['whole_stream_to_every_process_bytes'] / mib:.2f}",
        f"{refit['bytes_sent'] / refit['whole_stream_to_every_process_bytes']:.3f}",
        f"{refit['seconds']:.3f}",
        f"{refit['worker_copy_seconds']:.3f}",
        f"{refit['seconds'] / min(queue_walls):.1%}" if queue_walls else "-",
    )
    console.print(refit_table)
    statics = [r for r in result["rows"] if r["schedule"] == "static"]
    console.print(
        f"{result['machine']['cpu']}, {result['machine']['cpus']} CPUs; same tokens in every schedule: "
        f"{all(r['same_tokens'] for r in result['rows'])}; static split one part per worker: "
        f"{all(r['one_part_each'] for r in statics) if statics else '-'}; {result['stop_tokens']} stop "
        "tokens; load average "
        f"before/after: {result['load_before']:.1f} / {result['load_after']:.1f}"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", choices=list(MODELS))
    parser.add_argument("--sequences", type=int, default=64, help="sequences in the request")
    parser.add_argument("--batch", type=int, default=8, help="the engine's max_batch_size")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--chunk", type=int, default=8, help="queue chunk (the engine batch keeps batches full)"
    )
    parser.add_argument(
        "--worker-threads", type=int, default=0, help="torch threads per worker; 0 = cores / workers"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", default="grouped,shuffled")
    parser.add_argument(
        "--schedules",
        default="static,queue,in-process",
        help="in-process: one engine in this process with every core's threads, for scale",
    )
    parser.add_argument(
        "--tensor-parallel", type=int, default=1, help="TP ranks per worker (engine.tensor_parallel_size)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--torch-step",
        action="store_true",
        help="the engine's torch decode step instead of its C++ decode loop (engine.cpu_decode_loop): "
        "on the tiny model the loop's steps (~30 us) are below the per-call costs, so the length "
        "skew shows only with the torch step's",
    )
    args = parser.parse_args(argv)
    args.layouts = [x for x in args.layouts.split(",") if x]
    bad = sorted(set(args.layouts) - {"grouped", "shuffled"})
    if bad:
        parser.error(f"unknown layouts {bad}; valid: grouped, shuffled")
    args.schedules = [x for x in args.schedules.split(",") if x]
    bad = sorted(set(args.schedules) - {"static", "queue", "in-process"})
    if bad or not args.schedules:
        parser.error(f"unknown schedules {bad}; valid: static, queue, in-process")
    args.worker_threads = args.worker_threads or max(
        1, (os.cpu_count() or 1) // (args.workers * args.tensor_parallel)
    )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    # stdout carries only the result (libraries log there; see engine_throughput.py).
    with contextlib.redirect_stdout(sys.stderr):
        result = bench(args, log)
    for row in result["rows"]:
        row.pop("token_ids", None)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
