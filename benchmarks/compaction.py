"""The RL training step on packed rows: every slot through the linear layers, or the real tokens only.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/compaction.py [--rounds 25] [--models bench] \\
        [--widths 48,64] [--json]

llama_forward's `compact` runs the embedding, linear layers, norms, RoPE and MLPs on the real tokens of packed
rows and only attention on the rows (stages/common/training/llama_forward.py). What that saves grows with the
padding the rows hold, and the scatters around attention cost a little whatever it is. This times one training
step (forward, selective log-softmax, backward, AdamW) of training_forward.py's batch (16 rows, the demo's
rollout lengths) in the packer's layouts (its cost model counting every slot, and counting tokens where the
forward compacts, as the RL stage packs) and in rows of each of `--widths` (more padding), both ways,
interleaved round by round; the table has the median process CPU ms and their ratio, and checks that both ways
give the same log-probs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))

from training_forward import MODELS, machine_info, rl_batch  # noqa: E402

from alignflow.stages.common.training import llama_forward, packing  # noqa: E402
from alignflow.stages.common.training.packing import attention_width  # noqa: E402
from alignflow.stages.ppo.experience import policy_logprobs  # noqa: E402

# compact_min_padding for each way: never, and whatever the padding.
WAYS = {"every slot": float("inf"), "real tokens": 0.0}


def measure(name: str, widths: list[int], rounds: int) -> list[dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=256, **MODELS[name]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    exp = rl_batch(model.config.vocab_size)
    hidden = model.config.hidden_size
    layouts = {
        "packer's, slots": exp.packing(width_of_attention=attention_width(hidden)),
        "packer's, tokens": exp.packing(
            width_of_attention=attention_width(hidden), compact_from=llama_forward.compact_min_padding(hidden)
        ),
    }
    for width in widths:
        layouts[f"width {width}"] = packing.pack(
            exp.input_ids, exp.attention_mask, exp.response_mask, exp.prompt_width, capacity=width
        )

    def logprobs(packed: packing.PackedRows, threshold: float) -> torch.Tensor:
        with mock.patch.object(llama_forward, "compact_min_padding", lambda hidden_size: threshold):
            return policy_logprobs(model, exp, 1.0, lean=True, packed=packed)[0]

    def step(packed: packing.PackedRows, threshold: float) -> None:
        (-logprobs(packed, threshold).sum()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    rows = []
    for layout, packed in layouts.items():
        with torch.no_grad():
            every, compact = (logprobs(packed, threshold) for threshold in WAYS.values())
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for _ in range(3):
            for threshold in WAYS.values():
                step(packed, threshold)
        for _ in range(rounds):
            for way, threshold in WAYS.items():
                started = time.process_time()
                step(packed, threshold)
                times[way].append(time.process_time() - started)
        tokens, slots = int((packed.segment_ids != 0).sum()), packed.segment_ids.numel()
        every_ms, compact_ms = (statistics.median(times[way]) * 1e3 for way in WAYS)
        rows.append(
            {
                "model": name,
                "layout": layout,
                "tokens": tokens,
                "slots": slots,
                "padding": 1 - tokens / slots,
                "every_slot_cpu_ms": every_ms,
                "real_tokens_cpu_ms": compact_ms,
                "ratio": every_ms / compact_ms,
                "max_abs_diff": float((every - compact).abs().max()),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--models", default="bench")
    parser.add_argument("--widths", default="48,64", help="row widths to pack into besides the packer's")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    try:
        widths = [int(w) for w in args.widths.split(",") if w]
    except ValueError:
        parser.error(f"--widths: {args.widths!r} is not a comma-separated list of row widths")
    rows = [row for name in names for row in measure(name, widths, args.rounds)]
    machine = machine_info()
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows}, indent=2))
        return 0
    table = Table(
        title=f"RL training step on packed rows, every slot vs the real tokens ({args.rounds} rounds, "
        f"{machine['threads']} threads, median process CPU ms)"
    )
    for column in ("model", "layout", "tokens / slots", "padding", "every slot", "real tokens", "ratio",
                   "max |diff|"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["model"],
            r["layout"],
            f"{r['tokens']} / {r['slots']}",
            f"{100 * r['padding']:.1f}%",
            f"{r['every_slot_cpu_ms']:.1f}",
            f"{r['real_tokens_cpu_ms']:.1f}",
            f"{r['ratio']:.3f}x",
            f"{r['max_abs_diff']:.1e}",
        )
    Console(file=sys.stdout, width=140).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
