"""flows/prefect_server.py: the API server `alignflow run` starts in its own process when none is set."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_a_run_without_an_api_gets_its_own_server_and_prefect_is_pointed_at_it(monkeypatch, tmp_path):
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    from alignflow.flows.prefect_server import PrefectServer, healthy

    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))  # its own database, not the user's
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


def test_a_configured_api_is_used_as_it_is(monkeypatch):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from alignflow.flows.prefect_server import PrefectServer

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        server = PrefectServer()
        server._run()  # on this thread, which sees these settings
        assert server.process is None and server.api_url is None and server.error is None
        with server.api_settings():  # nothing to point at: Prefect's own settings stand
            assert PREFECT_API_URL.value() == "http://127.0.0.1:9/api"
