"""What no retry mends is one line at once (issue 42): a redirect to `ftp://` (followed, each try waiting
out the read timeout: one line after about 386 s) and a URL whose port is not a number (retried 5
times, about 28 s). Through the CLI, against a local server."""

import time

from cli_helpers import run_cli
from test_remote_faults import one_line_failure

pytest_plugins = ["server_helpers"]  # the `hub_http` fixture


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
