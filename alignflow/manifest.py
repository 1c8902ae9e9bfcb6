"""Manifests: atomic publishing of stage outputs, content digests, verified reads, and output locations.

A published output is a folder of files plus `manifest.json`, written last. The manifest lists every
file with its size and sha256, the producing stage, the resolved config, the inputs (URI and digest)
and the code version. A reader trusts nothing without a manifest, and checks sizes and checksums. A file
path that would leave the output's folder (absolute, `..`, a symbolic link) refuses the whole manifest:
a crafted one could otherwise make a reader download over, or verify and hand on, any file it can reach.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from alignflow import __version__
from alignflow.config import StorageConfig
from alignflow.storage import StorageError, join_uri, open_store

MANIFEST_NAME = "manifest.json"
MANIFEST_SCHEMA_VERSION = 1


class ManifestError(StorageError):
    """An output is unpublished, incomplete or corrupted."""


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str
    size: int
    sha256: str


class InputRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uri: str
    digest: str


class Manifest(BaseModel):
    """What a published output is, where it came from, and how to check it."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = MANIFEST_SCHEMA_VERSION
    stage: str
    uri: str
    created_at: float = Field(default_factory=time.time)
    code_version: str
    config: dict[str, Any]
    inputs: dict[str, InputRef] = Field(default_factory=dict)
    files: list[FileEntry]
    summary: dict[str, Any] = Field(default_factory=dict, description="Small results: metrics, reports.")
    digest: str = Field(
        "", description="sha256 over the sorted (path, size, sha256) list: the content digest."
    )

    def file(self, path: str) -> FileEntry:
        for entry in self.files:
            if entry.path == path:
                return entry
        raise ManifestError(f"{self.uri}: manifest has no file '{path}'")

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def escaping_path(path: str) -> str | None:
    """Why a manifest's file path would leave its output folder, or None for a plain relative path."""
    if not path or "\x00" in path:
        return "an empty path or a NUL byte"
    if path.startswith("/"):
        return "an absolute path"
    if ".." in path.split("/"):
        return "a '..' component"
    return None


def _symlink_on_the_way(folder: Path, path: str) -> Path | None:
    """The first symbolic link among `folder/path` and the folders between, or None."""
    current = folder
    for part in path.split("/"):
        current = current / part
        if current.is_symlink():
            return current
    return None


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def content_digest(files: list[FileEntry]) -> str:
    blob = json.dumps([[f.path, f.size, f.sha256] for f in sorted(files, key=lambda f: f.path)])
    return hashlib.sha256(blob.encode()).hexdigest()


def code_version() -> str:
    """Package version plus git commit (and a digest of uncommitted changes) when run from a checkout.

    ALIGNFLOW_CODE_VERSION overrides it (container images bake in the commit they were built from).
    """
    override = os.environ.get("ALIGNFLOW_CODE_VERSION")
    if override:
        return override
    repo = Path(__file__).resolve().parent.parent
    if not (repo / ".git").exists():
        return __version__
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
        diff = subprocess.run(
            ["git", "-C", str(repo), "diff", "HEAD", "--", "alignflow", "flows", "stages", "kernels"],
            capture_output=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return __version__
    version = f"{__version__}+g{commit}"
    if diff:
        version += ".dirty" + hashlib.sha256(diff).hexdigest()[:8]
    return version


def output_uri(root: str, stage: str, config: Any, input_digests: dict[str, str], version: str) -> str:
    """Where a stage publishes: a digest of (stage, config, input digests, code version) under the root.

    The same inputs land in the same place, so a re-run finds the finished manifest and skips the work.
    """
    key = json.dumps(
        {"stage": stage, "config": config, "inputs": input_digests, "code": version},
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    )
    return join_uri(root, stage, hashlib.sha256(key.encode()).hexdigest()[:16])


def publish(
    local_dir: Path,
    uri: str,
    *,
    stage: str,
    config: dict[str, Any],
    inputs: dict[str, InputRef],
    version: str,
    summary: dict[str, Any] | None = None,
    storage: StorageConfig | None = None,
) -> Manifest:
    """Upload every file under `local_dir` to `uri`, then write the manifest last.

    A crash part-way leaves files without a manifest, which readers refuse; a re-run overwrites them.
    """
    local_dir = Path(local_dir)
    if (local_dir / MANIFEST_NAME).exists():
        raise ManifestError(f"{local_dir}: contains a {MANIFEST_NAME} already; publish a fresh folder")
    store = open_store(uri, storage)
    entries: list[FileEntry] = []
    for path in sorted(p for p in local_dir.rglob("*") if p.is_file()):
        rel = path.relative_to(local_dir).as_posix()
        entries.append(FileEntry(path=rel, size=path.stat().st_size, sha256=sha256_file(path)))
        store.put_file(path, join_uri(uri, rel))
    if not entries:
        raise ManifestError(f"stage '{stage}' produced no files in {local_dir}; nothing to publish")
    manifest = Manifest(
        stage=stage,
        uri=uri,
        code_version=version,
        config=config,
        inputs=inputs,
        files=entries,
        summary=summary or {},
    )
    manifest.digest = content_digest(entries)
    store.put_bytes(manifest.model_dump_json(indent=2).encode(), join_uri(uri, MANIFEST_NAME))
    return manifest


def read_manifest(uri: str, storage: StorageConfig | None = None) -> Manifest:
    """Read the manifest of a published output; refuse an output without one."""
    store = open_store(uri, storage)
    try:
        raw = store.get_bytes(join_uri(uri, MANIFEST_NAME))
    except StorageError as exc:
        if "no such object" in str(exc):
            raise ManifestError(
                f"{uri}: not a published output (no {MANIFEST_NAME}); "
                "it is missing or its stage did not finish"
            ) from None
        raise
    try:
        manifest = Manifest.model_validate_json(raw)
    except ValueError as exc:
        raise ManifestError(f"{uri}/{MANIFEST_NAME}: unreadable manifest ({exc})") from None
    for entry in manifest.files:
        why = escaping_path(entry.path)
        if why is not None:
            raise ManifestError(
                f"{uri}/{MANIFEST_NAME}: file entry {entry.path!r} escapes the output folder ({why}); "
                "refusing the output: a published output lists plain relative paths only"
            )
    return manifest


def find_published(uri: str, storage: StorageConfig | None = None) -> Manifest | None:
    """The manifest at `uri` if the output there is complete, else None (used to skip finished stages)."""
    try:
        return read_manifest(uri, storage)
    except ManifestError:
        return None


def _verify_local(manifest: Manifest, folder: Path) -> None:
    for entry in manifest.files:
        path = folder / entry.path
        link = _symlink_on_the_way(folder, entry.path)
        if link is not None:
            raise ManifestError(
                f"{manifest.uri}: file '{entry.path}' is reached through a symbolic link ({link} -> "
                f"{os.readlink(link)}); refusing the output: a published output holds plain files only"
            )
        if not path.is_file():
            raise ManifestError(f"{manifest.uri}: file '{entry.path}' listed in the manifest is missing")
        if path.stat().st_size != entry.size:
            raise ManifestError(
                f"{manifest.uri}: file '{entry.path}' has {path.stat().st_size} bytes, "
                f"manifest says {entry.size}"
            )
        if sha256_file(path) != entry.sha256:
            raise ManifestError(f"{manifest.uri}: file '{entry.path}' fails its sha256 check (corrupted)")


def materialize(uri: str, cache_dir: Path, storage: StorageConfig | None = None) -> tuple[Path, Manifest]:
    """A verified local folder holding the output at `uri`.

    file:// outputs are verified in place (no copy: checkpoints are never duplicated on disk);
    s3:// outputs are downloaded once into `cache_dir/<digest>` and verified.
    """
    manifest = read_manifest(uri, storage)
    store = open_store(uri, storage)
    local = store.local_path(uri)
    if local is not None:
        _verify_local(manifest, local)
        return local, manifest
    target = Path(cache_dir) / manifest.digest[:16]
    done = target / ".verified"
    if done.exists():
        return target, manifest
    for entry in manifest.files:
        store.get_file(join_uri(uri, entry.path), target / entry.path)
    _verify_local(manifest, target)
    done.write_text(manifest.digest)
    return target, manifest
