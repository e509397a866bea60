"""Test helpers: a real S3 server on 127.0.0.1 and a fault-injecting, counting proxy.

:func:`s3_server` starts moto's S3 server in its own process (``moto[server]``, the
``test`` extra) on a free port.  :class:`S3Proxy` forwards HTTP requests to it and can
answer every Nth request with a 503 or cut the connection instead, counts the requests
and the response bytes of ranged and whole GETs per object, and sets an event on the
first multipart part it sees (a crash test kills a save there).  Nothing inside the
client is mocked.

The pytest fixtures every S3 test uses live here too (one home for the package's tests
and the umbrella's); a test module enables them with
``pytest_plugins = ("hyper_parallel_dcp.storage_object.testing",)``:
``s3_endpoint`` (one moto server per test session, bucket :data:`TEST_BUCKET` created),
``s3_proxy`` (a fresh counting proxy in front of it per test) and ``s3_test_env`` (the
``AWS_*`` variables pointing at the proxy, set for the test; their dict is the value).
"""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

import pytest

__all__ = ["TEST_BUCKET", "S3Proxy", "create_bucket", "free_port", "s3_endpoint", "s3_env", "s3_proxy", "s3_server",
           "s3_test_env"]

#: The bucket the ``s3_endpoint`` fixture creates.
TEST_BUCKET = "ckpts"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(env: Optional[dict[str, str]] = None, timeout: float = 60.0) -> Iterator[str]:
    """Run moto's S3 server in a subprocess; yields its ``http://127.0.0.1:PORT`` URL."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server did not start on {url}") from None
                time.sleep(0.05)
        yield url
    finally:
        proc.kill()
        proc.wait()


def s3_env(endpoint: str) -> dict[str, str]:
    """The standard environment of a client talking to ``endpoint`` with test keys."""
    return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on ``endpoint`` (a plain signed-less PUT: moto accepts it)."""
    req = urllib.request.Request(f"{endpoint}/{bucket}", method="PUT")
    urllib.request.urlopen(req, timeout=30).read()


class S3Proxy:
    """An HTTP proxy in front of an S3 server, in a thread of this process.

    ``fail_every``: answer every Nth request with ``fault`` (``"503"``: a 503 SlowDown;
    ``"drop"``: close the connection without an answer).  ``get_bytes`` counts body bytes
    of successful GETs per object key; ``requests`` counts requests by method.
    ``first_part`` is set once a multipart part has been received in full.
    """

    def __init__(self, target: str, *, fail_every: int = 0, fault: str = "503") -> None:
        self.target = urlsplit(target)
        self.fail_every = fail_every
        self.fault = fault
        self.get_bytes: Counter = Counter()
        self.requests: Counter = Counter()
        self.faults = 0
        self.first_part = threading.Event()
        self._n = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with proxy._lock:
                    proxy._n += 1
                    n = proxy._n
                    proxy.requests[self.command] += 1
                if proxy.fail_every and n % proxy.fail_every == 0:
                    with proxy._lock:
                        proxy.faults += 1
                    if proxy.fault == "drop":
                        self.close_connection = True
                        self.connection.shutdown(socket.SHUT_RDWR)
                        return
                    msg = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                conn = http.client.HTTPConnection(proxy.target.hostname or "127.0.0.1", proxy.target.port, timeout=120)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection",)}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                conn.close()
                if self.command == "PUT" and "partNumber=" in self.path and resp.status == 200:
                    proxy.first_part.set()
                if self.command == "GET" and resp.status in (200, 206):
                    key = urlsplit(self.path).path
                    with proxy._lock:
                        proxy.get_bytes[key] += len(data)
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                # a HEAD answer has no body but the object's length
                head_length = resp.getheader("Content-Length") or "0"
                self.send_header("Content-Length", head_length if self.command == "HEAD" else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="s3-proxy", daemon=True)
        self._thread.start()

    def bytes_under(self, bucket: str, prefix: str) -> int:
        """GET body bytes served for objects under ``bucket/prefix``."""
        head = f"/{bucket}/{prefix}"
        return sum(n for key, n in self.get_bytes.items() if key.startswith(head))

    def reset_counts(self) -> None:
        with self._lock:
            self.get_bytes.clear()
            self.requests.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> S3Proxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------- pytest fixtures
@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """One moto S3 server for the test session, with :data:`TEST_BUCKET`; yields its URL."""
    with s3_server() as url:
        create_bucket(url, TEST_BUCKET)
        yield url


@pytest.fixture
def s3_proxy(s3_endpoint: str) -> Iterator[S3Proxy]:
    """A fresh :class:`S3Proxy` (counts reset, no faults) in front of the session's server."""
    with S3Proxy(s3_endpoint) as proxy:
        yield proxy


@pytest.fixture
def s3_test_env(s3_proxy: S3Proxy, monkeypatch: Any) -> dict[str, str]:
    """The ``AWS_*`` environment pointing at ``s3_proxy``, set for this test; returns it
    (pass it as ``env=`` to ``run_distributed`` and to subprocesses)."""
    values = s3_env(s3_proxy.url)
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values
