"""Shared fixtures: offline env defaults, a local S3 server (moto) on 127.0.0.1, and repo paths."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from alignflow.offline import set_offline_defaults

REPO = Path(__file__).resolve().parent.parent
set_offline_defaults()
# Tests must not pick up a developer's real AWS credentials or endpoint.
for _var in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):
    os.environ.pop(_var, None)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def s3_server():
    """A moto S3 server on 127.0.0.1 with dummy credentials; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    old = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing-key-id", "AWS_SECRET_ACCESS_KEY": "testing-secret-key",
                       "AWS_DEFAULT_REGION": "us-east-1"})
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
