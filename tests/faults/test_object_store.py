"""Object-store faults: S3 (moto) behind a seeded proxy that drops connections, answers 500 / 503 SlowDown,
stalls, and cuts downloads off. What must hold: the pipeline finishes, every manifest verifies against its
files, each retry is counted in the stage metrics (`storage/retries`), and when the faults outlast the
retries the error names the object and operation and no output is half-published."""

from __future__ import annotations

import re
import threading

import pytest

from alignflow.config import StorageConfig
from alignflow.manifest import find_published
from alignflow.storage import S3Store, StorageError, open_store, storage_retries
from tests.conftest import small_config
from tests.faults.published import unlisted_objects, verify_all
from tests.faults.s3_fault_proxy import FaultPlan

STAGE_FAULTS = {"drop": 1.0, "500": 1.0, "503": 1.0, "stall": 0.5, "truncate": 1.0}


def run_pipeline(config) -> dict[str, dict]:
    from alignflow.flows.pipeline import alignflow_pipeline

    return {row["key"]: row for row in alignflow_pipeline(config)}


def total_retries() -> int:
    return sum(storage_retries().values())


def test_every_s3_fault_is_retried_and_counted(s3_bucket, fault_proxy, tmp_path):
    """Store calls through 30% faults (all five kinds) return the right bytes; one retry counted per fault."""
    endpoint, bucket = s3_bucket
    fault_proxy.set_plan(FaultPlan(rate=0.3, weights=STAGE_FAULTS, seed=7, stall_s=0.2))
    # 10 attempts: at 30% a call fails 10 times running with p = 6e-6 (5 would fail 1 in 400 calls).
    store = S3Store(
        StorageConfig(endpoint_url=fault_proxy.endpoint, max_attempts=10, multipart_threshold_mb=5)
    )
    before = total_retries()
    root = f"s3://{bucket}/ops"
    blobs = {f"{root}/obj-{i}": bytes([i]) * (1000 * i + 1) for i in range(20)}
    for uri, data in blobs.items():
        store.put_bytes(data, uri)
    for uri, data in blobs.items():
        assert store.exists(uri)
        assert store.get_bytes(uri) == data
        store.get_file(uri, tmp_path / "copy")
        assert (tmp_path / "copy").read_bytes() == data
    assert dict(store.list(root)) == {uri: len(data) for uri, data in blobs.items()}
    assert not store.exists(f"{root}/absent")
    assert set(fault_proxy.faults) == set(STAGE_FAULTS), (
        f"every kind injected at least once: {fault_proxy.faults}"
    )
    # Exact: a fault retried silently (s3transfer's own download loop) or not at all would break the equality.
    assert total_retries() - before == fault_proxy.retryable, (storage_retries(), fault_proxy.faults)


def test_cut_off_download_is_retried_not_returned_short(s3_bucket, fault_proxy):
    """A GET whose body stops half-way: botocore's retries are over once headers arrive;
    the store retries it."""
    endpoint, bucket = s3_bucket
    uri = f"s3://{bucket}/cut/blob"
    S3Store(StorageConfig(endpoint_url=endpoint)).put_bytes(b"x" * 100_000, uri)
    cuts = iter([True, True, False])
    fault_proxy.set_plan(
        FaultPlan(
            rate=1.0,
            weights={"truncate": 1.0},
            only=lambda method, path: method == "GET" and next(cuts, False),
        )
    )
    store = S3Store(StorageConfig(endpoint_url=fault_proxy.endpoint, max_attempts=3))
    before = storage_retries().get("get", 0)
    assert store.get_bytes(uri) == b"x" * 100_000
    assert storage_retries().get("get", 0) - before == 2
    fault_proxy.set_plan(FaultPlan(rate=1.0, weights={"truncate": 1.0}))
    with pytest.raises(
        StorageError, match=rf"^get {uri} failed: the response was cut off in each of 3 attempts"
    ):
        store.get_bytes(uri)


def faulty_pipeline_config(workdir, bucket, endpoint, stages=("data", "base", "sft"), **storage):
    return small_config(
        workdir,
        stages=list(stages),
        sft={"epochs": 0.5},
        storage={"root": f"s3://{bucket}/runs", "endpoint_url": endpoint, **storage},
    )


@pytest.mark.slow
def test_pipeline_finishes_through_s3_faults_with_verified_outputs_and_counted_retries(
    tmp_path, prefect_harness, s3_bucket, fault_proxy
):
    endpoint, bucket = s3_bucket
    fault_proxy.set_plan(FaultPlan(rate=0.15, weights=STAGE_FAULTS, seed=18, stall_s=0.5))
    config = faulty_pipeline_config(tmp_path, bucket, fault_proxy.endpoint, max_attempts=10)
    rows = run_pipeline(config)
    assert {k: r["status"] for k, r in rows.items()} == {"data": "ok", "base": "ok", "sft": "ok"}
    retries = {k: r["metrics"]["storage/retries"] for k, r in rows.items()}
    assert sum(retries.values()) > 0, (retries, fault_proxy.faults)
    # The flow's own reads (manifests of finished stages) retry too, outside any stage: at most all faults.
    assert sum(retries.values()) <= fault_proxy.retryable, (retries, fault_proxy.faults)
    direct = StorageConfig(endpoint_url=endpoint)  # check behind the proxy's back
    outputs = verify_all(f"s3://{bucket}/runs", direct)
    assert sorted(outputs) == sorted(r["output_uri"] for r in rows.values())
    assert unlisted_objects(f"s3://{bucket}/runs", direct) == [], "an object no manifest lists"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = client.get_run(rows["sft"]["mlflow_run_id"]).data.metrics
    assert logged["storage/retries"] == retries["sft"]


@pytest.mark.slow
def test_faults_outlasting_the_retries_name_the_object_and_publish_nothing_partial(
    tmp_path, prefect_harness, s3_bucket, fault_proxy
):
    """The data stage's first two uploads get through, then every PUT fails: the stage stops naming the
    object, the flow retries it once (a transient fault, unlike bad input) and gives up, the files that got
    through stay without a manifest (so nothing reads them), and a re-run with S3 healthy publishes the output
    whole."""
    endpoint, bucket = s3_bucket
    puts = iter(range(1_000_000))
    lock = threading.Lock()

    def after_two_puts(method: str, path: str) -> bool:
        with lock:
            return method == "PUT" and next(puts) >= 2

    fault_proxy.set_plan(
        FaultPlan(rate=1.0, weights={"503": 1.0, "500": 1.0, "drop": 1.0}, seed=3, only=after_two_puts)
    )
    config = faulty_pipeline_config(tmp_path, bucket, fault_proxy.endpoint, stages=["data"], max_attempts=3)
    config = config.model_copy(
        update={"deployment": config.deployment.model_copy(update={"stage_retries": 1, "retry_delay_s": 0.0})}
    )
    with pytest.raises(Exception) as failure:
        run_pipeline(config)
    message = str(failure.value)
    pattern = rf"stage 'data' failed: upload (s3://{bucket}/runs/data/[0-9a-f]{{16}})/\S+ failed: "
    match = re.search(pattern, message)
    assert match, message
    output = match.group(1)
    assert re.search(r"SlowDown|InternalError|connection to \S+ broke in each of 3 attempts", message), (
        message
    )
    # 2 that got through, then 3 attempts of the third file; the flow's retry: 3 attempts of the first file.
    assert fault_proxy.requests["PUT"] == 2 + 3 + 3, "\n".join(map(str, fault_proxy.fault_log))
    direct = StorageConfig(endpoint_url=endpoint)
    assert find_published(output, direct) is None
    assert verify_all(f"s3://{bucket}/runs", direct) == []
    left = [uri for uri, _ in open_store(output, direct).list(output)]
    assert len(left) == 2, left  # what got through before the faults: files without a manifest

    fault_proxy.set_plan(FaultPlan())
    rows = run_pipeline(config)
    assert rows["data"]["status"] == "ok" and rows["data"]["output_uri"] == output
    assert verify_all(f"s3://{bucket}/runs", direct) == [output]
    assert unlisted_objects(f"s3://{bucket}/runs", direct) == []
