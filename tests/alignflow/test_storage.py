"""Object store: the same operations on file:// and on a local S3 server, plus clear errors."""

from __future__ import annotations

import pytest

from alignflow.config import StorageConfig
from alignflow.storage import (
    LocalStore,
    StorageError,
    TransientStorageError,
    is_unfinished_write,
    join_uri,
    normalize_root,
    open_store,
    remove_unfinished_writes,
)


@pytest.fixture(params=["file", "s3"])
def root(request, tmp_path):
    """(root URI, StorageConfig) for each scheme."""
    if request.param == "file":
        return f"file://{tmp_path}/store", StorageConfig()
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/prefix", StorageConfig(endpoint_url=endpoint, multipart_threshold_mb=5)


def test_round_trip_bytes_files_list_delete(root, tmp_path):
    uri, cfg = root
    store = open_store(uri, cfg)
    store.put_bytes(b"hello", join_uri(uri, "a/b.txt"))
    local = tmp_path / "src.bin"
    local.write_bytes(b"x" * 1000)
    store.put_file(local, join_uri(uri, "c.bin"))
    assert store.get_bytes(join_uri(uri, "a/b.txt")) == b"hello"
    assert store.exists(join_uri(uri, "c.bin"))
    assert not store.exists(join_uri(uri, "missing"))
    listed = dict(store.list(uri))
    assert listed == {join_uri(uri, "a/b.txt"): 5, join_uri(uri, "c.bin"): 1000}
    store.get_file(join_uri(uri, "c.bin"), tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == b"x" * 1000
    store.delete_prefix(uri)
    assert list(store.list(uri)) == []


def test_missing_object_error_names_uri(root):
    uri, cfg = root
    with pytest.raises(StorageError, match=r"/nothing-here: no such object"):
        open_store(uri, cfg).get_bytes(join_uri(uri, "nothing-here"))


def test_s3_multipart_upload_of_a_large_file(s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    store = open_store(f"s3://{bucket}", StorageConfig(endpoint_url=endpoint, multipart_threshold_mb=5))
    big = tmp_path / "big.bin"
    big.write_bytes(bytes(range(256)) * (12 * 4096))  # 12 MiB: three 5 MiB parts
    store.put_file(big, f"s3://{bucket}/big.bin")
    head = store._client.head_object(Bucket=bucket, Key="big.bin")
    assert head["ETag"].strip('"').endswith("-3"), "multipart uploads have an ETag ending in -<parts>"
    store.get_file(f"s3://{bucket}/big.bin", tmp_path / "big.back")
    assert (tmp_path / "big.back").read_bytes() == big.read_bytes()


def test_unreachable_s3_endpoint_message(monkeypatch):
    from tests.conftest import free_port

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")  # so the call gets as far as connecting
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    port = free_port()  # nothing listens there
    store = open_store("s3://bucket/x", StorageConfig(endpoint_url=f"http://127.0.0.1:{port}", max_attempts=1,
                                                      connect_timeout_s=0.5))
    # a server down or restarting: the flow retries the stage
    with pytest.raises(TransientStorageError) as err:
        store.put_bytes(b"x", "s3://bucket/x/y")
    assert str(err.value).startswith(
        f"put s3://bucket/x/y failed: cannot reach S3 at http://127.0.0.1:{port} ("
    )
    assert "check storage.endpoint_url / AWS_ENDPOINT_URL_S3 and that the server is up" in str(err.value)


def test_missing_credentials_message(s3_server, monkeypatch, tmp_path):
    """No credentials anywhere boto3 looks: say so and how to set them,
    not "cannot reach S3" (the server is up)."""
    for name in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    store = open_store("s3://bucket/x", StorageConfig(endpoint_url=s3_server, max_attempts=1))
    with pytest.raises(StorageError) as err:  # bad input: exit 2, not retried
        store.put_bytes(b"x", "s3://bucket/x/y")
    assert not isinstance(err.value, TransientStorageError)
    assert str(err.value) == (
        "put s3://bucket/x/y failed: no AWS credentials (Unable to locate credentials); export "
        "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE naming a profile in "
        "~/.aws/credentials) where the stage runs; a local moto server accepts any non-empty "
        "pair"
    )


def test_missing_bucket_message(s3_server):
    store = open_store("s3://no-such-bucket/x", StorageConfig(endpoint_url=s3_server))
    with pytest.raises(StorageError, match="bucket does not exist; create it or fix storage.root"):
        store.put_bytes(b"x", "s3://no-such-bucket/x/y")


def test_normalize_root(tmp_path):
    assert normalize_root("file://./artifacts", tmp_path) == f"file://{tmp_path.resolve()}/artifacts"
    assert normalize_root("artifacts", tmp_path) == f"file://{tmp_path.resolve()}/artifacts"
    assert normalize_root("s3://b/p/", tmp_path) == "s3://b/p"
    with pytest.raises(StorageError, match="unsupported scheme 'gs' \\(valid: file://, s3://\\)"):
        normalize_root("gs://b/p", tmp_path)
    with pytest.raises(StorageError, match="missing bucket"):
        normalize_root("s3:///p", tmp_path)


def test_local_store_writes_atomically(tmp_path):
    store = LocalStore()
    uri = f"file://{tmp_path}/f.txt"
    store.put_bytes(b"one", uri)
    store.put_bytes(b"two", uri)
    assert store.get_bytes(uri) == b"two"
    assert [p.name for p in tmp_path.iterdir()] == ["f.txt"], "no temp files left behind"


def test_unfinished_writes_are_named_by_every_atomic_writer():
    assert is_unfinished_write(".tmp-abc123")                      # LocalStore.put_*
    assert is_unfinished_write(".iter_00004.parquet.0f3a.tmp")     # write_rollouts
    assert is_unfinished_write(".prompts.jsonl.x7y.tmp")           # write_jsonl
    for finished in ("iter_00004.parquet", "model.tmp", ".gitignore", "tmp-abc"):
        assert not is_unfinished_write(finished), finished


def test_remove_unfinished_writes_keeps_finished_files(tmp_path):
    keep = [tmp_path / "rollouts" / "iter_00001.parquet", tmp_path / ".hidden", tmp_path / "a.tmp"]
    drop = [tmp_path / "rollouts" / ".iter_00002.parquet.ab12.tmp", tmp_path / "deep" / "er" / ".tmp-x"]
    for path in keep + drop:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    assert remove_unfinished_writes(tmp_path) == sorted(drop)
    assert all(p.exists() for p in keep) and not any(p.exists() for p in drop)
    store = LocalStore()
    listed = {uri.rsplit("/", 1)[-1] for uri, _ in store.list(f"file://{tmp_path}")}
    assert listed == {"iter_00001.parquet", ".hidden", "a.tmp"}
