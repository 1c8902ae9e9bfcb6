"""The RL training step on each packed layout of packing.py: prompts copied or shared, rows costed two ways.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/packing_layouts.py [--rounds 7] [--model bench] [--json]

Two minibatches of the rl_ladder's shapes: GRPO (4 prompts of 24-36 tokens x 4 completions of 32 tokens)
and PPO (16 prompts of 20-39 tokens, responses of 20-32). Layouts, interleaved round by round on one model:

- `separate, width 128`: every row its own prompt, the cost model's attention width fixed at 128 (the
  demo's 64-wide model's width, packing.ATTENTION_WIDTH);
- `separate, width A`: the same with the attention width for this model (packing.attention_width);
- `shared prompts, width A`: rows with one prompt share one copy of it (ppo.share_prompts, the default).

One step = llama_forward on the packed rows, selective log-softmax, backward, global-norm clip, fused
AdamW: the stage's fast step. The table has the packed shape, the token slots, the median milliseconds and
the speed-up over the first layout, and checks every layout's log-probs against the padded forward (max
|diff|).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from training_forward import MODELS, machine_info  # noqa: E402

from alignflow.stages.common.training.packing import attention_width  # noqa: E402
from alignflow.stages.ppo.experience import Experience, policy_logprobs  # noqa: E402


def batches(vocab: int, seed: int = 0) -> dict[str, Experience]:
    generator = torch.Generator().manual_seed(seed)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=generator).tolist()

    prompts = [tokens(n) for n in (24, 30, 33, 36)]
    grpo = Experience.of_sequences([prompts[i // 4] for i in range(16)], [tokens(32) for _ in range(16)], 0)
    prompt_lengths = torch.randint(20, 40, (16,), generator=generator).tolist()
    response_lengths = torch.randint(20, 33, (16,), generator=generator).tolist()
    ppo = Experience.of_sequences(
        [tokens(n) for n in prompt_lengths], [tokens(n) for n in response_lengths], 0
    )
    return {"GRPO 4x4": grpo, "PPO 16x1": ppo}


def measure(model_name: str, rounds: int) -> list[dict[str, Any]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=256, **MODELS[model_name]))
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-5, betas=(0.9, 0.95), fused=True)
    width = attention_width(model.config.hidden_size)
    # (On a 64-wide model the first two are one layout: the dict keeps it once.)
    layouts = {
        "separate, width 128": (False, 128),
        f"separate, width {width}": (False, width),
        f"shared prompts, width {width}": (True, width),
    }
    cases = {}
    for batch_name, exp in batches(model.config.vocab_size).items():
        with torch.no_grad():
            padded = policy_logprobs(model, exp, 1.0, lean=True)[0]
        for layout, (share, attention) in layouts.items():
            packed = exp.packing(share_prompts=share, width_of_attention=attention)
            with torch.no_grad():
                diff = float(
                    (policy_logprobs(model, exp, 1.0, lean=True, packed=packed)[0] - padded).abs().max()
                )
            cases[batch_name, layout] = (exp, packed, diff)

    def step(exp: Experience, packed) -> None:
        logp = policy_logprobs(model, exp, 1.0, lean=True, packed=packed)[0]
        (-(logp.sum() / exp.response_mask.sum())).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for exp, packed, _ in cases.values():
        step(exp, packed)
    for _ in range(rounds):
        for key, (exp, packed, _) in cases.items():
            started = time.perf_counter()
            step(exp, packed)
            times[key].append(time.perf_counter() - started)
    rows = []
    for (batch_name, layout), (_, packed, diff) in cases.items():
        first = statistics.median(times[batch_name, next(iter(layouts))])
        ms = statistics.median(times[batch_name, layout])
        rows.append(
            {
                "model": model_name,
                "batch": batch_name,
                "layout": layout,
                "rows": packed.input_ids.shape[0],
                "width": packed.input_ids.shape[1],
                "tokens": int((packed.segment_ids > 0).sum()),
                "ms": ms * 1e3,
                "speedup": first / ms,
                "max_abs_diff": diff,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--model", default="bench", choices=sorted(MODELS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = measure(args.model, args.rounds)
    machine = machine_info()
    if args.json:
        print(json.dumps({"machine": machine, "rows": rows}, indent=2))
        return 0
    table = Table(
        title=f"RL train step by packed layout, {args.model} model ({args.rounds} rounds, "
        f"{machine['threads']} threads, medians)"
    )
    for column in (
        "batch",
        "layout",
        "rows x width",
        "tokens",
        "step ms",
        "speed-up",
        "max |diff| vs padded",
    ):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(
            r["batch"],
            r["layout"],
            f"{r['rows']} x {r['width']}",
            str(r["tokens"]),
            f"{r['ms']:.1f}",
            f"{r['speedup']:.2f}x",
            f"{r['max_abs_diff']:.1e}",
        )
    Console(width=160).print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
