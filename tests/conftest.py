"""Shared fixtures: offline env defaults, the --device option, a local S3 server (moto), one Prefect test
harness, a small pipeline config.

--device cpu|cuda|auto (default cpu) says where the device-agnostic tests run: the `device` fixture is "cpu"
or "cuda", and those tests put their models, tensors and engines there (engines get `device=device`
explicitly, so a cpu run on a GPU machine stays on the CPU). A test of a CPU-only path (the C++ kernels, the
chunked sampler, ...) carries `@pytest.mark.cpu_only("why")` and is skipped under --device cuda with that
reason; a test of a CUDA-only path (CUDA graphs, TensorRT-LLM) carries `@pytest.mark.cuda_only("why")` and is
skipped under --device cpu.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any

import pytest

from alignflow.config import PipelineConfig, validate_config
from alignflow.offline import set_offline_defaults

REPO = Path(__file__).resolve().parent.parent
set_offline_defaults()
# Tests must not pick up a developer's real AWS credentials or endpoint.
for _var in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
    os.environ.pop(_var, None)


DEVICE_CHOICES = ("cpu", "cuda", "auto")
TEST_DEVICE_VAR = "ALIGNFLOW_TEST_DEVICE"


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=DEVICE_CHOICES,
        default="cpu",
        help="where the device-agnostic tests run: cpu (default), cuda (the session fails to start "
        "without a GPU), auto (cuda when torch sees a GPU, else cpu)",
    )


def resolved_device(choice: str) -> str:
    """'cpu' or 'cuda' for a --device choice; a usage error for cuda where torch sees no GPU
    (never a quiet cpu run)."""
    if choice == "cpu":
        return "cpu"  # no torch import: most of the suite never needs it
    import torch

    if torch.cuda.is_available():
        return "cuda"
    if choice == "auto":
        return "cpu"
    raise pytest.UsageError(
        f"--device cuda, but torch sees no GPU on this machine (torch {torch.__version__}, CUDA build: "
        f"{torch.version.cuda or 'no'}): run the tests on a GPU machine, or use --device cpu (or auto)"
    )


@pytest.hookimpl(tryfirst=True)  # first: the other conftests' pytest_configure read the resolved device
def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "cpu_only(reason): a test of a CPU-only path (C++ kernels, the chunked "
        "sampler, ...): skipped under --device cuda, with the reason",
    )
    config.addinivalue_line(
        "markers",
        "cuda_only(reason): a test of a CUDA-only path (CUDA graphs, TensorRT-LLM): "
        "skipped under --device cpu, with the reason",
    )
    # From here on config.option.device is the resolved "cpu" or "cuda", never "auto".
    config.option.device = resolved_device(config.option.device)
    # small_config's model.device: the pipelines and stages these tests run compute there too (a GPU machine's
    # default run stays on the CPU instead of model.device auto picking its GPU).
    os.environ[TEST_DEVICE_VAR] = config.option.device
    # Runs keep no Prefect server or stage fork server for later runs (flows/kept_server.py): each test's
    # workdir would leave its own behind. The tests of kept servers turn it on for themselves.
    os.environ.setdefault("ALIGNFLOW_KEEP_S", "0")
    if config.option.device == "cpu":
        # Triton kernels on CPU tensors run in Triton's interpreter, which triton reads when it is first
        # imported (its own @jit helpers, tl.sum among them, are decorated then): set before any test module
        # imports it. tests/kernels/conftest.py refuses it under --device cuda.
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _marker_reason(item, mark) -> str:
    reason = mark.args[0] if mark.args else mark.kwargs.get("reason")
    if not reason:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.{mark.name} needs a reason, e.g. "
            f'@pytest.mark.{mark.name}("the C++ sampler")'
        )
    return reason


def pytest_collection_modifyitems(config, items):
    device = config.option.device
    for item in items:
        for name, skipped_on, runs_on in (("cpu_only", "cuda", "CPU"), ("cuda_only", "cpu", "CUDA")):
            mark = item.get_closest_marker(name)
            if mark is None:
                continue
            reason = _marker_reason(item, mark)
            if device == skipped_on:
                # First of the item's skipif marks, so that it is evaluated before any other: their conditions
                # (e.g. "the C++ kernels build here") are then never computed for a test that cannot run.
                item.add_marker(
                    pytest.mark.skipif(reason=f"{runs_on}-only path under --device {device}: {reason}"),
                    append=False,
                )


@pytest.fixture(scope="session")
def device(request) -> str:
    """Where the device-agnostic tests run: "cpu" or "cuda" (--device; auto is resolved at start)."""
    return request.config.option.device


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def one_torch_thread():
    """One intra-op thread for the test: the 2 CI cores are shared with other jobs,
    and tiny models gain nothing from more threads."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 with dummy credentials; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "testing-key-id",
            "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_server):
    """A fresh bucket on the local S3 server; yields (endpoint, bucket)."""
    import uuid

    from alignflow.config import StorageConfig
    from alignflow.storage import S3Store

    bucket = f"t-{uuid.uuid4().hex[:20]}"
    S3Store(StorageConfig(endpoint_url=s3_server)).create_bucket(bucket)
    return s3_server, bucket


@pytest.fixture(scope="session")
def prefect_harness():
    """One ephemeral Prefect API for the whole session (a fresh one costs many seconds on 2 cores)."""
    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    with prefect_test_harness(server_startup_timeout=120):
        yield


def small_config(workdir: Path, stages: list[str] | None = None, **sections: Any) -> PipelineConfig:
    """A pipeline small enough for a test: ~0.1M-parameter model, a few hundred examples, one epoch."""
    data: dict[str, Any] = {
        "name": "test",
        "workdir": str(workdir),
        "stages": stages or ["data", "base", "sft", "reward"],
        "tracking": {"experiment": "test"},
        # The device of --device (pytest_configure), so the stages these tests run compute where the session
        # does.
        "model": {
            "device": os.environ.get(TEST_DEVICE_VAR, "cpu"),
            "tiny": {
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": 320,
                "max_position_embeddings": 128,
            },
        },
        "data": {
            "demo": {"n_sft": 160, "n_preferences": 160, "n_prompts": 16, "n_eval_prompts": 8},
            "eval_fraction": 0.1,
        },
        "sft": {
            "epochs": 3,
            "batch_size": 16,
            "micro_batch_size": 8,
            "max_length": 64,
            "eval_every": 5,
            "warmup_steps": 2,
        },
        "reward": {
            "epochs": 1,
            "batch_size": 16,
            "micro_batch_size": 16,
            "max_length": 64,
            "eval_every": 5,
            "warmup_steps": 2,
        },
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return validate_config(data)
