"""The CPU training step's one-node ops (RMSNorm, SwiGLU, RoPE, attention) against their torch references.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/training_nodes.py [--model rl-4.7m|rl-115m] [--rounds 30]
        [--json]

Each op's forward and backward on one packed GRPO minibatch of benchmarks/rl_ladder.py (8 rows of 80 slots,
640 tokens; fp32), the C++ node (`impl="cpp"`; for attention stages/common/training/cpu_attention.py) and the
torch reference taking turns round by round. Warm: the operands stay in cache between calls. Cold: 64 MiB are
written between calls, as a training step's other layers evict the block before its op runs again, which is
what the step sees. Median milliseconds per forward+backward, and the reference's time over the node's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table

from alignflow.kernels import _cpu_extension
from alignflow.kernels.rms_norm import rms_norm
from alignflow.kernels.rope import apply_rope
from alignflow.kernels.swiglu import silu_mul
from alignflow.stages.common.training import cpu_attention

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rl_ladder import cpu_name  # noqa: E402

# (hidden, intermediate, heads): benchmarks/rl_setup.py's models.
MODELS = {"rl-4.7m": (256, 1024, 4), "rl-115m": (768, 3072, 12)}
ROWS, WIDTH = 8, 80
EVICT_BYTES = 64 * 2**20


def cases(model: str) -> dict[str, tuple[Callable[[], list[torch.Tensor]], Callable, Callable]]:
    """op -> (make its inputs, node, reference); each call returns the op's output."""
    hidden, intermediate, heads = MODELS[model]
    tokens, head_dim = ROWS * WIDTH, hidden // heads
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=gen).requires_grad_()

    angles = torch.rand(ROWS, WIDTH, 1, head_dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1)
    slots = torch.arange(WIDTH)
    bias = torch.zeros(ROWS, 1, WIDTH, WIDTH).masked_fill_(slots[None, :] > slots[:, None], float("-inf"))
    scale = head_dim**-0.5
    return {
        "rms_norm": (
            lambda: [leaf(tokens, hidden), leaf(hidden)],
            lambda x, w: rms_norm(x, w, 1e-6, "cpp"),
            lambda x, w: rms_norm(x, w, 1e-6, "torch"),
        ),
        "silu_mul": (
            lambda: [leaf(tokens, intermediate), leaf(tokens, intermediate)],
            lambda g, u: silu_mul(g, u, "cpp"),
            lambda g, u: silu_mul(g, u, "torch"),
        ),
        "rope": (
            lambda: [leaf(ROWS, WIDTH, heads, head_dim)],
            lambda x: apply_rope(x, cos, sin, "cpp"),
            lambda x: apply_rope(x, cos, sin, "torch"),
        ),
        "attention": (
            lambda: [leaf(ROWS, heads, WIDTH, head_dim) for _ in range(3)],
            lambda q, k, v: cpu_attention.attention(q, k, v, bias, scale),
            lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale),
        ),
    }


def time_once(fn: Callable, inputs: list[torch.Tensor], grad: torch.Tensor, evict: torch.Tensor | None
              ) -> float:
    if evict is not None:
        evict.add_(1.0)
    started = time.perf_counter()
    torch.autograd.grad(fn(*inputs), inputs, grad)
    return time.perf_counter() - started


def measure(model: str, rounds: int) -> list[dict]:
    evict = torch.zeros(EVICT_BYTES // 4)
    rows = []
    for op, (make, node, reference) in cases(model).items():
        inputs = make()
        grad = torch.randn_like(node(*inputs))
        for fn in (node, reference):
            for _ in range(3):
                time_once(fn, inputs, grad, None)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(rounds):
            for cache, flush in (("warm", None), ("cold", evict)):
                for name, fn in (("node", node), ("torch", reference)):
                    times.setdefault((cache, name), []).append(time_once(fn, inputs, grad, flush))
        for cache in ("warm", "cold"):
            node_ms = statistics.median(times[cache, "node"]) * 1e3
            torch_ms = statistics.median(times[cache, "torch"]) * 1e3
            rows.append({"op": op, "cache": cache, "node_ms": node_ms, "torch_ms": torch_ms,
                         "speedup": torch_ms / node_ms})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="rl-4.7m", choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if _cpu_extension.logprob_kernels() is None:
        why = _cpu_extension.logprob_kernels_unavailable_reason()
        raise SystemExit(f"the C++ nodes cannot run here: {why}")
    rows = measure(args.model, args.rounds)
    if args.json:
        print(json.dumps(rows))
        return 0
    title = (
        f"training-step nodes, {args.model}: a [{ROWS} x {WIDTH}] packed minibatch, fp32, forward+backward, "
        f"median ms of {args.rounds} rounds, {torch.get_num_threads()} threads, {cpu_name()} "
        f"({os.cpu_count()} cores)"
    )
    table = Table(title=title, title_justify="left")
    for column in ("op", "cache", "C++ node", "torch", "torch / node"):
        table.add_column(column, justify="left" if column in ("op", "cache") else "right")
    for row in rows:
        table.add_row(row["op"], row["cache"], f"{row['node_ms']:.3f}", f"{row['torch_ms']:.3f}",
                      f"{row['speedup']:.2f}x")
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
