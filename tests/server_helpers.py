"""Test servers shared by the test files: nginx serving a directory over HTTP on 127.0.0.1."""

import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from cli_helpers import free_port, skip_or_fail


def nginx_binary() -> str:
    """nginx from Debian, installed here if missing (the test needs root and the Debian mirror)."""
    found = shutil.which("nginx") or (os.path.exists("/usr/sbin/nginx") and "/usr/sbin/nginx")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        skip_or_fail("nginx is not installed and cannot be installed here (needs apt-get and root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "nginx-light"]
    if subprocess.run(install, env=env, capture_output=True, timeout=300).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=300)
        proc = subprocess.run(install, env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            skip_or_fail(f"apt-get install nginx-light failed: {proc.stderr.strip()[-300:]}")
    return shutil.which("nginx") or "/usr/sbin/nginx"


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
