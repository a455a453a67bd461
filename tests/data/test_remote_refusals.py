"""What no retry mends is one line at once (issue 42): a redirect to `ftp://` (followed, each try waiting
out the read timeout: one line after about 386 s) and a URL whose port is not a number (retried 5
times, about 28 s). Through the CLI, against a local server."""

import os
import shutil
import signal
import time

from cli_helpers import run_cli, start_cli
from test_remote_faults import one_line_failure

pytest_plugins = ["server_helpers"]  # the `faulty_http` and `hub_http` fixtures


def test_a_redirect_to_ftp_is_one_line_at_once(hub_http):
    hub_http.redirect("/elsewhere/", "ftp://127.0.0.1:1/")
    url = f"{hub_http.url}/elsewhere/train-000000.tar"
    start = time.monotonic()
    proc = run_cli("data", "inspect", url, check=False)
    one_line_failure(proc, f"shard {url} is unreachable", "only http(s) redirects are followed")
    assert time.monotonic() - start < 30 and len(hub_http.requests) == 1  # asked once, never again


def test_a_url_whose_port_is_not_a_number_is_one_line_at_once():
    url = "http://127.0.0.1:eighty/train-000000.tar"
    start = time.monotonic()
    proc = run_cli("data", "inspect", url, check=False)
    one_line_failure(proc, f"shard {url} is unreachable", "nonnumeric port")
    assert "try 2 of" not in proc.stderr and time.monotonic() - start < 20, proc.stderr


def test_sigterm_while_a_server_stalls_at_start_up_ends_the_command_at_once(faulty_http, digits_shards):
    """Issue 42: SIGTERM during the start-up check of a shard on a server that accepts and never answers
    ended the command only once every try had timed out (380 s with the defaults)."""
    shutil.copy(digits_shards / "val-000000.tar", faulty_http.root / "val-000000.tar")
    faulty_http.fail("val-000000.tar", "stall", None, method="HEAD")
    proc = start_cli("data", "inspect", f"{faulty_http.url}/val-000000.tar")
    deadline = time.monotonic() + 60
    while not faulty_http.requests:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)
    stopped = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    done = proc.wait(60)
    assert done.returncode == 143 and done.stderr.splitlines()[-1] == "ssl-vit: terminated", done.stderr
    assert time.monotonic() - stopped < 10
