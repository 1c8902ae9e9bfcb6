"""Manifests: publish writes files then the manifest; readers verify and refuse unpublished outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from alignflow.config import StorageConfig
from alignflow.manifest import (
    MANIFEST_NAME,
    InputRef,
    ManifestError,
    find_published,
    materialize,
    output_uri,
    publish,
    read_manifest,
    sha256_file,
)
from alignflow.storage import join_uri, open_store


def _folder(tmp_path):
    src = tmp_path / "out"
    (src / "sub").mkdir(parents=True)
    (src / "weights.bin").write_bytes(b"\x00\x01" * 500)
    (src / "sub" / "config.json").write_text('{"a": 1}')
    return src


@pytest.fixture(params=["file", "s3"])
def target(request, tmp_path):
    if request.param == "file":
        return f"file://{tmp_path}/store/sft/abc", StorageConfig()
    endpoint, bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/root/sft/abc", StorageConfig(endpoint_url=endpoint)


def test_publish_then_materialize_verifies(target, tmp_path):
    uri, cfg = target
    manifest = publish(_folder(tmp_path), uri, stage="sft", config={"lr": 1.0},
                       inputs={"data": InputRef(uri="file:///d", digest="d1")}, version="v1", storage=cfg)
    assert [f.path for f in manifest.files] == ["sub/config.json", "weights.bin"]
    assert manifest.files[1].size == 1000 and len(manifest.files[1].sha256) == 64
    read = read_manifest(uri, cfg)
    assert read.digest == manifest.digest and read.inputs["data"].digest == "d1" and read.code_version == "v1"
    folder, again = materialize(uri, tmp_path / "cache", cfg)
    assert (folder / "weights.bin").read_bytes() == b"\x00\x01" * 500
    assert again.digest == manifest.digest


def test_manifest_is_written_last(target, tmp_path, monkeypatch):
    """If the upload dies part-way, there is no manifest and readers refuse the output."""
    uri, cfg = target
    store = open_store(uri, cfg)
    calls = []
    original = type(store).put_file

    def failing_put(self, local, dest):
        calls.append(dest)
        if len(calls) == 2:
            raise OSError("disk full")
        return original(self, local, dest)

    monkeypatch.setattr(type(store), "put_file", failing_put)
    with pytest.raises(OSError, match="disk full"):
        publish(_folder(tmp_path), uri, stage="sft", config={}, inputs={}, version="v1", storage=cfg)
    assert find_published(uri, cfg) is None
    with pytest.raises(ManifestError, match=r"not a published output \(no manifest.json\)"):
        read_manifest(uri, cfg)


def test_corruption_is_detected(tmp_path):
    uri = f"file://{tmp_path}/store/x"
    publish(_folder(tmp_path), uri, stage="sft", config={}, inputs={}, version="v1")
    (tmp_path / "store/x/weights.bin").write_bytes(b"\x00\x02" * 500)
    with pytest.raises(ManifestError, match="file 'weights.bin' fails its sha256 check"):
        materialize(uri, tmp_path / "cache")
    (tmp_path / "store/x/weights.bin").write_bytes(b"short")
    with pytest.raises(ManifestError, match="file 'weights.bin' has 5 bytes, manifest says 1000"):
        materialize(uri, tmp_path / "cache")


def test_s3_download_is_verified_and_cached(s3_bucket, tmp_path):
    endpoint, bucket = s3_bucket
    cfg = StorageConfig(endpoint_url=endpoint)
    uri = f"s3://{bucket}/x"
    publish(_folder(tmp_path), uri, stage="sft", config={}, inputs={}, version="v1", storage=cfg)
    folder, _ = materialize(uri, tmp_path / "cache", cfg)
    assert folder.parent == tmp_path / "cache"
    open_store(uri, cfg).put_bytes(b"\x00\x02" * 500, join_uri(uri, "weights.bin"))  # same size, other bytes
    again, _ = materialize(uri, tmp_path / "cache", cfg)  # cached copy is reused, already verified
    assert (again / "weights.bin").read_bytes() == b"\x00\x01" * 500
    with pytest.raises(ManifestError, match="fails its sha256 check"):
        materialize(uri, tmp_path / "cache2", cfg)


def test_output_uri_depends_on_every_part():
    base = output_uri("s3://b/r", "sft", {"lr": 1}, {"data": "d"}, "v1")
    assert base.startswith("s3://b/r/sft/") and len(base.rsplit("/", 1)[1]) == 16
    assert output_uri("s3://b/r", "sft", {"lr": 1}, {"data": "d"}, "v1") == base
    changed = [output_uri("s3://b/r", "sft", {"lr": 2}, {"data": "d"}, "v1"),
               output_uri("s3://b/r", "sft", {"lr": 1}, {"data": "e"}, "v1"),
               output_uri("s3://b/r", "sft", {"lr": 1}, {"data": "d"}, "v2"),
               output_uri("s3://b/r", "rm", {"lr": 1}, {"data": "d"}, "v1")]
    assert len({base, *changed}) == 5


def test_publish_refuses_empty_and_reused_folders(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestError, match="produced no files"):
        publish(tmp_path / "empty", f"file://{tmp_path}/o", stage="sft", config={}, inputs={}, version="v")
    src = _folder(tmp_path)
    (src / MANIFEST_NAME).write_text(json.dumps({}))
    with pytest.raises(ManifestError, match="contains a manifest.json already"):
        publish(src, f"file://{tmp_path}/o", stage="sft", config={}, inputs={}, version="v")


# --- crafted manifests: file paths that leave the output folder are refused on read ---------------------


def _entry_for(path, name: str) -> dict:
    """A manifest file entry for `name` whose size and sha256 are those of the real file at `path`: only the
    path check can stop it."""
    return {"path": name, "size": path.stat().st_size, "sha256": sha256_file(path)}


def _add_entry(uri: str, entry: dict, cfg: StorageConfig | None = None) -> None:
    store = open_store(uri, cfg)
    manifest = json.loads(store.get_bytes(join_uri(uri, MANIFEST_NAME)))
    manifest["files"].append(entry)
    store.put_bytes(json.dumps(manifest).encode(), join_uri(uri, MANIFEST_NAME))


@pytest.mark.parametrize(
    ("name", "why"),
    [("../outside.txt", "a '..' component"), ("sub/../../outside.txt", "a '..' component"),
     ("/etc/passwd", "an absolute path")],
)
def test_a_manifest_entry_that_escapes_the_folder_is_refused(target, tmp_path, name, why):
    uri, cfg = target
    publish(_folder(tmp_path), uri, stage="sft", config={}, inputs={}, version="v1", storage=cfg)
    secret = tmp_path / "outside.txt"
    secret.write_text("not the output's")
    real = Path("/etc/passwd") if name == "/etc/passwd" else secret
    _add_entry(uri, _entry_for(real, name), cfg)
    refused = f"{uri}/{MANIFEST_NAME}: file entry {name!r} escapes the output folder ({why})"
    with pytest.raises(ManifestError) as error:
        materialize(uri, tmp_path / "cache" / "inner", cfg)
    assert str(error.value).startswith(refused)
    with pytest.raises(ManifestError, match="escapes the output folder"):
        read_manifest(uri, cfg)
    assert find_published(uri, cfg) is None  # not a finished output: a re-run publishes over it
    assert not (tmp_path / "cache" / "inner" / "outside.txt").exists()  # nothing written beside the cache


def test_a_symlinked_entry_is_refused(tmp_path):
    uri = f"file://{tmp_path}/store/x"
    publish(_folder(tmp_path), uri, stage="sft", config={}, inputs={}, version="v1")
    folder = tmp_path / "store/x"
    passwd = Path("/etc/passwd")
    (folder / "passwd").symlink_to(passwd)
    _add_entry(uri, _entry_for(passwd, "passwd"))
    with pytest.raises(ManifestError) as error:
        materialize(uri, tmp_path / "cache")
    assert str(error.value) == (
        f"{uri}: file 'passwd' is reached through a symbolic link ({folder}/passwd -> /etc/passwd); "
        "refusing the output: a published output holds plain files only"
    )

    # A symlinked folder on the way: sub/ -> a folder outside holding the same config.json.
    uri = f"file://{tmp_path}/store/y"
    publish(_folder(tmp_path / "again"), uri, stage="sft", config={}, inputs={}, version="v1")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "store/y/sub/config.json").rename(outside / "config.json")
    (tmp_path / "store/y/sub").rmdir()
    (tmp_path / "store/y/sub").symlink_to(outside)
    with pytest.raises(ManifestError, match=r"file 'sub/config.json' is reached through a symbolic link"):
        materialize(uri, tmp_path / "cache")
