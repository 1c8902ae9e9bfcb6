"""model.device resolves to this rank's device: the GPU when asked or when auto finds one, never by chance."""

from __future__ import annotations

import pytest
import torch

from alignflow.stages.common import devices
from alignflow.stages.common.devices import DeviceUnavailableError, compute_device, device_name, device_of


@pytest.fixture
def fake_gpus(monkeypatch):
    """torch sees `count` GPUs (set by the test); set_device calls are recorded."""
    chosen: list[int] = []
    state = {"count": 2}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: state["count"] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    return state, chosen


def test_cpu_is_a_choice_even_beside_a_gpu(fake_gpus):
    assert compute_device("cpu") == torch.device("cpu")


def test_auto_and_cuda_take_the_ranks_own_gpu(fake_gpus, monkeypatch):
    state, chosen = fake_gpus
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert compute_device("auto") == torch.device("cuda", 1)
    assert compute_device("cuda") == torch.device("cuda", 1)
    assert chosen == [1, 1]
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(DeviceUnavailableError, match="LOCAL_RANK 2 but this machine has 2 GPU"):
        compute_device("cuda")


def test_without_a_gpu_auto_is_the_cpu_and_cuda_says_how_to_fix_it(fake_gpus):
    state, _ = fake_gpus
    state["count"] = 0
    assert compute_device("auto") == torch.device("cpu")
    with pytest.raises(DeviceUnavailableError, match="model.device: cpu"):
        compute_device("cuda")
    with pytest.raises(DeviceUnavailableError, match="not one of auto, cpu, cuda"):
        compute_device("gpu")


def test_a_models_device_is_where_its_parameters_are():
    model = torch.nn.Linear(2, 2)
    assert device_of(model) == torch.device("cpu")
    assert device_name(device_of(model)) == "cpu"

    class Engine:  # a DeepSpeed / torch train engine: the model is its .module
        module = model

    assert device_of(Engine()) == torch.device("cpu")
    assert devices.device_name("cuda:1") == "cuda:1"
