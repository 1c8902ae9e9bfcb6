"""Generation throughput of the native engine (its default path, eager, compiled) against transformers, and
refit vs build time.

Same random model, prompts and sampling (temperature 1, top-k/top-p from --top-k/--top-p, off by
default; EOS ignored so every sequence generates exactly --new-tokens tokens) for every engine:

    native            alignflow native engine as configured by default: on CUDA its decode step captured in
                      CUDA graphs (engine.cuda_graphs); on AVX-512/AVX2 CPUs in float32 its C++ decode loop
                      (engine.cpu_decode_loop); elsewhere the eager decode step
    native eager      CUDA only: the same engine with engine.cuda_graphs off (one kernel launch per op)
    native fused      CUDA only: `native` with engine.gpu_decode_kernels: triton (the graph's step on the
                      fused Triton ops of kernels/decode_step.py, attention over the live length)
    native loop       CUDA only: `native` with engine.cuda_graph_loop (the sampler and the loop's bookkeeping
                      in the graph: one replay per token, native/graphed_loop.py)
    native fused loop CUDA only: both of the above
    native step       CPU only, where the C++ loop applies: the eager torch decode step
                      (engine.cpu_decode_loop off)
    native bf16w      CPU float32, where the C++ loop applies: `native` on bf16 copies of the linear weights
                      (engine.cpu_linear_weights: bfloat16; its roofline counts the bytes in bf16)
    native+compile    the torch step with engine.compile (torch.compile of the decode step; no CUDA graphs)
    hf                alignflow hf backend: transformers generate + alignflow's sampler
    transformers      plain transformers generate(do_sample=True, top_k=0), its own multinomial sampling

Runs are interleaved (every engine once per batch size, then repeat); the fastest run is reported
(with the median beside it), because on a machine shared with other jobs a disturbed run can be several
times slower. Tokens/s counts generated tokens over the wall time of the whole generate call (prefill
included).

Every row also gives its share of the memory-bandwidth roofline: the fastest the call could be if each pass
only read its bytes at the bandwidth a device-to-device copy reaches in the same run (bytes read and written,
counted both). A decode step reads every linear weight once plus the KV cache it attends to, the prefill
every weight once plus the prompt's keys and values (benchmarks/cpu_roofline.py counts them); the roofline
time of the call is their sum over the measured bandwidth, and `% roofline` = roofline time / measured
time. On a GPU a decode step of these models is bandwidth bound at the batch sizes measured here, so this
is the share of the HBM roofline; on a CPU it ignores arithmetic (cpu_roofline.py adds the GEMM peak).

    python benchmarks/engine_throughput.py            # full table (~10 min on 2 cores)
    python benchmarks/engine_throughput.py --quick    # tiny model + batch 8 on ~100M, one repeat
    python benchmarks/engine_throughput.py --json     # machine-readable
    python benchmarks/engine_throughput.py --device cuda --models llama-100m,llama-1b --dtypes bfloat16 \
        --batch-sizes 1,8,64 --no-compile          # a GPU (scripts/gpu_check.sh runs this)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

MODELS: dict[str, dict[str, Any]] = {
    # The pipeline's demo model (alignflow.config.TinyModelConfig defaults).
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
    # ~110M parameters (85M in the layers, 25M in the tied embedding).
    "llama-100m": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                       num_key_value_heads=12, vocab_size=32000, tie_word_embeddings=True),
    # The shape of Llama-3.2-1B (1.24B parameters, 263M of them in the tied embedding), random weights.
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True, rope_theta=500000.0),
}
DEFAULT_MODELS = ("tiny", "llama-100m")  # llama-1b on request: minutes per batch size on a CPU
ENGINES = ("native", "native fused", "native loop", "native fused loop", "native bf16w", "native eager",
           "native step", "native+compile", "hf", "transformers")


def machine() -> dict[str, Any]:
    """What the figures depend on: the CPU, its core count, and whether it has bf16 arithmetic.

    Without AVX512-BF16 or AMX, bfloat16 matmuls are emulated through float32 and run several times slower
    than float32, so bf16 rows are only comparable across
    machines that agree on `bf16_arithmetic`.
    """
    import platform

    import torch

    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "bf16_arithmetic": bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()),
    }


def gpu_name(device: str) -> str | None:
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else None


def resolve_device(device: str) -> str:
    """'auto' -> 'cuda' when torch sees a GPU, else 'cpu'; anything else as given."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def copy_bandwidth_gbs(device: str, megabytes: int, repeats: int = 5) -> float:
    """Best GB/s of a device-to-device copy of `megabytes`, counting the bytes read and the bytes written.

    The roofline's bandwidth: what this device moves in this run, not its datasheet figure (an H200 copies
    at ~4.3 of its 4.8 TB/s).
    """
    import torch

    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    dst.copy_(src)
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - started)
    return 2 * src.numel() * 4 / best / 1e9


def roofline_s(name: str, prompt_lens: list[int], new_tokens: int, dtype: str, bandwidth_gbs: float) -> float:
    """Seconds of one generate call if every pass only read its bytes (weights,
    KV cache) at `bandwidth_gbs`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_roofline import generate_floor_s  # a sibling script (it imports this one's MODELS)

    return generate_floor_s(MODELS[name], prompt_lens, new_tokens, dtype, bandwidth_gbs, float("inf"))[0]


def make_checkpoint(root: Path, name: str, device: str = "cpu", dtype: str = "float32") -> tuple[Path, int]:
    """A random-init Llama of MODELS[name] saved in `dtype`; initialised on `device` (a GPU makes the 1B
    model's weights in a second where a CPU takes most of a minute)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(
            LlamaConfig(max_position_embeddings=512, bos_token_id=1, eos_token_id=2, **MODELS[name])
        )
    path = root / name
    model.to(getattr(torch, dtype)).save_pretrained(path)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    return path, n_params


def make_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, vocab, (int(length),), generator=gen).tolist()
        for length in torch.randint(8, 25, (n,), generator=gen)
    ]


class PlainTransformers:
    """transformers generate with its own sampling, on the hf backend's model (no alignflow code per step)."""

    def __init__(self, model: Any, top_k: int = 0, top_p: float = 1.0):
        self.model = model
        self.top_k, self.top_p = top_k, top_p
        self.device = next(model.parameters()).device

    def generate(self, prompts: list[list[int]], new_tokens: int) -> None:
        import torch
        from transformers import GenerationConfig

        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=self.top_k,
            top_p=self.top_p,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        out.tolist()  # waits for the device, like the engines' generate (their lengths are host lists)


def bench_model(name: str, root: Path, args: argparse.Namespace, log) -> dict[str, Any]:
    saved = "float32" if "float32" in args.dtypes else "bfloat16"
    path, n_params = make_checkpoint(
        root, name, args.device if args.device.startswith("cuda") else "cpu", saved
    )
    result: dict[str, Any] = {"throughput": [], "refit": []}
    for dtype in args.dtypes:
        part = bench_model_dtype(name, path, n_params, dtype, args, log)
        result["throughput"] += part["throughput"]
        result["refit"] += part["refit"]
    # Every row also against hf in float32, the reference configuration (parity is checked in fp32).
    hf_fp32 = {
        r["batch"]: r["tokens_per_s"]
        for r in result["throughput"]
        if r["engine"] == "hf" and r["dtype"] == "float32"
    }
    for row in result["throughput"]:
        row["speedup_vs_hf_fp32"] = (
            row["tokens_per_s"] / hf_fp32[row["batch"]] if row["batch"] in hf_fp32 else None
        )
    return result


def bench_model_dtype(
    name: str, path: Path, n_params: int, dtype: str, args: argparse.Namespace, log
) -> dict[str, Any]:
    from alignflow.config import EngineConfig
    from alignflow.stages.common.generation import SamplingParams
    from alignflow.stages.common.generation.hf_backend import HFEngine
    from alignflow.stages.common.generation.native import NativeEngine
    from alignflow.stages.common.generation.native.weights import checkpoint_tensors

    batches = args.batch_sizes if name != "llama-100m" or not args.quick else [8]
    max_batch = max(batches)
    device = args.device
    # The engine's defaults (CUDA graphs on a GPU, the C++ decode loop on a CPU where it applies): the
    # `native` row is what a user of the engine gets.
    config = EngineConfig(max_batch_size=max_batch, max_seq_len=24 + args.new_tokens)
    sampling = SamplingParams(
        temperature=1.0,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.new_tokens,
        ignore_eos=True,
        seed=0,
    )
    prompts = make_prompts(max_batch, MODELS[name]["vocab_size"])

    log(f"[{name} {dtype}] {n_params / 1e6:.1f}M parameters on {device}: building engines")
    engines: dict[str, Any] = {"native": NativeEngine.build(path, config, dtype=dtype, device=device)}
    # The torch step, eager: no CUDA graphs, no C++ loop.
    torch_step = config.model_copy(update={"cpu_decode_loop": False, "cuda_graphs": False})
    if engines["native"]._use_graphs:
        engines["native eager"] = NativeEngine.build(path, torch_step, dtype=dtype, device=device)
        fused = config.model_copy(update={"gpu_decode_kernels": "triton"})
        engines["native fused"] = NativeEngine.build(path, fused, dtype=dtype, device=device)
        for label, base in (("native loop", config), ("native fused loop", fused)):
            looped = base.model_copy(update={"cuda_graph_loop": True})
            engines[label] = NativeEngine.build(path, looped, dtype=dtype, device=device)
    if engines["native"]._decode_loop is not None:
        engines["native step"] = NativeEngine.build(path, torch_step, dtype=dtype, device=device)
        bf16w = config.model_copy(update={"cpu_linear_weights": "bfloat16"})
        engines["native bf16w"] = NativeEngine.build(path, bf16w, dtype=dtype, device=device)
    compile_build_s = None
    if not args.no_compile:
        started = time.perf_counter()
        engines["native+compile"] = NativeEngine.build(
            path, torch_step.model_copy(update={"compile": True}), dtype=dtype, device=device
        )
        compile_build_s = time.perf_counter() - started  # includes the compile warm-up (NativeEngine.warmup)
    hf = HFEngine.build(path, config, dtype=dtype, device=device)
    engines["hf"] = hf
    engines["transformers"] = PlainTransformers(hf.model, args.top_k, args.top_p)
    # hf is built for the refit anyway
    timed = [e for e in engines if args.engines is None or e in args.engines]

    def run(engine_name: str, batch: int, new_tokens: int = args.new_tokens) -> float:
        engine = engines[engine_name]
        started = time.perf_counter()
        if engine_name == "transformers":
            engine.generate(prompts[:batch], new_tokens)
        else:
            gen = engine.generate(prompts[:batch], sampling.model_copy(update={"max_new_tokens": new_tokens}))
            assert sum(gen.lengths) == batch * new_tokens
        return time.perf_counter() - started

    for engine_name in timed:  # warm-up: compilation (dynamic shapes: a few steps cover all), first calls
        for batch in batches:
            t = run(engine_name, batch, new_tokens=min(4, args.new_tokens))
            log(f"  warm-up {engine_name:15s} batch {batch:3d}: {t:.2f}s")

    times: dict[tuple[str, int], list[float]] = {}
    for repeat in range(args.repeats):
        for batch in batches:
            for engine_name in timed:
                times.setdefault((engine_name, batch), []).append(run(engine_name, batch))
        log(f"  repeat {repeat + 1}/{args.repeats} done (load average {os.getloadavg()[0]:.1f})")

    rows = []
    for batch in batches:
        # The fastest of the interleaved runs is the least disturbed by other processes on a shared
        # machine (runs of the same engine vary several-fold under load); the median is kept too.
        best = {e: min(times[(e, batch)]) for e in timed}
        lens = [len(p) for p in prompts[:batch]]
        floors = {
            engine_name: roofline_s(
                # bf16 weights stream half the bytes (the fp32 KV cache is counted in bf16 too)
                name, lens, args.new_tokens, "bfloat16" if engine_name == "native bf16w" else dtype,
                args.bandwidth_gbs,
            )
            for engine_name in timed
        }
        for engine_name in timed:
            seconds, floor_s = best[engine_name], floors[engine_name]
            paths = (
                engines[engine_name].execution_paths()
                if hasattr(engines[engine_name], "execution_paths")
                else {}
            )
            rows.append(
                {
                    "model": name,
                    "params_m": round(n_params / 1e6, 1),
                    "dtype": dtype,
                    "batch": batch,
                    "engine": engine_name,
                    "device": device,
                    "decode_step": paths.get("decode_step", "transformers"),
                    "roofline_ms_per_token_step": floor_s / args.new_tokens * 1e3,
                    "roofline_pct": 100 * floor_s / seconds,
                    "tokens_per_s": batch * args.new_tokens / seconds,
                    "ms_per_token_step": seconds / args.new_tokens * 1e3,
                    "median_tokens_per_s": batch
                    * args.new_tokens
                    / statistics.median(times[(engine_name, batch)]),
                    "runs_s": [round(t, 3) for t in times[(engine_name, batch)]],
                    "speedup_vs_hf": best["hf"] / seconds if "hf" in best else None,
                    "speedup_vs_transformers": best["transformers"] / seconds
                    if "transformers" in best
                    else None,
                }
            )

    if args.no_refit:
        return {"throughput": rows, "refit": []}
    # Refit (the PPO path: named_parameters of a live model) against a full build from disk.
    build_s, refit_s, refit_disk_s = [], [], []
    native = engines["native"]
    for _ in range(args.repeats):
        started = time.perf_counter()
        fresh = NativeEngine.build(path, config, dtype=dtype, device=device)
        build_s.append(time.perf_counter() - started)
        del fresh
        started = time.perf_counter()
        native.refit(hf.model.named_parameters())
        refit_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        native.refit(checkpoint_tensors(path))
        refit_disk_s.append(time.perf_counter() - started)
    refits = [
        {
            "model": name,
            "dtype": dtype,
            "engine": "native",
            "build_s": min(build_s),
            "refit_s": min(refit_s),
            "refit_from_safetensors_s": min(refit_disk_s),
        }
    ]
    if compile_build_s is not None:
        compiled = engines["native+compile"]
        started = time.perf_counter()
        compiled.refit(hf.model.named_parameters())
        refits.append(
            {
                "model": name,
                "dtype": dtype,
                "engine": "native+compile",
                "build_s": compile_build_s,
                "refit_s": time.perf_counter() - started,
                "refit_from_safetensors_s": None,
            }
        )
    for refit in refits:
        refit["refit_over_build"] = refit["refit_s"] / refit["build_s"]
    return {"throughput": rows, "refit": refits}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny model + batch 8 of the ~100M model, 1 repeat"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated subset of {list(MODELS)}"
    )
    parser.add_argument(
        "--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda when torch sees a GPU)"
    )
    parser.add_argument(
        "--bandwidth-mb",
        type=int,
        default=None,
        help="MiB of the device-to-device copy that measures the roofline's bandwidth "
        "(default 1024 on a GPU, 256 on a CPU)",
    )
    parser.add_argument("--no-refit", action="store_true", help="skip the refit-vs-build table")
    parser.add_argument(
        "--engines",
        default=None,
        help=f"comma-separated subset of {list(ENGINES)} to time (default: every one that applies)",
    )
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=0, help="top-k of every engine's sampling (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="top-p of every engine's sampling (1 = off)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=2, help="torch.set_num_threads (pinned for comparability)"
    )
    parser.add_argument(
        "--dtypes",
        default="float32,bfloat16",
        help="engine dtypes; every engine runs in each (bfloat16 uses AMX/AVX512-BF16 where present)",
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the native+compile engine")
    args = parser.parse_args(argv)
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(args.dtypes) <= {"float32", "bfloat16"}:
        parser.error(f"--dtypes {args.dtypes}: valid are float32, bfloat16")
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; valid: {', '.join(MODELS)}")
    args.engines = None if args.engines is None else [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in args.engines or [] if e not in ENGINES]
    if unknown:
        parser.error(f"--engines: unknown engine(s) {unknown}; valid: {', '.join(ENGINES)}")
    if args.quick:
        args.repeats = 1
    return args


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)  # no truncated columns when piped
    table = Table(
        title=f"Generation throughput ({result['new_tokens']} new tokens, top_k {result['top_k']}, "
        f"top_p {result['top_p']}, {result['threads']} threads, "
        f"best of {result['repeats']} interleaved runs)"
    )
    columns = (
        "model",
        "dtype",
        "batch",
        "engine",
        "tokens/s",
        "median tokens/s",
        "ms/step",
        "% roofline",
        "x hf (same dtype)",
        "x hf fp32",
        "x transformers (same dtype)",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("model", "dtype", "engine") else "right")

    def ratio(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    for row in result["throughput"]:
        vs_fp32 = row.get("speedup_vs_hf_fp32")
        table.add_row(
            row["model"],
            row["dtype"],
            str(row["batch"]),
            row["engine"],
            f"{row['tokens_per_s']:.1f}",
            f"{row['median_tokens_per_s']:.1f}",
            f"{row['ms_per_token_step']:.2f}",
            f"{row['roofline_pct']:.1f}",
            ratio(row["speedup_vs_hf"]),
            ratio(vs_fp32),
            ratio(row["speedup_vs_transformers"]),
        )
    console.print(table)
    console.print(
        f"Roofline: {result['bandwidth_gbs']:.1f} GB/s, a device-to-device copy on {result['device']} "
        "in this run (read + written)"
    )
    refit = Table(
        title="Refit (live named_parameters) vs build from the checkpoint directory (build of "
        "native+compile includes its compile warm-up)"
    )
    for column in (
        "model",
        "dtype",
        "engine",
        "build s",
        "refit s",
        "refit from safetensors s",
        "refit / build",
    ):
        refit.add_column(column, justify="left" if column in ("model", "dtype", "engine") else "right")
    for row in result["refit"]:
        disk = row["refit_from_safetensors_s"]
        refit.add_row(
            row["model"],
            row["dtype"],
            row["engine"],
            f"{row['build_s']:.3f}",
            f"{row['refit_s']:.3f}",
            "-" if disk is None else f"{disk:.3f}",
            f"{row['refit_over_build']:.3%}",
        )
    console.print(refit)
    box = result["machine"]
    if box.get("gpu"):
        console.print(f"GPU: {box['gpu']}")
    console.print(
        f"{box['cpu']}, {box['cpus']} CPUs, bf16 arithmetic (AVX512-BF16/AMX): "
        f"{'yes' if box['bf16_arithmetic'] else 'no, bf16 is emulated'}; load average before/after: "
        f"{result['load_before']:.1f} / {result['load_after']:.1f}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    args.device = resolve_device(args.device)
    on_gpu = args.device.startswith("cuda")
    args.bandwidth_gbs = copy_bandwidth_gbs(args.device, args.bandwidth_mb or (1024 if on_gpu else 256))

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    result: dict[str, Any] = {
        "new_tokens": args.new_tokens,
        "top_k": args.top_k,
        "top_p": args.top_p,
        "threads": args.threads,
        "repeats": args.repeats,
        "torch": torch.__version__,
        "machine": {**machine(), "gpu": gpu_name(args.device)},
        "device": args.device,
        "bandwidth_gbs": args.bandwidth_gbs,
        "load_before": os.getloadavg()[0],
        "throughput": [],
        "refit": [],
    }
    # stdout carries only the result: libraries log there (save_pretrained imports DeepSpeed through
    # accelerate, whose logger writes "Setting accelerator to CPU" to stdout), so the run's stdout goes to
    # stderr.
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(sys.stderr):
        for name in args.models:
            part = bench_model(name, Path(tmp), args, log)
            log(json.dumps(part))  # partial results survive an interrupted run
            result["throughput"] += part["throughput"]
            result["refit"] += part["refit"]
    result["load_after"] = os.getloadavg()[0]
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
