"""Bad input fails fast with a message naming the file/line, key or value, and publishes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from alignflow.contract import StageResult, StageSpec
from alignflow.manifest import output_uri
from alignflow.storage import open_store
from tests.conftest import REPO, free_port, small_config

GOOD_SFT = '{"prompt": "Write about tea.", "completion": "Tea is lovely."}\n'
GOOD_PREF = '{"prompt": "Write about tea.", "chosen": "Tea is lovely.", "rejected": "Tea is grim."}\n'
GOOD_PROMPT = '{"prompt": "Write about tea."}\n'


def write_files(folder: Path, sft: str = GOOD_SFT * 4, prefs: str = GOOD_PREF * 4,
                prompts: str = GOOD_PROMPT * 4) -> dict[str, str]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, text in (("sft", sft), ("preferences", prefs), ("prompts", prompts)):
        (folder / f"{name}.jsonl").write_text(text)
        paths[name] = str(folder / f"{name}.jsonl")
    return paths


def run_data_stage(tmp_path: Path, paths: dict[str, str]) -> tuple[subprocess.CompletedProcess, str]:
    config = small_config(tmp_path, stages=["data"], data={"source": "files", **paths})
    root = f"file://{tmp_path}/artifacts"
    section = {"data": config.data.model_dump(mode="json")}
    spec = StageSpec(stage="data", config=section, output_uri=output_uri(root, "data", section, {}, "test"),
                     workdir=str(tmp_path))
    spec_path = spec.dump(tmp_path / "spec.json")
    proc = subprocess.run([sys.executable, "-m", "alignflow.stages.data", "--spec", str(spec_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    return proc, spec.output_uri


def assert_failed_without_manifest(proc, uri: str, message: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    result = StageResult.from_output(proc.stdout)
    assert (
        result.status == "failed" and message.splitlines()[0].removeprefix("error: data: ") in result.message
    )
    store = open_store(uri)
    assert not store.exists(uri + "/manifest.json")
    assert not any(u.endswith("manifest.json") for u, _ in store.list(uri.rsplit("/", 2)[0]))


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    paths = write_files(tmp_path / "in", sft=GOOD_SFT + '{"prompt": "x" "completion": "y"}\n' + GOOD_SFT)
    proc, uri = run_data_stage(tmp_path, paths)
    assert_failed_without_manifest(
        proc,
        uri,
        f"error: data: {paths['sft']}:2: malformed JSON (Expecting ',' delimiter: line 1 column 16)",
    )


def test_record_missing_chosen(tmp_path):
    paths = write_files(tmp_path / "in", prefs=GOOD_PREF + '{"prompt": "p", "rejected": "r"}\n')
    proc, uri = run_data_stage(tmp_path, paths)
    assert_failed_without_manifest(
        proc,
        uri,
        f"error: data: {paths['preferences']}:2: record is missing required field 'chosen' "
        "(preference records need prompt, chosen, rejected)",
    )


def test_empty_dataset(tmp_path):
    paths = write_files(tmp_path / "in", prompts="")
    proc, uri = run_data_stage(tmp_path, paths)
    assert_failed_without_manifest(
        proc,
        uri,
        f"error: data: {paths['prompts']}: dataset is empty (no records); "
        'add at least one {"prompt": ...} record',
    )


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "alignflow.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd
    )


def test_unknown_config_key(tmp_path):
    proc = _cli("run", str(REPO / "configs/tiny.yaml"), "--set", "sft.learning_rate=0.1", cwd=tmp_path)
    assert proc.returncode == 2
    assert (
        f"error: {REPO}/configs/tiny.yaml: 1 config error(s):\n  - sft.learning_rate: unknown key (remove it "
        "or check its spelling; valid keys: lr, weight_decay, warmup_steps, epochs, batch_size, "
        "micro_batch_size, max_length, eval_every, zero_stage, grad_clip, autocast, seed, lora, resources)"
    ) in proc.stderr
    assert not (tmp_path / "artifacts").exists()


def test_wrong_value_type(tmp_path):
    proc = _cli("run", str(REPO / "configs/tiny.yaml"), "--set", "reward.batch_size=large", cwd=tmp_path)
    assert proc.returncode == 2
    assert (
        "  - reward.batch_size: Input should be a valid integer, unable to parse string as an integer "
        '(got "large")'
    ) in proc.stderr
    assert not (tmp_path / "artifacts").exists()


def _files_overrides(paths: dict[str, str]) -> list[str]:
    return [
        "--set",
        "data.source=files",
        *(arg for key, path in paths.items() for arg in ("--set", f"data.{key}={path}")),
    ]


BAD_DATA = {  # name -> (files, the line the report must contain)
    "malformed JSON": (
        {"sft": GOOD_SFT + '{"prompt": "x" "completion": "y"}\n'},
        "sft.jsonl:2: malformed JSON (Expecting ',' delimiter: line 1 column 16)",
    ),
    "missing field": (
        {"prefs": GOOD_PREF + '{"prompt": "p", "rejected": "r"}\n'},
        "preferences.jsonl:2: record is missing required field 'chosen'",
    ),
    "empty": (
        {"prompts": ""},
        'prompts.jsonl: dataset is empty (no records); add at least one {"prompt": ...} record',
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_validate_reports_bad_data_files_without_starting_anything(tmp_path, case):
    files, expected = BAD_DATA[case]
    paths = write_files(tmp_path / "in", **files)
    proc = _cli("validate", str(REPO / "configs/tiny.yaml"), *_files_overrides(paths), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "data error(s):" in proc.stderr and expected in proc.stderr
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "mlflow.db").exists()


def test_validate_reports_a_bad_utf8_line_and_pairs_with_chosen_equal_to_rejected(tmp_path):
    paths = write_files(tmp_path / "in", prefs=GOOD_PREF * 3 + GOOD_PREF.replace("grim", "lovely"))
    proc = _cli("validate", str(REPO / "configs/tiny.yaml"), *_files_overrides(paths), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert (
        f"warning: {paths['preferences']}: 1 of 4 preference pairs have chosen == rejected (first: record 4)"
        in proc.stderr
    )
    assert "data: data.sft 4 records, data.preferences 4 records, data.prompts 4 records" in proc.stderr
    Path(paths["sft"]).write_bytes(GOOD_SFT.encode() * 2 + b'{"prompt": "caf\xe9", "completion": "x"}\n')
    proc = _cli("validate", str(REPO / "configs/tiny.yaml"), *_files_overrides(paths), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{paths['sft']}:3: not valid UTF-8 text (byte 0xe9 at column 16)" in proc.stderr


def test_run_checks_the_data_before_prefect_starts(tmp_path):
    paths = write_files(tmp_path / "in", prompts=GOOD_PROMPT + "{not json\n")
    proc = _cli("run", str(REPO / "configs/tiny.yaml"), *_files_overrides(paths), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"{paths['prompts']}:2: malformed JSON" in proc.stderr
    assert "prefect" not in proc.stderr.lower()  # no server started, no flow run
    assert not (tmp_path / "artifacts").exists()


@pytest.mark.slow
def test_unreachable_s3_endpoint_fails_the_pipeline(tmp_path, prefect_harness, monkeypatch):
    from alignflow.flows.pipeline import alignflow_pipeline

    # Credentials present, so the failure is the endpoint's (run alone, no s3_server fixture has set any).
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing-secret-key")
    port = free_port()
    # A refused connection is transient (the store may be restarting): the flow retries the stage, here 1 s
    # apart.
    config = small_config(
        tmp_path,
        stages=["data"],
        storage={
            "root": "s3://bucket/runs",
            "max_attempts": 1,
            "endpoint_url": f"http://127.0.0.1:{port}",
            "connect_timeout_s": 0.5,
        },
        deployment={"retry_delay_s": 1},
    )
    with pytest.raises(Exception) as err:
        alignflow_pipeline(config)
    assert f"cannot reach S3 at http://127.0.0.1:{port}" in str(err.value)
    assert "check storage.endpoint_url / AWS_ENDPOINT_URL_S3 and that the server is up" in str(err.value)


def test_stage_result_line_is_json(tmp_path):
    paths = write_files(tmp_path / "in", prompts="")
    proc, _ = run_data_stage(tmp_path, paths)
    last = proc.stdout.strip().splitlines()[-1]
    assert json.loads(last)["status"] == "failed"
