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
            torch.nn.utils.clip_grad_norm_(self._params, self.grad_clip, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_gradients(self) -> None:
        """Drop the gradients of a backward whose step must not happen (train_on's critic when the actor's
        check of the old log-probs fails)."""
        self.optimizer.zero_grad(set_to_none=True)


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
