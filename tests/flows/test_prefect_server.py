"""flows/prefect_server.py: the API server `alignflow run` starts in its own process when none is set."""

from __future__ import annotations

import base64
import time
import urllib.error
import urllib.request

import pytest

from alignflow.flows.kept_server import KEEP_VAR

pytestmark = pytest.mark.slow


def test_a_run_without_an_api_gets_its_own_server_and_prefect_is_pointed_at_it(monkeypatch, tmp_path):
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    from alignflow.flows.prefect_server import PrefectServer, healthy

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))  # its own database, not the user's
    monkeypatch.setenv(KEEP_VAR, "0")  # not kept: this run's own
    # No API configured (the session's harness may have set one); _run on this thread, which sees that.
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        server = PrefectServer()
        server._run()
        try:
            assert server.error is None and server.api_url is not None
            assert healthy(server.api_url)
            with server.api_settings():
                assert PREFECT_API_URL.value() == server.api_url
                assert get_current_settings().api.url == server.api_url
            assert PREFECT_API_URL.value() is None  # only while the flow runs
        finally:
            process = server.process
            server.stop()
    assert process is not None and process.poll() is not None  # stopped, not left behind
    assert not healthy(server.api_url)


def test_a_kept_server_serves_the_next_run_stays_while_used_and_exits_once_unused(monkeypatch, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from alignflow.flows.kept_server import alive
    from alignflow.flows.prefect_server import PrefectServer, healthy

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    monkeypatch.setenv(KEEP_VAR, "2")
    monkeypatch.chdir(tmp_path)
    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        first = PrefectServer()
        first._run()
        try:
            assert first.error is None and not first.reused and healthy(first.api_url)
            assert first.kept is not None and first.kept.folder == tmp_path / "alignflow-server"
            state = first.kept.read_state()
            assert state is not None and state["api_url"] == first.api_url
            # Its API answers only who has its auth string, from the state file only this user reads.
            assert first.auth and state["auth"] == first.auth
            assert first.kept.state_path.stat().st_mode & 0o777 == 0o600
            request = urllib.request.Request(f"{first.api_url}/admin/version")
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=10)
            assert refused.value.code == 401
            request.add_header("Authorization", "Basic " + base64.b64encode(first.auth.encode()).decode())
            with urllib.request.urlopen(request, timeout=10) as answered:
                assert answered.status == 200
            second = PrefectServer()  # the next run (in this process here, so with the same lease)
            second._run()
            assert second.error is None and second.reused and second.process is None
            assert (second.api_url, second.auth) == (first.api_url, first.auth)
            time.sleep(3)  # longer than the keep time, with a lease held
            assert healthy(first.api_url)
            first.stop()
            second.stop()
            assert alive(state["pid"])  # let go of, not stopped
            deadline = time.monotonic() + 30
            while alive(state["pid"]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not alive(state["pid"]) and not first.kept.state_path.exists()
            assert not healthy(first.api_url)
        finally:
            first.kept.stop()


def test_a_configured_api_is_used_as_it_is(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from alignflow.flows.prefect_server import PrefectServer

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        server = PrefectServer()
        server._run()  # on this thread, which sees these settings
        assert server.process is None and server.api_url is None and server.error is None
        with server.api_settings():  # nothing to point at: Prefect's own settings stand
            assert PREFECT_API_URL.value() == "http://127.0.0.1:9/api"
