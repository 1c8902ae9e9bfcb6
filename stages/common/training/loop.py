"""Step arithmetic, shuffled batching, section checks and progress display for the supervised stages."""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from alignflow import start_checks
from alignflow.stages.common.ranks import is_main
from alignflow.stages.common.runtime import StageInputError
from alignflow.stages.common.training.deepspeed_setup import OptimSettings
from alignflow.stages.common.training.lora import check_zero_stage


def check_training_section(cfg, section: str) -> None:
    """What a supervised stage's config section (sft, reward, dpo) must satisfy before anything loads: whole
    micro-batches on every rank per optimizer step, and no LoRA under ZeRO-3 (alignflow/start_checks.py, which
    `alignflow validate` runs too)."""
    problem = start_checks.batch_split(cfg, section)
    if problem is not None:
        raise StageInputError(problem.message)
    check_zero_stage(cfg.lora, cfg.zero_stage, section)


def optim_settings(cfg, steps: int, dtype: str) -> OptimSettings:
    """The optimiser settings of a supervised stage's section (lr, warm-up then cosine decay over `steps`; the
    global batch split over micro-batches, accumulation steps and ranks)."""
    return OptimSettings(lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                         total_steps=steps, micro_batch_size=cfg.micro_batch_size,
                         grad_accum=cfg.batch_size // (cfg.micro_batch_size * cfg.resources.world_size),
                         zero_stage=cfg.zero_stage, grad_clip=cfg.grad_clip, dtype=dtype)


def total_steps(n_examples: int, epochs: float, batch_size: int) -> int:
    """Optimizer steps for `epochs` passes (fractions allowed) over `n_examples`; at least one."""
    return max(1, math.ceil(n_examples * epochs / batch_size))


def batch_indices(n_examples: int, batch_size: int, steps: int, seed: int) -> Iterator[list[int]]:
    """`steps` batches of example indices; each epoch is a fresh seeded shuffle, batches may span epochs."""
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(steps):
        while len(order) < batch_size:
            epoch = list(range(n_examples))
            rng.shuffle(epoch)
            order.extend(epoch)
        batch, order = order[:batch_size], order[batch_size:]
        yield batch


def split_micro(indices: list[int], micro_batch_size: int) -> list[list[int]]:
    return [indices[i:i + micro_batch_size] for i in range(0, len(indices), micro_batch_size)]


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Iterator:
    """Progress on stderr (stdout carries the StageResult line): a rich bar on a terminal, else a
    plain line at every 10% so logs of stages launched by the flow (a pipe, not a TTY) show progress too.
    """
    if not is_main():  # one rank speaks for all: the others' bars would repeat rank 0's lines
        yield lambda status="": None
        return
    console = Console(file=sys.stderr)
    if console.is_terminal and not os.environ.get("CI"):
        columns = (TextColumn("[bold]{task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total}"), TextColumn("{task.fields[status]}"),
                   TimeElapsedColumn(), TimeRemainingColumn())
        with Progress(*columns, console=console) as bar:
            task = bar.add_task(description, total=total, status="")
            yield lambda status="": bar.update(task, advance=1, status=status)
        return
    started, done = time.perf_counter(), 0
    every = max(1, total // 10)

    def advance(status: str = "") -> None:
        nonlocal done
        done += 1
        if done % every == 0 or done == total:
            elapsed = time.perf_counter() - started
            eta = elapsed / done * (total - done)
            print(f"{description}: {done}/{total} {status} ({elapsed:.0f} s, eta {eta:.0f} s)",
                  file=sys.stderr, flush=True)

    yield advance
