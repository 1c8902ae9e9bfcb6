"""Where a stage computes: `model.device` (auto | cpu | cuda) resolved to a torch device for this rank.

Every stage that trains, scores or generates asks here once and puts its models and batches on the answer,
so a GPU machine never trains on its CPU by accident, and a CPU run is a setting (`model.device: cpu`).
What it is not: a placement planner; one rank computes on one device (cuda:LOCAL_RANK under a launcher).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a device is resolved: stage modules import this one at start-up
    import torch

DEVICE_SETTINGS = ("auto", "cpu", "cuda")


class DeviceUnavailableError(ValueError):
    """`model.device: cuda` on a machine where torch sees no GPU."""


def compute_device(setting: str = "auto") -> torch.device:
    """The device this rank computes on for `model.device` = setting.

    auto: cuda:LOCAL_RANK when torch sees a GPU, else cpu; cpu: cpu; cuda: cuda:LOCAL_RANK, or
    DeviceUnavailableError when there is no GPU (the message says how to fix it).
    """
    import torch

    if setting not in DEVICE_SETTINGS:
        raise DeviceUnavailableError(f"model.device: {setting!r} is not one of {', '.join(DEVICE_SETTINGS)}")
    if setting == "cpu" or (setting == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(
            "model.device: cuda, but torch sees no GPU on this machine "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); "
            "run it on a GPU machine or set model.device: cpu"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceUnavailableError(
            f"LOCAL_RANK {local_rank} but this machine has {count} GPU(s): start at most "
            f"{count} rank(s) per node (resources.nproc_per_node)"
        )
    torch.cuda.set_device(local_rank)  # NCCL and the default 'cuda' device follow the rank's own GPU
    return torch.device("cuda", local_rank)


def device_of(model) -> torch.device:
    """The device of a model's (or a train engine's module's) first parameter: where it really computes."""
    module = getattr(model, "module", model)
    return next(module.parameters()).device


def device_name(device: torch.device | str) -> str:
    """'cpu', 'cuda:0': what a stage's result and MLflow run record."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)
