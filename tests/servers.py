"""Real servers on 127.0.0.1 for tests: a folder over HTTP with injectable faults (and basic
authentication), and moto's S3."""

from __future__ import annotations

import base64
import logging
import os
import socket
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class HttpFolder:
    """What `serve_folder` yields: the base URL, the log of GET request paths and their queries."""

    url: str
    log: list[str] = field(default_factory=list)
    queries: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, path_suffix: str) -> int:
        """How many GET requests so far had a path ending with `path_suffix`."""
        with self._lock:
            return sum(path.endswith(path_suffix) for path in self.log)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # never wait on a handler at exit; `stopping` wakes the stalled ones

    def __init__(self, folder: HttpFolder, faults: dict, drop_times: int, drop_delay: float,
                 stall_after: int | None, authorization: str | None, *args) -> None:
        super().__init__(*args)
        self.folder, self.faults, self.drop_times = folder, faults, drop_times
        self.drop_delay, self.stall_after = drop_delay, stall_after
        self.authorization = authorization  # the Authorization header a request must carry
        self.stopping = threading.Event()

    def handle_error(self, request, client_address) -> None:
        """Stay quiet about clients that hang up (curl killed, timed out, ...)."""


class _Handler(SimpleHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args) -> None:
        pass

    def do_GET(self) -> None:
        wanted = self.server.authorization
        if wanted is not None and self.headers.get("Authorization") != wanted:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="shards"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path = urlsplit(self.path).path
        rel = unquote(path).lstrip("/")
        folder, faults = self.server.folder, self.server.faults
        with folder._lock:
            earlier = sum(unquote(p).lstrip("/") == rel for p in folder.log)
            folder.log.append(path)
            folder.queries.append(urlsplit(self.path).query)
        if rel in faults["missing"]:
            self.send_error(404, "File not found")
            return
        if rel in faults["drop_after"] and earlier < self.server.drop_times:
            self._send_part(faults["drop_after"][rel], stall=False)
        elif rel in faults["stall"]:
            self._send_part(self.server.stall_after, stall=True)
        else:
            super().do_GET()

    def _send_part(self, nbytes: int | None, stall: bool) -> None:
        """Full headers, then `nbytes` (default: half) of the body; then hang up or stall."""
        body = self.send_head()  # sends status and headers, Content-Length included
        if body is None:
            return
        with body:
            size = os.fstat(body.fileno()).st_size
            self.wfile.write(body.read(size // 2 if nbytes is None else nbytes))
        self.wfile.flush()
        self.server.stopping.wait(None if stall else self.server.drop_delay)
        self.close_connection = True
        self.connection.shutdown(socket.SHUT_RDWR)  # the client sees the body cut short


@contextmanager
def serve_folder(root: Path, *, drop_after: dict[str, int] | None = None,
                 drop_times: int = 1, drop_delay: float = 0.0, missing: set[str] | None = None,
                 stall: set[str] | None = None, stall_after: int | None = None,
                 basic_auth: str | None = None) -> Iterator[HttpFolder]:
    """Serve `root` on 127.0.0.1 at a free port; fault keys are paths relative to `root`.

    drop_after[path] = n: send n body bytes and hang up `drop_delay` s later, for the first
    `drop_times` requests.
    missing: answer 404. stall: send `stall_after` body bytes (default: half the body), then
    hold the connection until exit.
    basic_auth: "user:password" every request must give (HTTP basic authentication), else 401."""
    faults = {"drop_after": dict(drop_after or {}), "missing": set(missing or ()),
              "stall": set(stall or ())}
    folder = HttpFolder(url="")

    def handler(*args) -> _Handler:
        return _Handler(*args, directory=str(root))

    server = _Server(folder, faults, drop_times, drop_delay, stall_after,
                     basic_auth and basic_authorization(*basic_auth.split(":", 1)),
                     ("127.0.0.1", 0), handler)
    folder.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                              daemon=True)
    thread.start()
    try:
        yield folder
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def basic_authorization(user: str, password: str) -> str:
    """The Authorization header value of HTTP basic authentication."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@dataclass
class S3:
    """What `s3_server` yields: the endpoint and the environment the `aws` CLI needs for it."""

    endpoint: str
    env: dict[str, str]

    def client(self):
        """A boto3 S3 client of this server."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def upload_folder(self, local: Path, bucket: str, prefix: str = "") -> list[str]:
        """Create `bucket` and upload every file under `local` as prefix + its relative path."""
        client = self.client()
        client.create_bucket(Bucket=bucket)
        keys = []
        for path in sorted(p for p in Path(local).rglob("*") if p.is_file()):
            keys.append(prefix + path.relative_to(local).as_posix())
            client.upload_file(str(path), bucket, keys[-1])
        return keys


@contextmanager
def s3_server() -> Iterator[S3]:
    """moto's S3-compatible server on 127.0.0.1 at a free port, for boto3 and the `aws` CLI."""
    from moto.server import ThreadedMotoServer

    quiet = logging.getLogger("werkzeug")  # moto's request lines; errors still show
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
           "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           # the venv's `aws` first, also when pytest runs as .venv/bin/python, not activated
           "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])}
    try:
        yield S3(endpoint, env)
    finally:
        server.stop()
        quiet.setLevel(level)

