"""DeepSpeed set-up for one model: process-group init, the DeepSpeed config from a stage section, initialize.

On a CPU machine DeepSpeed picks its CPU accelerator and the gloo backend; a single process gets a
one-rank group on an in-memory store (no port), a launched rank the env:// rendezvous. The
first `deepspeed.initialize` on a fresh machine JIT-compiles a shared-memory comm op (minutes on
2 cores); it is cached under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions) so later
initialisations take seconds.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from alignflow import console
from alignflow.stages.common import ranks


def init_distributed(on_cuda: bool | None = None) -> None:
    """Initialise torch.distributed once: env:// under a launcher, an in-memory store for one process; NCCL
    for ranks that compute on CUDA (on_cuda; None: whether torch sees a GPU), else gloo.

    One process needs no rendezvous, so it gets a HashStore instead of a TCP port: picking a free port
    and listening on it later races with every other socket on the machine (EADDRINUSE when, say, a
    Prefect client takes the port as its ephemeral source port in between).
    """
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    on_cuda = torch.cuda.is_available() if on_cuda is None else on_cuda
    backend = "nccl" if on_cuda else "gloo"
    # On a GPU the group carries both: NCCL for the models' CUDA tensors, gloo for the CPU ones the stages
    # reduce (loss sums, token counts, broadcast objects: stages/common/ranks.py), which NCCL alone refuses.
    group_backend = "cpu:gloo,cuda:nccl" if on_cuda else "gloo"
    # A launcher (torchrun, ours in stages/common/ranks.py) sets the whole env:// set. WORLD_SIZE alone is no
    # sign of one: this function sets it below, and a process that called it (a test session) passes it on to
    # the stages it starts, where an env:// rendezvous then failed for want of MASTER_ADDR.
    if not {"MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"} <= os.environ.keys():
        for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
            os.environ[name] = value  # DeepSpeed reads these even when the group already exists
        torch.distributed.init_process_group(group_backend, store=torch.distributed.HashStore(), rank=0,
                                             world_size=1)
    else:
        torch.distributed.init_process_group(group_backend, init_method="env://")
        ranks.record_place()
    with console.library_stdout():  # DeepSpeed prints "deepspeed_shm_comm_op built successfully" here
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, verbose=False)


@dataclass(frozen=True)
class OptimSettings:
    """What DeepSpeed needs to know about one model's optimisation."""

    lr: float
    weight_decay: float
    warmup_steps: int
    total_steps: int
    micro_batch_size: int
    grad_accum: int
    zero_stage: int
    grad_clip: float
    dtype: str = "float32"
    schedule: str = "cosine"  # "cosine": linear warm-up then cosine decay; "constant": no scheduler (RL)


def deepspeed_config(settings: OptimSettings, on_cuda: bool | None = None) -> dict[str, Any]:
    """A DeepSpeed config dict: AdamW, linear warm-up then cosine decay, ZeRO stage, precision (on_cuda:
    whether the model trains on a GPU; None: whether torch sees one)."""
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": settings.grad_accum,
        "train_batch_size": settings.micro_batch_size * settings.grad_accum * world,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": {"stage": settings.zero_stage},
        # torch_adam: torch's AdamW on a GPU too. DeepSpeed's fused Adam would JIT-compile a CUDA kernel with
        # nvcc at the first step, which a machine with only torch's wheel does not have (and minutes of it
        # where it does).
        "optimizer": {"type": "AdamW", "params": {"lr": settings.lr, "weight_decay": settings.weight_decay,
                                                   "betas": [0.9, 0.95], "eps": 1e-8, "torch_adam": True}},
        "scheduler": None if settings.schedule == "constant" else {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(settings.total_steps, settings.warmup_steps + 1),
            # DeepSpeed rejects 0 warm-up steps for this scheduler; 1 step is a no-op warm-up.
            "warmup_num_steps": max(settings.warmup_steps, 1), "warmup_type": "linear",
            # cos_min_ratio: decay to 10% of the peak rather than 0, a common choice for short runs.
            "cos_min_ratio": 0.1, "warmup_min_ratio": 0.0}},
        "steps_per_print": 10**9,  # our own progress bars and MLflow metrics report progress
        "wall_clock_breakdown": False,
    }
    if config["scheduler"] is None:
        del config["scheduler"]
    if settings.dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    elif settings.dtype == "float16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16}
    if not (torch.cuda.is_available() if on_cuda is None else on_cuda):
        # DeepSpeed's fused CPU Adam needs a C++ build; torch's AdamW is as fast for small models.
        config["zero_force_ds_cpu_optimizer"] = False
    return config


def initialize(model: torch.nn.Module, settings: OptimSettings):
    """Wrap `model` in a DeepSpeed engine; returns (engine, optimizer, scheduler).

    The model trains where it is: on a GPU (DeepSpeed's CUDA accelerator, NCCL), or on the CPU (its CPU
    accelerator, gloo), also on a machine with a GPU when the stage was told `model.device: cpu`. DeepSpeed
    picks its accelerator once per process, at its first use, from DS_ACCELERATOR or the hardware; so a CPU
    model sets DS_ACCELERATOR=cpu before that first use.
    """
    on_cuda = next(model.parameters()).device.type == "cuda"
    if not on_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    init_distributed(on_cuda)
    config = deepspeed_config(settings, on_cuda)
    if not on_cuda:
        # Build the optimizer ourselves on CPU: torch AdamW (DeepSpeed's CPU Adam would JIT-compile C++).
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay,
                                      betas=(0.9, 0.95), eps=1e-8)
        config.pop("optimizer")
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config
        )
    else:
        engine, optimizer, _, scheduler = deepspeed.initialize(
            model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config
        )
    return engine, optimizer, scheduler


def full_state_dict(engine) -> dict[str, torch.Tensor]:
    """The full (unsharded) model state dict on CPU, gathering ZeRO-3 partitions when needed."""
    if engine.zero_optimization_stage() == 3:
        state = engine._zero3_consolidated_16bit_state_dict()
    else:
        state = engine.module.state_dict()
    return {k: v.detach().to("cpu").clone() for k, v in state.items()} if state is not None else {}


def stream_weights(engine) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, tensor) pairs of the engine's model, one at a time, for an inference engine's
    refit.

    Under ZeRO-3 each parameter is gathered on its own and released after the consumer copied it,
    so the peak extra memory is one parameter, not a second model.
    """
    module = engine.module
    zero3 = engine.zero_optimization_stage() == 3
    for name, tensor in module.state_dict(keep_vars=True).items():
        if zero3 and hasattr(tensor, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([tensor], modifier_rank=None):
                yield name, tensor.detach()
        else:
            yield name, tensor.detach()
