"""`alignflow ui`: a local Prefect server and MLflow UI on 127.0.0.1 for single-machine users."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def _wait_http(url: str, timeout_s: float) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:  # noqa: S310 - loopback only
                if response.status == 200:
                    return True
        except OSError:
            time.sleep(0.5)
    return False


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def serve(workdir: Path, prefect_port: int, mlflow_port: int) -> int:
    """Start both servers, print their URLs, and keep them running until Ctrl-C."""
    workdir = workdir.resolve()
    env = {
        **os.environ,
        "PREFECT_SERVER_API_HOST": "127.0.0.1",
        "PREFECT_SERVER_API_PORT": str(prefect_port),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DO_NOT_TRACK": "true",
    }
    # The port goes by env var: `--port` would leave the UI pointing at 4200.
    prefect = subprocess.Popen(
        [_binary("prefect"), "server", "start"],
        env=env,
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    mlflow = subprocess.Popen(
        [
            _binary("mlflow"),
            "ui",
            "--backend-store-uri",
            f"sqlite:///{workdir / 'mlflow.db'}",
            "--host",
            "127.0.0.1",
            "--port",
            str(mlflow_port),
            "--workers",
            "1",
        ],
        env=env,
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    prefect_url, mlflow_url = f"http://127.0.0.1:{prefect_port}", f"http://127.0.0.1:{mlflow_port}"
    try:
        ok_prefect = _wait_http(f"{prefect_url}/api/health", 120)
        ok_mlflow = _wait_http(f"{mlflow_url}/health", 120)
        print(f"Prefect UI: {prefect_url}  ({'up' if ok_prefect else 'NOT responding'})")
        print(f"MLflow UI:  {mlflow_url}  ({'up' if ok_mlflow else 'NOT responding'})")
        print(
            f"Point runs at them with: export PREFECT_API_URL={prefect_url}/api "
            f"ALIGNFLOW_MLFLOW_UI_URL={mlflow_url} PREFECT_UI_URL={prefect_url}"
        )
        print("Ctrl-C stops both.", flush=True)
        if not (ok_prefect and ok_mlflow):
            return 1
        while prefect.poll() is None and mlflow.poll() is None:
            time.sleep(1)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in (prefect, mlflow):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in (prefect, mlflow):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
