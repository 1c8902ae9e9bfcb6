"""A single-process trainer with the few calls the RL stage makes of a DeepSpeed engine, on plain torch AdamW.

What it is for: one rank without ZeRO, where DeepSpeed adds start-up and nothing else: importing it and
`deepspeed.initialize` cost seconds of the RL stage's start, while its per-step cost is torch's
(docs/performance.md#start-up).
The update is the one the DeepSpeed path makes on CPU: torch AdamW (betas 0.9/0.95, eps 1e-8),
gradients clipped to `grad_clip` by global norm, no loss scaling in fp32. What it is not: a ZeRO,
multi-rank or offloading trainer; `resolve_train_backend` sends those to DeepSpeed.
"""

from __future__ import annotations

import torch

from alignflow import start_checks
from alignflow.stages.common.training.deepspeed_setup import OptimSettings


class PlainTorchTrainer:
    """`module`, `optimizer`, `backward`, `step`, `train`/`eval`, as DeepSpeed's engine (checkpoints:
    stages/common/training/trainer_state.py, for both)."""

    def __init__(self, model: torch.nn.Module, settings: OptimSettings):
        if settings.grad_accum != 1:
            raise ValueError(
                "PlainTorchTrainer steps on every backward; use grad_accum 1 or the deepspeed backend"
            )
        if settings.schedule != "constant":
            raise ValueError(
                "PlainTorchTrainer has no learning-rate schedule; use schedule 'constant' (RL) or "
                "the deepspeed backend"
            )
        self.module = model
        self.grad_clip = settings.grad_clip
        params = [p for p in model.parameters() if p.requires_grad]
        # fused: one pass per tensor for the whole update, on CPU and CUDA, where foreach loops ~10 ops per
        # tensor in C++ and takes several times as long on a small model; the weights agree to 3e-8 relative
        # after 100 steps. foreach elsewhere.
        fused = all(p.device.type in ("cpu", "cuda") for p in params)
        self.optimizer = torch.optim.AdamW(
            params,
            lr=settings.lr,
            weight_decay=settings.weight_decay,
            betas=(0.9, 0.95),
            eps=1e-8,
            **({"fused": True} if fused else {"foreach": True}),
        )
        self._params = params

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        # Attributes of the model (critic.base_model, critic.score), as DeepSpeed's engine forwards them.
        if name == "module":
            raise AttributeError(name)
        return getattr(self.module, name)

    def train(self, mode: bool = True) -> PlainTorchTrainer:
        self.module.train(mode)
        return self

    def eval(self) -> PlainTorchTrainer:
        return self.train(False)

    def zero_optimization_stage(self) -> int:
        return 0

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        """Clip by global norm, update, clear the gradients."""
        if self.grad_clip and self.grad_clip > 0:
            clip_grad_norm(self._params, self.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_gradients(self) -> None:
        """Drop the gradients of a backward whose step must not happen (train_on's critic when the actor's
        check of the old log-probs fails)."""
        self.optimizer.zero_grad(set_to_none=True)


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_ (foreach), bit for bit, without its scaling pass when nothing is clipped on a
    CPU. torch multiplies every gradient by the clamped coefficient whatever it is, so that CUDA never waits
    for the norm; on a CPU there is no wait, and multiplying by 1.0 reads and writes every gradient for
    nothing (29 ms of a 114.8M model's step). Returns the total norm."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads or any(g.device.type != "cpu" for g in grads):
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    total = torch.nn.utils.get_total_norm(grads, foreach=True)
    if float(max_norm / (total + 1e-6)) < 1.0:  # torch's coefficient, before its clamp to 1
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def resolve_train_backend(setting: str, zero_stage: int) -> str:
    """'torch' or 'deepspeed' for ppo.train_backend ('auto' | 'torch' | 'deepspeed')."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if setting == "deepspeed":
        return "deepspeed"
    if setting == "torch":
        # the RL stage checks it at start, too
        problem = start_checks.train_backend(setting, zero_stage, world)
        if problem is not None:
            raise ValueError(problem.message)
        return "torch"
    if setting != "auto":
        raise ValueError(f"train backend '{setting}' is not one of auto, torch, deepspeed")
    return "torch" if zero_stage == 0 and world == 1 else "deepspeed"


def initialize_trainer(model: torch.nn.Module, settings: OptimSettings, backend: str):
    """A PlainTorchTrainer or a DeepSpeed engine for `model` (`backend` from resolve_train_backend)."""
    if backend == "torch":
        return PlainTorchTrainer(model, settings)
    from alignflow.stages.common.training.deepspeed_setup import initialize

    return initialize(model, settings)[0]
