"""A real S3 API on localhost for tests: moto's threaded server, behind a small HTTP proxy that
records every request and can cut a response part-way (a dropped connection mid-shard).

Nothing here mocks a function call: s3fs talks HTTP to the proxy, the proxy to moto."""

from __future__ import annotations

import http.client
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest

# Hop-by-hop headers a proxy must not forward.
_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Request:
    method: str
    path: str  # path and query, as sent
    range: str | None


@dataclass
class ProxyLog:
    requests: list[Request] = field(default_factory=list)
    #: substring of a path -> how many next GETs of it are cut after half their body
    cut: dict[str, int] = field(default_factory=dict)
    #: substring of a path -> seconds each PUT of it waits first (a slow upload)
    slow_put: dict[str, float] = field(default_factory=dict)
    #: bytes/s each response body is sent at (None: as fast as possible): a network-like store
    bandwidth: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def gets(self, contains: str = "") -> list[Request]:
        """GET requests whose path contains `contains` (e.g. ".arrow": shard downloads)."""
        with self.lock:
            return [r for r in self.requests if r.method == "GET" and contains in r.path]


def _handler(upstream: tuple[str, int], log: ProxyLog) -> type[BaseHTTPRequestHandler]:
    class Proxy(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

        def _forward(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            with log.lock:
                log.requests.append(Request(self.command, self.path, self.headers.get("Range")))
                cut = next((k for k, v in log.cut.items() if v > 0 and k in self.path), None) \
                    if self.command == "GET" else None
                if cut is not None:
                    log.cut[cut] -= 1
                delay = next((v for k, v in log.slow_put.items() if k in self.path), 0.0) \
                    if self.command == "PUT" else 0.0
            time.sleep(delay)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP and k.lower() != "expect"}
            conn = http.client.HTTPConnection(*upstream, timeout=30)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                payload = resp.read()
            finally:
                conn.close()
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP and k.lower() != "content-length":
                    self.send_header(k, v)
            # a HEAD answer has no body but the length of the object it describes
            length = resp.getheader("Content-Length", "0") if self.command == "HEAD" else str(len(payload))
            self.send_header("Content-Length", length)
            self.end_headers()
            if self.command == "HEAD":
                return
            if cut is not None and len(payload) > 1:
                self.wfile.write(payload[:len(payload) // 2])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if log.bandwidth:
                for start in range(0, len(payload), 1 << 18):
                    chunk = payload[start:start + (1 << 18)]
                    self.wfile.write(chunk)
                    time.sleep(len(chunk) / log.bandwidth)
                return
            self.wfile.write(payload)

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    return Proxy


class S3Server:
    """moto's S3 on 127.0.0.1 plus the recording proxy. `endpoint` is the proxy's URL."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
        self._moto_port = free_port()
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=self._moto_port, verbose=False)
        self._moto.start()
        self.log = ProxyLog()
        self._proxy = ThreadingHTTPServer(("127.0.0.1", 0), _handler(("127.0.0.1", self._moto_port), self.log))
        self._proxy.daemon_threads = True
        self._thread = threading.Thread(target=self._proxy.serve_forever, kwargs={"poll_interval": 0.1},
                                        name="s3-proxy")
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._proxy.server_address[1]}"

    def env(self) -> dict[str, str]:
        """Environment variables that point boto-based clients (s3fs) at this server, as a user's
        shell would for an S3-compatible store."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}

    def storage_options(self) -> dict[str, Any]:
        """What s3fs needs to reach this server (fake credentials, no retries hidden from us)."""
        return {"key": "testing", "secret": "testing", "endpoint_url": self.endpoint, "skip_instance_cache": True}

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options())

    def reset_log(self) -> None:
        with self.log.lock:
            self.log.requests.clear()
            self.log.cut.clear()
            self.log.slow_put.clear()

    def stop(self) -> None:
        self._proxy.shutdown()
        self._proxy.server_close()
        self._thread.join(5)
        self._moto.stop()


_buckets = iter(range(10**6))


def upload_pack(s3: "S3Server", packed: Any, prefix: str) -> str:
    """A fresh bucket (named `prefix` + a counter) holding a copy of the packed folder `packed` under
    `packed/`; the request log starts empty. Returns its URL."""
    bucket = f"{prefix}{next(_buckets)}"
    fs = s3.filesystem()
    fs.mkdir(bucket)
    for f in sorted(packed.iterdir()):
        fs.put_file(str(f), f"{bucket}/packed/{f.name}")
    s3.reset_log()
    return f"s3://{bucket}/packed"


#: bytes of images per shard in `pack_remote_set`: its 48 small JPEGs make 24 shards of 2
SHARD_SIZE = 12_000


@pytest.fixture(scope="module")
def s3() -> Iterator["S3Server"]:
    """One S3 server per test module (import this fixture into the module)."""
    server = S3Server()
    yield server
    server.stop()


def pack_remote_set(root: Path) -> Path:
    """48 small JPEGs of 3 classes packed into 24 shards of 2 at `root/packed` (the remote tests' data)."""
    from conftest import make_image_folder
    from stoker.packing import PackOptions, pack

    make_image_folder(root / "imgs", n_per_class=16)
    pack(root / "imgs", root / "packed", options=PackOptions(workers=1, shard_size=SHARD_SIZE), progress=False)
    return root / "packed"
