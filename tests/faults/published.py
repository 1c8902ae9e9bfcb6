"""What "nothing half-published" means, checked on a store: every manifest's files are there and match it."""

from __future__ import annotations

import tempfile
from pathlib import Path

from alignflow.config import StorageConfig
from alignflow.manifest import MANIFEST_NAME, materialize, read_manifest
from alignflow.storage import open_store


def manifests_under(root: str, storage: StorageConfig) -> list[str]:
    """URIs of every published output (a folder holding manifest.json) under `root`, nested ones included."""
    suffix = "/" + MANIFEST_NAME
    return sorted(
        uri[: -len(suffix)] for uri, _ in open_store(root, storage).list(root) if uri.endswith(suffix)
    )


def verify_all(root: str, storage: StorageConfig) -> list[str]:
    """Download and check (size, sha256) every file of every manifest under `root`; returns the outputs
    checked.

    Raises ManifestError naming the output and file when one is missing, short or corrupted.
    """
    outputs = manifests_under(root, storage)
    with tempfile.TemporaryDirectory() as cache:
        for uri in outputs:
            manifest = read_manifest(uri, storage)
            assert manifest.uri == uri, f"{uri}: manifest says it is {manifest.uri}"
            materialize(uri, Path(cache) / uri.replace("/", "_"), storage)
    return outputs


def unlisted_objects(root: str, storage: StorageConfig) -> list[str]:
    """Objects under `root` that no manifest lists: leftovers of a failed attempt,
    or files published twice."""
    store = open_store(root, storage)
    listed = set()
    for uri in manifests_under(root, storage):
        manifest = read_manifest(uri, storage)
        listed.add(f"{uri}/{MANIFEST_NAME}")
        listed.update(f"{uri}/{entry.path}" for entry in manifest.files)
    return sorted(uri for uri, _ in store.list(root) if uri not in listed)
