"""Benchmark of kernels.selective_log_softmax against the naive fp32 log_softmax + gather (not a test).

For each (B, T, V, dtype) case it reports the best-of-N time of the forward and of forward+backward,
and the peak memory each needs on top of its inputs. On CPU every measurement runs in a fresh
child process, with glibc told to mmap every allocation above 64 KiB (so freeing returns memory to
the OS and the peak resident set, VmHWM, tracks what torch allocated); on CUDA it uses
torch.cuda.max_memory_allocated and the Triton kernels.

    python benchmarks/kernels_bench.py               # table
    python benchmarks/kernels_bench.py --json        # one JSON list on stdout
    python benchmarks/kernels_bench.py --chunk-sweep # torch reference time vs its chunk size
    python benchmarks/kernels_bench.py --rl --threads 1  # the RL training step's rows: torch reference vs C++

`--rl` times the ladder's PPO minibatch (496 response rows of the 2,048-token vocabulary, fp32) through the
torch reference and the C++ CPU kernel (impl="cpp", where it builds): selective_log_softmax, and
logprobs_and_entropy with the entropy as a metric (what the training step computes, entropy_coef 0).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time

# (B, T, V): a short-completion batch at a Llama-2 vocabulary, a longer one, and a Llama-3 vocabulary.
CASES = [(4, 256, 32_000), (2, 1024, 32_000), (1, 512, 128_256)]
DTYPES = ["bfloat16", "float32"]
METHODS = ["selective_log_softmax", "naive"]
# --rl: one ladder PPO minibatch's response rows; "op[impl]" runs op with that impl.
RL_CASE = (16, 31, 2048)
RL_OPS = ("selective_log_softmax", "logprobs_and_entropy")
MIB = 1024 * 1024


def _measure(
    method: str,
    shape: tuple[int, int, int],
    dtype_name: str,
    device: str,
    reps: int,
    threads: int,
    chunk: int | None,
) -> dict:
    """Runs in the process that measures: peak extra memory of one fwd and one fwd+bwd, then timings."""
    import torch

    from alignflow.kernels import logprobs as logprobs_module
    from alignflow.kernels import logprobs_and_entropy, selective_log_softmax

    torch.set_num_threads(threads)
    if chunk is not None:
        logprobs_module._CHUNK_ELEMENTS = chunk
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(0)
    batch, tokens, vocab = shape
    logits = (torch.randn(batch, tokens, vocab, generator=gen) * 3).to(device=device, dtype=dtype)
    index = torch.randint(0, vocab, (batch, tokens), generator=gen).to(device)
    grad_out = torch.randn(batch, tokens, generator=gen).to(device)

    op, _, impl = method.partition("[")
    impl = impl.rstrip("]") or "auto"

    def forward(x):
        if method == "naive":
            return torch.log_softmax(x.float(), dim=-1).gather(-1, index[..., None]).squeeze(-1)
        if op == "logprobs_and_entropy":
            return logprobs_and_entropy(x, index, impl=impl)[0]  # the entropy as a metric: no gradient
        return selective_log_softmax(x, index, impl=impl)

    def fwd():
        with torch.no_grad():
            forward(logits)

    def fwd_bwd():
        x = logits.detach().requires_grad_()
        torch.autograd.backward(forward(x), grad_out)
        return x.grad

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def peak_extra(fn) -> float:
        if device == "cuda":
            sync()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            fn()
            sync()
            return (torch.cuda.max_memory_allocated() - before) / MIB
        with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident set
            f.write("5")
        before = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - before) / 1024

    def best_ms(fn) -> tuple[float, float]:
        """(wall ms, process CPU ms summed over threads), each the best of ``reps`` runs.

        Best, not median: on a shared machine other jobs only ever add time. CPU time is reported too
        because it barely moves when other processes compete for the cores and wall time does.
        """
        fn()  # warm-up (Triton compile, allocator)
        wall, cpu = [], []
        for _ in range(reps):
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            sync()
            wall.append((time.perf_counter() - start) * 1e3)
            cpu.append((time.process_time() - start_cpu) * 1e3)
        return min(wall), min(cpu)

    peaks = {"peak_fwd_mib": peak_extra(fwd), "peak_fwd_bwd_mib": peak_extra(fwd_bwd)}
    if device == "cpu":
        _malloc_for_timing()
    result = {
        "method": method,
        "B": batch,
        "T": tokens,
        "V": vocab,
        "dtype": dtype_name,
        "device": device,
        "threads": threads,
        "input_mib": logits.numel() * logits.element_size() / MIB,
        **peaks,
    }
    result["fwd_ms"], result["fwd_cpu_ms"] = best_ms(fwd)
    result["fwd_bwd_ms"], result["fwd_bwd_cpu_ms"] = best_ms(fwd_bwd)
    if chunk is not None:
        result["chunk_elements"] = chunk
    return result


def _malloc_for_timing() -> None:
    """Undo MALLOC_MMAP_THRESHOLD_ for the timed runs: with every allocation mmapped, each 16 MiB scratch
    chunk would be page-faulted in afresh (~4k faults), a cost glibc's default heap reuse avoids."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 32 * MIB)  # M_MMAP_THRESHOLD: glibc's largest (its dynamic default tops out here too)
    libc.mallopt(-1, 256 * MIB)  # M_TRIM_THRESHOLD: keep freed heap memory for reuse


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _run_child(args: argparse.Namespace, method: str, shape, dtype: str, chunk: int | None) -> dict:
    if args.device == "cuda":
        return _measure(method, shape, dtype, "cuda", args.reps, args.threads, chunk)
    payload = json.dumps(
        {
            "method": method,
            "shape": shape,
            "dtype": dtype,
            "reps": args.reps,
            "threads": args.threads,
            "chunk": chunk,
        }
    )
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(args.threads))
    done = subprocess.run(
        [sys.executable, __file__, "--child", payload], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"benchmark child failed for {method} {shape} {dtype}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print_table(rows: list[dict]) -> None:
    headers = [
        "B x T x V",
        "dtype",
        "method",
        "fwd ms",
        "fwd+bwd ms",
        "fwd cpu ms",
        "fwd+bwd cpu ms",
        "peak fwd MiB",
        "peak fwd+bwd MiB",
        "input MiB",
    ]
    body = [
        [
            f"{r['B']}x{r['T']}x{r['V']}",
            r["dtype"],
            r["method"] + (f" (chunk {r['chunk_elements']})" if "chunk_elements" in r else ""),
            f"{r['fwd_ms']:.1f}",
            f"{r['fwd_bwd_ms']:.1f}",
            f"{r['fwd_cpu_ms']:.1f}",
            f"{r['fwd_bwd_cpu_ms']:.1f}",
            f"{r['peak_fwd_mib']:.0f}",
            f"{r['peak_fwd_bwd_mib']:.0f}",
            f"{r['input_mib']:.0f}",
        ]
        for r in rows
    ]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(headers)]
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
        for row in body:
            print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        return
    what = (
        "torch reference vs C++ kernel"
        if "[" in rows[0]["method"]
        else "selective_log_softmax vs log_softmax(fp32).gather"
    )
    table = Table(title=f"{what} on {rows[0]['device']}, {rows[0]['threads']} threads")
    for h in headers:
        table.add_column(h, justify="right")
    from rich.markup import escape

    for row in body:
        table.add_row(*(escape(cell) for cell in row))  # "op[impl]" is not a style tag
    Console(width=170).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--threads", type=int, default=2, help="torch intra-op threads (CI machines have 2 cores)"
    )
    parser.add_argument(
        "--reps", type=int, default=5, help="timed repetitions per measurement (best reported)"
    )
    parser.add_argument(
        "--chunk-sweep", action="store_true", help="time the torch reference at several chunk sizes"
    )
    parser.add_argument(
        "--rl",
        action="store_true",
        help="the RL training step's rows (16 x 31 x 2048 fp32): torch reference vs C++ kernel",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        spec = json.loads(args.child)
        print(
            json.dumps(
                _measure(
                    spec["method"],
                    tuple(spec["shape"]),
                    spec["dtype"],
                    "cpu",
                    spec["reps"],
                    spec["threads"],
                    spec["chunk"],
                )
            )
        )
        return 0

    rows = []
    if args.rl:
        from alignflow.kernels._triton_dispatch import cpp_available

        impls = (
            ("torch", "cpp")
            if args.device == "cpu" and cpp_available("selective_log_softmax")
            else ("torch",)
        )
        for op in RL_OPS:
            for impl in impls:
                rows.append(_run_child(args, f"{op}[{impl}]", RL_CASE, "float32", None))
    elif args.chunk_sweep:
        for chunk in (1 << 18, 1 << 20, 1 << 22, 1 << 24):
            rows.append(_run_child(args, "selective_log_softmax", (2, 1024, 32_000), "bfloat16", chunk))
    else:
        for shape in CASES:
            for dtype in DTYPES:
                for method in METHODS:
                    rows.append(_run_child(args, method, shape, dtype, None))
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        _print_table(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
