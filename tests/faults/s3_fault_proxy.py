"""A seeded fault-injecting HTTP proxy for an S3 server on 127.0.0.1 (tests only).

Every request is forwarded to the upstream server unless the proxy's seeded draw picks a fault for it:

- `drop`: read the request, close the connection without a response (a reset server / load balancer);
- `500`: answer `500 InternalError` with S3's XML error body, without forwarding;
- `503`: answer `503 SlowDown` (S3's throttling reply), without forwarding;
- `stall`: hold the request `stall_s` seconds, then forward it (a slow server: succeeds, late);
- `truncate`: forward, then send the response headers and half the body and close (a connection cut
  mid-download: the client sees fewer bytes than Content-Length).

It is not S3-aware beyond the error bodies: it forwards bytes, so signatures stay valid (the Host header is
kept). `faults` counts what it injected and `requests` what it saw, by fault kind and by S3 operation
("PUT", "GET", ...) so a test can say what it survived. `only` restricts faults to requests whose
method and path match (a test that targets the manifest write, for example).
"""

from __future__ import annotations

import http.client
import random
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

FAULTS = ("drop", "500", "503", "stall", "truncate")

_ERROR_BODY = """<?xml version="1.0" encoding="UTF-8"?>
<Error><Code>{code}</Code><Message>{message}</Message><Resource>{resource}</Resource><RequestId>fault-{n}</RequestId></Error>"""
_ERRORS = {
    "500": (
        500,
        "Internal Server Error",
        "InternalError",
        "We encountered an internal error. Please try again.",
    ),
    "503": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
}
# Hop-by-hop headers a proxy must not forward (RFC 9110 7.6.1).
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass
class FaultPlan:
    """What to inject: `rate` of the matching requests get a fault drawn from `weights` (seeded)."""

    rate: float = 0.0
    weights: dict[str, float] = field(default_factory=lambda: dict.fromkeys(FAULTS, 1.0))
    seed: int = 0
    stall_s: float = 1.0
    only: Callable[[str, str], bool] | None = None  # (method, path) -> inject faults on this request?

    def __post_init__(self) -> None:
        unknown = set(self.weights) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)} (valid: {', '.join(FAULTS)})")


class FaultProxy:
    """`with FaultProxy(upstream, plan) as proxy:` -> `proxy.endpoint` is the URL to give the client."""

    def __init__(self, upstream: str, plan: FaultPlan):
        match = re.fullmatch(r"http://([^:/]+):(\d+)/?", upstream)
        if not match:
            raise ValueError(f"upstream '{upstream}': expected http://host:port")
        self.upstream = (match.group(1), int(match.group(2)))
        self.plan = plan
        self._rng = random.Random(plan.seed)
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.fault_log: list[tuple[str, str, str]] = []  # (fault, method, path)
        self._server = _QuietServer(("127.0.0.1", 0), _handler(self))
        self._thread: threading.Thread | None = None

    @property
    def retryable(self) -> int:
        """Faults injected so far that a client must retry (a stall only delays)."""
        with self._lock:
            return sum(n for fault, n in self.faults.items() if fault != "stall")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def set_plan(self, plan: FaultPlan) -> None:
        with self._lock:
            self.plan = plan
            self._rng = random.Random(plan.seed)

    def draw(self, method: str, path: str) -> str | None:
        """The fault for this request, or None to forward it untouched; counts both."""
        with self._lock:
            self.requests[method] += 1
            plan = self.plan
            if plan.rate <= 0 or (plan.only is not None and not plan.only(method, path)):
                return None
            if self._rng.random() >= plan.rate:
                return None
            kinds = [k for k, w in plan.weights.items() if w > 0]
            fault = self._rng.choices(kinds, [plan.weights[k] for k in kinds])[0]
            if fault == "truncate" and method != "GET":
                return None  # only a GET has a body to cut
            self.faults[fault] += 1
            self.fault_log.append((fault, method, path))
            return fault

    def __enter__(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._server.serve_forever, name="s3-fault-proxy", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # clients that hang up on a dropped or stalled connection are the point, not news


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
            pass

        def _read_body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _error(self, fault: str) -> None:
            status, reason, code, message = _ERRORS[fault]
            body = _ERROR_BODY.format(
                code=code, message=message, resource=self.path, n=proxy.faults[fault]
            ).encode()
            self.send_response(status, reason)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            # a HEAD reply has no body: bytes sent anyway would garble the next one
            if self.command != "HEAD":
                self.wfile.write(body)

        def _drop(self) -> None:
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

        def _forward(self, body: bytes, truncate: bool) -> None:
            conn = http.client.HTTPConnection(*proxy.upstream, timeout=120)
            try:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
            finally:
                conn.close()
            if truncate and self.command == "GET" and len(data) >= 2:
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: len(data) // 2])
                self.wfile.flush()
                self._drop()
                return
            self.send_response(response.status, response.reason)
            head = self.command == "HEAD"  # its Content-Length is the object's size: pass it on
            for key, value in response.getheaders():
                if key.lower() not in _HOP and (head or key.lower() != "content-length"):
                    self.send_header(key, value)
            if not head:
                self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not head:
                self.wfile.write(data)

        def _handle(self) -> None:
            body = self._read_body()
            fault = proxy.draw(self.command, self.path)
            if fault == "drop":
                self._drop()
            elif fault in _ERRORS:
                self._error(fault)
            else:
                if fault == "stall":
                    time.sleep(proxy.plan.stall_s)
                self._forward(body, truncate=fault == "truncate")

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

    return Handler
