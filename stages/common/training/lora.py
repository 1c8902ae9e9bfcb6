"""LoRA for every trainable stage: peft adapters from a `LoRAConfig`, and the merged weights that leave.

What it does: checks the config against the model (each target name must be a linear layer; errors
name the config key), wraps the model with peft (the optimiser then sees only `requires_grad`
parameters: the adapters, and a classifier/value head trained whole), and turns the trained
model back into plain HF tensors: `merged_state_dict` (every weight, the adapted ones as
W + (alpha / r) * B @ A) for checkpoints, `merged_adapted_weights` (only the adapted modules) for
an engine's refit. What it is not: a trainer, or a place that knows which stage calls it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

from alignflow import start_checks
from alignflow.config import LoRAConfig
from alignflow.stages.common.ranks import is_main
from alignflow.stages.common.runtime import StageInputError
from alignflow.stages.common.training.deepspeed_setup import full_state_dict

ADAPTER_DIR = "adapter"
_PEFT_WRAPPER_PREFIX = "base_model.model."


class LoRAConfigError(StageInputError):
    """A LoRA setting that does not fit the model; the message names the config key
    (bad input: exit code 2)."""


def check_zero_stage(cfg: LoRAConfig, zero_stage: int, section: str) -> None:
    """LoRA under ZeRO-3 is refused: merging the adapters needs each whole weight on one rank
    (alignflow/start_checks.py, which `alignflow validate` runs too)."""
    problem = start_checks.lora_zero_stage(cfg, zero_stage, section)
    if problem is not None:
        raise LoRAConfigError(problem.message)


def linear_layer_names(model: torch.nn.Module) -> list[str]:
    """The distinct last path components of the model's nn.Linear modules (what target_modules may name)."""
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name
        }
    )


def apply_lora(
    model: torch.nn.Module, cfg: LoRAConfig, key: str, classifier: bool = False
) -> torch.nn.Module:
    """`model` with adapters on `cfg.target_modules` (or `model` itself when LoRA is off).

    classifier: a sequence classifier (reward model, critic): its `score` head is trained whole.
    Raises LoRAConfigError naming `<key>.target_modules` for a name that matches no linear layer.
    """
    if not cfg.enabled:
        return model
    import peft

    linear = linear_layer_names(model)
    missing = [name for name in cfg.target_modules if name not in linear]
    if missing:
        raise LoRAConfigError(
            f"{key}.target_modules: {', '.join(repr(m) for m in missing)} matches no linear layer "
            f"of the model ({type(model).__name__}); its linear layers are: {', '.join(linear)}"
        )
    head = ["score"] if classifier else []
    if any(name in head for name in cfg.target_modules):
        raise LoRAConfigError(
            f"{key}.target_modules: 'score' is the scalar head, trained whole; leave it out"
        )
    peft_cfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        modules_to_save=head or None,
        bias="none",
    )
    return peft.get_peft_model(model, peft_cfg)


def is_lora(model: torch.nn.Module) -> bool:
    """Whether `model` is a peft model (no peft import when nothing imported it: then nothing can be one)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def unwrap_lora(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a PeftModel's wrapper
    (with the adapters injected in its layers); `model` otherwise."""
    return model.get_base_model() if is_lora(model) else model


class AdaptersDisabled(torch.nn.Module):
    """The frozen base of a PeftModel as a model of its own: its forward runs with the adapters disabled.

    LoRA never changes the base weights, so this is the model training started from (the RL reference)
    without a second copy of it in memory. Not a registered submodule of anything: it holds the peft model in
    a list so `parameters()` is empty and nothing trains or saves it twice.
    """

    def __init__(self, peft_model: torch.nn.Module):
        super().__init__()
        self._peft = [peft_model]
        self.config = peft_model.config

    def forward(self, *args, **kwargs):
        with self._peft[0].disable_adapter():
            return self._peft[0](*args, **kwargs)


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters; with LoRA, total counts the frozen base once and the adapters."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def _lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """(HF module name, peft LoRA layer) of every adapted module of a PeftModel."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and name.startswith(_PEFT_WRAPPER_PREFIX):
            yield name.removeprefix(_PEFT_WRAPPER_PREFIX), module


@torch.no_grad()
def merged_adapted_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF parameter name, W + delta) for each adapted module only, one at a time: what a refit must send.

    The model is not modified (no merge/unmerge round trip that would drift the base weights in fp32).
    """
    for name, layer in _lora_layers(model):
        base = layer.get_base_layer().weight
        delta = sum(layer.get_delta_weight(adapter) for adapter in layer.active_adapters)
        yield f"{name}.weight", (base + delta.to(base.dtype)).detach()


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain HF state dict of a PeftModel with its adapters merged (CPU copies).

    A model without adapters goes through `save_trained`'s full_state_dict (which also gathers ZeRO-3
    partitions).
    """
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        key = key.removeprefix(_PEFT_WRAPPER_PREFIX)
        if "lora_" in key or ".original_module." in key:
            continue  # adapters are merged below; a trained head's frozen original is superseded
        key = key.replace(".base_layer.", ".").replace(".modules_to_save.default.", ".")
        state[key] = value.detach().to("cpu").clone()
    for name, weight in merged_adapted_weights(model):
        state[name] = weight.to("cpu").clone()
    return state


@contextlib.contextmanager
def _no_deepspeed_import() -> Iterator[None]:
    """save_pretrained without importing DeepSpeed when this process has not: transformers unwraps the model
    through accelerate, which imports deepspeed (and with it mlflow) just to ask whether the model is a
    DeepSpeed engine, seconds at the end of a PPO stage on the plain torch trainer. A model cannot be a
    DeepSpeed engine when deepspeed was never imported."""
    if "deepspeed" in sys.modules:
        yield
        return
    from accelerate.utils import other

    with mock.patch.object(other, "is_deepspeed_available", lambda: False):
        yield


def save_trained(engine, out: Path) -> None:
    """Save a training engine's model as an HF checkpoint in `out`: merged (plus adapter/) with LoRA, else the
    full state dict (ZeRO-3 partitions gathered). Call it on every rank; rank 0 writes."""
    if is_lora(engine.module):  # LoRA is refused under ZeRO-3: every rank holds the whole model
        if is_main():
            save_merged(engine.module, out)
        return
    # a collective under ZeRO-3: every rank takes part, rank 0 gets the weights
    state = full_state_dict(engine)
    if is_main():
        with _no_deepspeed_import():
            engine.module.save_pretrained(out, state_dict=state, safe_serialization=True)


def save_merged(model: torch.nn.Module, out: Path) -> None:
    """An HF checkpoint in `out` with the adapters of PeftModel `model` merged, plus the adapter files under
    `out/adapter/` (adapter_config.json, adapter_model.safetensors: base + adapter loads with peft)."""
    with _no_deepspeed_import():
        model.get_base_model().save_pretrained(
            out, state_dict=merged_state_dict(model), safe_serialization=True
        )
        model.save_pretrained(out / ADAPTER_DIR, safe_serialization=True)
