"""Test servers shared by the test files, serving a directory over HTTP on 127.0.0.1: nginx, and a
small Python server that fails or redirects on purpose (`faulty_http`, and `hub_http` beside it)."""

import contextlib
import email.utils
import http.server
import os
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from cli_helpers import apt_install, free_port


def nginx_binary() -> str:
    """nginx from Debian, installed here if missing (the test needs root and the Debian mirror)."""
    apt_install(["nginx-light"], present=lambda: _nginx() is not None, timeout=300)
    return _nginx()


def _nginx() -> str | None:
    return shutil.which("nginx") or ("/usr/sbin/nginx" if os.path.exists("/usr/sbin/nginx") else None)


@pytest.fixture
def nginx(tmp_path):
    """nginx serving tmp_path/www on 127.0.0.1 only, on a free port; stopped afterwards."""
    binary = nginx_binary()
    port = free_port()
    prefix = tmp_path / "nginx"
    (prefix / "logs").mkdir(parents=True)
    (tmp_path / "www").mkdir()
    conf = prefix / "nginx.conf"
    # as root, nginx's workers would drop to `nobody`, who cannot read pytest's 0700 tmp directories
    user = "user root;" if os.geteuid() == 0 else ""
    conf.write_text(f"""
{user}
daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log;
events {{ worker_connections 64; }}
http {{
    access_log {prefix}/logs/access.log;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen 127.0.0.1:{port};
        root {tmp_path / "www"};
    }}
}}
""")
    server = subprocess.Popen([binary, "-c", str(conf), "-p", str(prefix)], stderr=subprocess.PIPE)
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
                break
            except urllib.error.HTTPError:
                break  # 403/404 on the empty root: the server is up
            except OSError:
                if server.poll() is not None:
                    pytest.fail(f"nginx did not start: {server.stderr.read().decode()[-500:]}")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", tmp_path / "www"
    finally:
        server.terminate()
        server.wait(timeout=10)


class FaultyHandler(http.server.BaseHTTPRequestHandler):
    """GET (with `Range: bytes=N-` or `bytes=N-M`) and HEAD of the files under the server's `root`;
    the server's `faults` decide which requests fail and how."""

    protocol_version = "HTTP/1.0"  # one request per connection: a fault never spills into the next

    def do_HEAD(self) -> None:
        self._serve(head=True)

    def do_GET(self) -> None:
        self._serve(head=False)

    def log_message(self, format, *args) -> None:  # quiet: the tests read `server.requests`
        pass

    def _serve(self, head: bool) -> None:
        server: FaultyServer = self.server.owner
        fault, then = server.fault_for(self.command, self.path, dict(self.headers))
        try:
            self._respond(server, fault, head)
        finally:
            if then is not None:
                then()

    def _respond(self, server: "FaultyServer", fault: str | None, head: bool) -> None:
        if fault == "stall":  # nothing at all, until the test ends
            server.released.wait(300)
            return
        if fault is not None and fault.isdigit():  # an error status: "503", "403", ...
            self.send_error(int(fault), "(on purpose)")
            return
        for prefix, target, code in server.redirects:
            if self.path.startswith(prefix):
                if server.token is not None and self.headers.get("Authorization") != f"Bearer {server.token}":
                    self.send_error(401, "a gated dataset: no or another token")
                    return
                self.send_response(code)
                self.send_header("Location", target + self.path[len(prefix) :])
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        path = server.root / self.path.lstrip("/").split("?")[0]
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        start = 0
        end = len(data)
        wanted = self.headers.get("Range", "")
        if wanted.startswith("bytes=") and server.ranges:  # bytes=N- or bytes=N-M
            first, _, last = wanted[len("bytes=") :].partition("-")
            start, end = int(first), int(last) + 1 if last else len(data)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Last-Modified", email.utils.formatdate(path.stat().st_mtime, usegmt=True))
        self.end_headers()
        if head:
            return
        body = data[start:end]
        if fault in ("half", "stall_body"):
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            if fault == "stall_body":
                server.released.wait(300)
            return  # HTTP/1.0: the connection closes, half a body short
        self.wfile.write(body)


class FaultyServer:
    """A threaded HTTP server on 127.0.0.1 serving `root`, which fails on purpose: `fail(part, fault,
    nth)` makes the `nth` GET (a set of them; None: every one) whose path contains `part` fail with
    `fault`: an error status ("503", "403", ...), "half" (half the body, then the connection closes), "stall"
    (nothing at all until the test ends), "stall_body" (half the body, then nothing); `then` runs after
    the faulty response. `ranges=False` makes it ignore Range headers, as some servers do. `requests`
    lists (method, path, fault) of every request in order, `headers` their headers.
    `redirect(prefix, target, code)` answers every request whose path starts with `prefix` with a
    redirect to `target` + the rest of the path, as the Hub's `resolve/` URLs redirect to its CDN; with
    `token` set, only a request with `Authorization: Bearer TOKEN` (else 401, as for a gated dataset)."""

    def __init__(self, root: Path):
        self.root = root
        self.ranges = True
        self.faults: list[tuple] = []
        self.seen: Counter = Counter()
        self.requests: list[tuple[str, str, str | None]] = []
        self.headers: list[dict[str, str]] = []
        self.redirects: list[tuple[str, str, int]] = []
        self.token: str | None = None
        self.lock = threading.Lock()
        self.released = threading.Event()
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FaultyHandler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def fail(self, part: str, fault: str, nth: int | set[int] | None = None, method: str = "GET", then=None):
        nth = {nth} if isinstance(nth, int) else nth
        self.faults.append((part, nth, fault, method, then))

    def redirect(self, prefix: str, target: str, code: int = 302) -> None:
        self.redirects.append((prefix, target, code))

    def reset(self) -> None:
        """No faults, nothing seen yet."""
        with self.lock:
            self.faults.clear()
            self.seen.clear()
            self.requests.clear()
            self.headers.clear()

    def fault_for(self, method: str, path: str, headers: dict | None = None) -> tuple:
        """(fault, then) for this request: (None, None) when it is served as it should be."""
        with self.lock:
            found = (None, None)
            for i, (part, nth, fault, on, then) in enumerate(self.faults):
                if part in path and method == on:
                    self.seen[i] += 1
                    if found[0] is None and (nth is None or self.seen[i] in nth):
                        found = (fault, then)
            self.requests.append((method, path, found[0]))
            self.headers.append(headers or {})
            return found

    def count(self, part: str, method: str = "GET") -> int:
        return sum(1 for m, path, _ in self.requests if m == method and part in path)


@contextlib.contextmanager
def _running(root: Path):
    root.mkdir()
    server = FaultyServer(root)
    server.thread.start()
    try:
        yield server
    finally:
        server.released.set()
        server.httpd.shutdown()
        server.httpd.server_close()


@pytest.fixture
def faulty_http(tmp_path):
    """A `FaultyServer` serving tmp_path/www (empty: the test puts its files there); stopped afterwards."""
    with _running(tmp_path / "www") as server:
        yield server


@pytest.fixture
def hub_http(tmp_path):
    """A second `FaultyServer` (tmp_path/hub), on another port: another host to a client, such as the
    Hub in front of its CDN (`faulty_http`), set up with `redirect`."""
    with _running(tmp_path / "hub") as server:
        yield server
