"""Object store over file:// and s3:// URIs; the only module that imports boto3.

Stages read and publish through this interface only. S3 calls retry transient errors with
exponential backoff (botocore's standard retry mode) and large files go up in parts. botocore retries a
call until its response headers arrive; a download cut off after that (fewer body bytes than promised) is
retried here. Every retry is counted (`storage_retries()`), and stages report the total as `storage/retries`.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from alignflow.config import StorageConfig


class StorageError(RuntimeError):
    """An object-store operation failed; the message names the URI and what to check."""


class TransientStorageError(StorageError):
    """The store kept failing in a way that passes (5xx, SlowDown, a cut-off response) through every attempt:
    worth running the stage again later, unlike a missing bucket or object."""


# Error codes S3 (and S3-compatible stores) answer when the fault is theirs and passes; botocore retried them.
_TRANSIENT_CODES = {
    "InternalError",
    "ServiceUnavailable",
    "SlowDown",
    "RequestTimeout",
    "Throttling",
    "ThrottlingException",
    "RequestLimitExceeded",
    "BandwidthLimitExceeded",
    "500",
    "502",
    "503",
    "504",
}


_retries: Counter[str] = Counter()  # S3 operation ("PutObject", "download", ...) -> retries in this process
_retries_lock = threading.Lock()  # uploads and downloads run on s3transfer's threads


def _count_retry(operation: str) -> None:
    with _retries_lock:
        _retries[operation] += 1


def storage_retries() -> dict[str, int]:
    """Retries of object-store calls made by this process so far, by operation (empty when none)."""
    with _retries_lock:
        return dict(_retries)


def is_unfinished_write(name: str) -> bool:
    """Whether a file name is the temp file of an atomic write (ours: `.tmp-*`, `.<name>.<random>.tmp`).

    Such a file exists only while its writer runs; one seen later is what a killed writer left behind.
    """
    return name.startswith(".tmp-") or (name.startswith(".") and name.endswith(".tmp"))


def remove_unfinished_writes(root: Path) -> list[Path]:
    """Delete, under `root`, the temp files that killed atomic writers left; returns what was removed.

    Only for a folder this process owns (a stage's own output): a live writer's temp file would go too.
    """
    removed = []
    for path in sorted(Path(root).rglob(".*")):
        if path.is_file() and is_unfinished_write(path.name):
            path.unlink()
            removed.append(path)
    return removed


def join_uri(root: str, *parts: str) -> str:
    """Join URI path parts with '/', whatever the scheme."""
    out = root.rstrip("/")
    for part in parts:
        out += "/" + part.strip("/")
    return out


def normalize_root(root: str, workdir: str | Path = ".") -> str:
    """Turn a bare path or a relative file:// root into an absolute file:// URI."""
    parsed = urlparse(root)
    if parsed.scheme in ("", "file"):
        raw = root[len("file://") :] if root.startswith("file://") else root
        path = Path(raw)
        if not path.is_absolute():
            path = Path(workdir) / path
        return "file://" + str(path.resolve())
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise StorageError(f"storage URI '{root}': missing bucket (expected s3://bucket/prefix)")
        return root.rstrip("/")
    raise StorageError(f"storage URI '{root}': unsupported scheme '{parsed.scheme}' (valid: file://, s3://)")


class ObjectStore:
    """Byte and file operations on full URIs of one scheme."""

    scheme: str

    def put_file(self, local_path: Path, uri: str) -> None:
        raise NotImplementedError

    def put_bytes(self, data: bytes, uri: str) -> None:
        raise NotImplementedError

    def get_bytes(self, uri: str) -> bytes:
        raise NotImplementedError

    def get_file(self, uri: str, local_path: Path) -> None:
        raise NotImplementedError

    def exists(self, uri: str) -> bool:
        raise NotImplementedError

    def list(self, prefix_uri: str) -> Iterator[tuple[str, int]]:
        """Yield (uri, size) of every object under the prefix, recursively."""
        raise NotImplementedError

    def delete_prefix(self, prefix_uri: str) -> None:
        raise NotImplementedError

    def local_path(self, uri: str) -> Path | None:
        """The file on this machine that holds the object, when there is one (file:// only)."""
        return None


def _file_path(uri: str) -> Path:
    parsed = urlparse(uri)
    if parsed.scheme not in ("", "file"):
        raise StorageError(f"'{uri}' is not a file:// URI")
    return Path(uri[len("file://") :] if uri.startswith("file://") else uri)


@contextlib.contextmanager
def _removed_on_failure(tmp: str) -> Iterator[None]:
    """Delete the temp file of an atomic write that failed (a full disk,
    say) instead of leaving half of it."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class LocalStore(ObjectStore):
    """A directory tree on this machine; writes go to a temp file then os.replace (atomic per file)."""

    scheme = "file"

    def put_file(self, local_path: Path, uri: str) -> None:
        dest = _file_path(uri)
        if Path(local_path).resolve() == dest.resolve():
            return
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        os.close(fd)
        with _removed_on_failure(tmp):
            shutil.copyfile(local_path, tmp)
            os.replace(tmp, dest)

    def put_bytes(self, data: bytes, uri: str) -> None:
        dest = _file_path(uri)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        with _removed_on_failure(tmp):
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, dest)

    def get_bytes(self, uri: str) -> bytes:
        path = _file_path(uri)
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise StorageError(f"{uri}: no such object") from None

    def get_file(self, uri: str, local_path: Path) -> None:
        src = _file_path(uri)
        if not src.is_file():
            raise StorageError(f"{uri}: no such object")
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        if src.resolve() != Path(local_path).resolve():
            shutil.copyfile(src, local_path)

    def exists(self, uri: str) -> bool:
        return _file_path(uri).is_file()

    def list(self, prefix_uri: str) -> Iterator[tuple[str, int]]:
        root = _file_path(prefix_uri)
        if not root.is_dir():
            return
        for path in sorted(root.rglob("*")):
            if path.is_file() and not is_unfinished_write(path.name):
                yield "file://" + str(path), path.stat().st_size

    def delete_prefix(self, prefix_uri: str) -> None:
        shutil.rmtree(_file_path(prefix_uri), ignore_errors=True)

    def local_path(self, uri: str) -> Path | None:
        return _file_path(uri)


@dataclass(frozen=True)
class _S3Location:
    bucket: str
    key: str


def _s3_location(uri: str) -> _S3Location:
    parsed = urlparse(uri)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise StorageError(f"'{uri}' is not an s3://bucket/key URI")
    return _S3Location(parsed.netloc, parsed.path.lstrip("/"))


class S3Store(ObjectStore):
    """S3 or any S3-compatible store through boto3 (credentials from the standard AWS chain)."""

    scheme = "s3"

    def __init__(self, config: StorageConfig):
        import boto3
        from boto3.s3.transfer import TransferConfig
        from botocore.config import Config

        self.endpoint_url = config.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or None
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=config.region or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
            config=Config(
                # total_max_attempts counts the first try; botocore's `max_attempts` counts only the retries.
                retries={"total_max_attempts": config.max_attempts, "mode": "standard"},
                connect_timeout=config.connect_timeout_s,
                read_timeout=60,
            ),
        )
        # Every attempt after a call's first is a retry (botocore numbers them in the request's context).
        self._client.meta.events.register("request-created.s3", _count_botocore_retry)
        self.max_attempts = config.max_attempts
        threshold = config.multipart_threshold_mb * 1024 * 1024
        # One attempt per download inside s3transfer: a cut-off download is retried (and counted) by
        # `_retry_cut_read`, not silently by s3transfer's own loop.
        self._transfer = TransferConfig(
            multipart_threshold=threshold, multipart_chunksize=threshold, num_download_attempts=1
        )

    def _call(self, what: str, uri: str, fn, *args, **kwargs):
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import (
            BotoCoreError,
            ClientError,
            ConnectionClosedError,
            ConnectTimeoutError,
            EndpointConnectionError,
            NoCredentialsError,
            ParamValidationError,
            PartialCredentialsError,
            ReadTimeoutError,
        )

        try:
            try:
                return fn(*args, **kwargs)
            except S3UploadFailedError as exc:  # upload_file wraps the ClientError: classify that one
                if isinstance(exc.__context__, ClientError):
                    raise exc.__context__ from None
                raise StorageError(f"{what} {uri} failed: {exc}") from None
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("404", "NoSuchKey", "NotFound"):
                raise StorageError(f"{uri}: no such object") from None
            if code == "NoSuchBucket":
                raise StorageError(f"{uri}: bucket does not exist; create it or fix storage.root") from None
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
            error = TransientStorageError if code in _TRANSIENT_CODES or status >= 500 else StorageError
            raise error(f"{what} {uri} failed: {code}: {exc}") from None
        except ParamValidationError as exc:
            raise StorageError(f"{what} {uri}: invalid S3 request ({exc})") from None
        except (ConnectionClosedError, ReadTimeoutError) as exc:  # it answered before: not a wrong endpoint
            where = self.endpoint_url or "the default AWS endpoint"
            raise TransientStorageError(
                f"{what} {uri} failed: the connection to {where} broke in each of "
                f"{self.max_attempts} attempts ({exc})"
            ) from None
        except (NoCredentialsError, PartialCredentialsError) as exc:  # found before any connection: bad input
            raise StorageError(
                f"{what} {uri} failed: no AWS credentials ({exc}); export AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE naming a profile in ~/.aws/credentials) where the "
                "stage runs; a local moto server accepts any non-empty pair"
            ) from None
        except BotoCoreError as exc:
            where = self.endpoint_url or "the default AWS endpoint"
            # Refused or timed out in every attempt: a wrong endpoint, or a server that is down or restarting.
            # The two look the same here, so it is transient (exit 1, the flow retries the stage: ~30 s of
            # delays at the defaults before a wrong endpoint's error shows) rather than bad input.
            error = (
                TransientStorageError
                if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError))
                else StorageError
            )
            raise error(
                f"{what} {uri} failed: cannot reach S3 at {where} ({exc}); "
                "check storage.endpoint_url / AWS_ENDPOINT_URL_S3 and that the server is up"
            ) from None

    def _retry_cut_read(self, what: str, uri: str, read: Callable[[], object]) -> object:
        """Run `read` (request and body), again when the body is cut off: botocore retries only until the
        response headers arrive, so a connection lost mid-body would otherwise fail the stage at once."""
        from boto3.exceptions import RetriesExceededError  # download_file's, for s3transfer's
        from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError

        for attempt in range(1, self.max_attempts + 1):
            try:
                return read()
            except (
                IncompleteReadError,
                ReadTimeoutError,
                ResponseStreamingError,
                RetriesExceededError,
            ) as exc:
                if attempt == self.max_attempts:
                    raise TransientStorageError(
                        f"{what} {uri} failed: the response was cut off in each of {attempt} attempts "
                        f"(last: {exc}); check the connection to {self.endpoint_url or 'S3'} or raise "
                        "storage.max_attempts"
                    ) from None
                _count_retry(what)
                # jittered backoff, like botocore's
                time.sleep(random.uniform(0, min(0.05 * 2**attempt, 2.0)))
        raise AssertionError("unreachable")

    def put_file(self, local_path: Path, uri: str) -> None:
        loc = _s3_location(uri)
        self._call(
            "upload",
            uri,
            self._client.upload_file,
            str(local_path),
            loc.bucket,
            loc.key,
            Config=self._transfer,
        )

    def put_bytes(self, data: bytes, uri: str) -> None:
        loc = _s3_location(uri)
        self._call("put", uri, self._client.put_object, Bucket=loc.bucket, Key=loc.key, Body=data)

    def get_bytes(self, uri: str) -> bytes:
        loc = _s3_location(uri)

        def read() -> bytes:
            response = self._call("get", uri, self._client.get_object, Bucket=loc.bucket, Key=loc.key)
            return response["Body"].read()

        return self._retry_cut_read("get", uri, read)

    def get_file(self, uri: str, local_path: Path) -> None:
        loc = _s3_location(uri)
        Path(local_path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(local_path) + ".part")
        self._retry_cut_read(
            "download",
            uri,
            lambda: self._call(
                "download",
                uri,
                self._client.download_file,
                loc.bucket,
                loc.key,
                str(tmp),
                Config=self._transfer,
            ),
        )
        os.replace(tmp, local_path)

    def exists(self, uri: str) -> bool:
        loc = _s3_location(uri)
        try:
            self._call("head", uri, self._client.head_object, Bucket=loc.bucket, Key=loc.key)
        except StorageError as exc:
            if "no such object" in str(exc):
                return False
            raise
        return True

    def list(self, prefix_uri: str) -> Iterator[tuple[str, int]]:
        loc = _s3_location(prefix_uri)
        prefix = loc.key.rstrip("/") + "/" if loc.key else ""
        paginator = self._client.get_paginator("list_objects_v2")
        pages = self._call(
            "list", prefix_uri, lambda: list(paginator.paginate(Bucket=loc.bucket, Prefix=prefix))
        )
        for page in pages:
            for obj in page.get("Contents", []):
                yield f"s3://{loc.bucket}/{obj['Key']}", int(obj["Size"])

    def delete_prefix(self, prefix_uri: str) -> None:
        loc = _s3_location(prefix_uri)
        keys = [{"Key": _s3_location(uri).key} for uri, _ in self.list(prefix_uri)]
        for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            self._call(
                "delete",
                prefix_uri,
                self._client.delete_objects,
                Bucket=loc.bucket,
                Delete={"Objects": keys[start : start + 1000]},
            )

    def create_bucket(self, bucket: str) -> None:
        """Create a bucket (tests and local stacks); a no-op when it exists."""
        try:
            self._call("create bucket", f"s3://{bucket}", self._client.create_bucket, Bucket=bucket)
        except StorageError as exc:
            if "BucketAlreadyOwnedByYou" not in str(exc) and "BucketAlreadyExists" not in str(exc):
                raise


def _count_botocore_retry(request, operation_name: str, **_) -> None:
    if request.context.get("retries", {}).get("attempt", 1) > 1:
        _count_retry(operation_name)


def open_store(uri: str, config: StorageConfig | None = None) -> ObjectStore:
    """The store that serves `uri` (file:// or a bare path -> LocalStore, s3:// -> S3Store)."""
    scheme = urlparse(uri).scheme
    if scheme in ("", "file"):
        return LocalStore()
    if scheme == "s3":
        return S3Store(config or StorageConfig())
    raise StorageError(f"'{uri}': unsupported scheme '{scheme}' (valid: file://, s3://)")
