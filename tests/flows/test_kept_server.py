"""flows/kept_server.py: the local Prefect server runs share: key, leases, state file, exit once unused."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from alignflow.flows import kept_server
from alignflow.flows.kept_server import KEEP_VAR, KeptServer, keep_seconds, server_env, stop_kept_servers


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_keep_seconds_defaults_to_ten_minutes_and_names_the_variable_when_bad(monkeypatch):
    monkeypatch.delenv(KEEP_VAR, raising=False)
    assert keep_seconds() == 600
    monkeypatch.setenv(KEEP_VAR, "0")
    assert keep_seconds() == 0
    for bad in ("-1", "ten", "inf", "nan"):
        monkeypatch.setenv(KEEP_VAR, bad)
        with pytest.raises(ValueError, match=f"{KEEP_VAR}='{bad}': expected the seconds"):
            keep_seconds()


def test_the_server_gets_prefects_and_the_interpreters_variables_not_the_runs_credentials():
    env = server_env({
        "PREFECT_HOME": "/h", "PATH": "/bin", "PYTHONPATH": "/src", "LC_ALL": "C",
        "AWS_SECRET_ACCESS_KEY": "s", "MLFLOW_TRACKING_TOKEN": "t", "HF_TOKEN": "h",
    })
    assert env == {"PREFECT_HOME": "/h", "PATH": "/bin", "PYTHONPATH": "/src", "LC_ALL": "C"}


def test_the_key_changes_with_prefects_settings_and_not_otherwise(tmp_path):
    env = {"PREFECT_HOME": str(tmp_path / "home"), "PATH": "/bin"}
    first = KeptServer.for_environment(env, tmp_path)
    assert first == KeptServer.for_environment(dict(env), tmp_path)
    assert first.folder == tmp_path / "home" / "alignflow-server"
    assert first.key != KeptServer.for_environment({**env, "PREFECT_LOGGING_LEVEL": "DEBUG"}, tmp_path).key
    assert first.key != KeptServer.for_environment(env, tmp_path / "home").key  # another folder
    (tmp_path / "prefect.toml").write_text("[api]\nurl = ''\n")  # a settings file Prefect reads there
    assert first.key != KeptServer.for_environment(env, tmp_path).key


def test_leases_count_while_their_process_lives(tmp_path):
    kept = KeptServer(tmp_path, "k")
    lease = kept.hold()
    assert lease == tmp_path / "k.leases" / str(os.getpid())
    (kept.leases / str(_dead_pid())).touch()  # a run that was killed
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exited, not yet reaped: not a user
    deadline = time.monotonic() + 30
    while kept_server.alive(zombie.pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    (kept.leases / str(zombie.pid)).touch()
    assert kept.live_leases() == 1
    assert sorted(p.name for p in kept.leases.iterdir()) == [str(os.getpid())]  # the others removed
    zombie.wait()
    lease.unlink()
    assert kept.live_leases() == 0


def test_a_server_retires_unless_a_run_took_a_lease_meanwhile(tmp_path):
    kept = KeptServer(tmp_path, "k")
    kept.publish(port=4321, api_url="http://127.0.0.1:4321/api")
    assert kept.read_state() == {"pid": os.getpid(), "port": 4321, "api_url": "http://127.0.0.1:4321/api"}
    lease = kept.hold()
    assert kept.retire() is False  # a run holds it: the state file is back
    assert kept.read_state()["port"] == 4321
    lease.unlink()
    assert kept.retire() is True
    assert not kept.state_path.exists() and list(tmp_path.iterdir()) == [kept.leases]


def test_a_server_whose_state_another_one_overwrote_leaves_it(tmp_path):
    kept = KeptServer(tmp_path, "k")
    kept.state_path.write_text('{"pid": 1, "port": 5, "api_url": "http://127.0.0.1:5/api"}')
    assert kept.retire() is True
    kept.withdraw()
    assert kept.read_state()["pid"] == 1


def test_waits_until_unused_for_the_keep_time(tmp_path, monkeypatch):
    monkeypatch.setattr(kept_server, "CHECK_EVERY_S", 0.02)
    kept = KeptServer(tmp_path, "k")
    kept.publish(port=4321, api_url="http://127.0.0.1:4321/api")
    lease = kept.hold()
    threading.Timer(0.5, lease.unlink).start()
    started = time.monotonic()
    kept.wait_until_unused(0.3, lambda: False)
    # The lease went at 0.5 s (last seen up to one check before), then 0.3 s unused.
    assert time.monotonic() - started >= 0.5 + 0.3 - 2 * kept_server.CHECK_EVERY_S
    assert kept.read_state() is None
    stopping = threading.Event()
    kept.publish(port=4321, api_url="http://127.0.0.1:4321/api")
    kept.hold()
    threading.Timer(0.1, stopping.set).start()
    kept.wait_until_unused(60, stopping.is_set)  # the server stops for another reason: no wait for the keep
    assert kept.read_state() is not None


def test_a_state_file_of_a_process_that_is_gone_finds_no_server(tmp_path):
    kept = KeptServer(tmp_path, "k")
    assert kept.running_url() is None
    kept.state_path.write_text(f'{{"pid": {_dead_pid()}, "port": 9, "api_url": "http://127.0.0.1:9/api"}}')
    assert kept.running_url() is None
    kept.state_path.write_text("{not json")
    assert kept.read_state() is None and kept.running_url() is None


def test_stop_kept_servers_stops_every_one_in_a_prefect_home(tmp_path):
    folder = tmp_path / "alignflow-server"
    folder.mkdir()
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a server's process
    try:
        (folder / "abc123.json").write_text(f'{{"pid": {stand_in.pid}, "port": 9, "api_url": "u"}}')
        (folder / "def456.json").write_text(f'{{"pid": {_dead_pid()}, "port": 9, "api_url": "u"}}')
        assert stop_kept_servers(folder) == 1
        assert stand_in.wait(timeout=5) == -15
    finally:
        stand_in.kill()
