"""No secret in a message (issue 42): HF_TOKEN of odd shapes (a trailing newline, as `echo $(cat token) >
.env` leaves one, spaces, CR LF with a header after it, letters outside ASCII, 20,000 characters) given
to `ssl-vit data inspect` on a local Hub: a token huggingface_hub would clean is cleaned and sent, one no
token can be is refused in one line naming HF_TOKEN, and no shape of it appears in stdout or stderr. A
failure that quotes a credential shows it hidden. Through the CLI."""

import pytest
from cli_helpers import run_cli
from test_remote_faults import one_line_failure
from test_remote_redirects import RESOLVE, authorizations, serve_digits

pytest_plugins = ["server_helpers"]  # the `faulty_http` and `hub_http` fixtures

CORE = "hf_Zq7SecretTok"  # in every token below: it must never be shown
CLEANED = [
    ("trailing-newline", f"{CORE}123\n"),
    ("crlf", f"{CORE}123\r\n"),
    ("spaces", f"  {CORE}123 \t"),
    ("very-long", CORE + "x" * 20_000),
]
REFUSED = [
    ("header-injection", f"{CORE}123\r\nX-Evil: 1"),
    ("inner-space", f"{CORE} 123"),
    ("latin-1", f"{CORE}ü123"),
    ("cyrillic", f"{CORE}\u0440\u0435123"),
    ("escape-sequence", f"{CORE}\x1b[31m123"),
]


@pytest.fixture
def hub(hub_http, faulty_http, digits_shards):
    """(hub, its resolve base URL): the Hub redirects `resolve/main/` to the CDN, which serves the digits."""
    hub_http.redirect(RESOLVE, f"{faulty_http.url}/")
    serve_digits(faulty_http, digits_shards)
    return hub_http, hub_http.url + RESOLVE


def shown_nowhere(proc, token: str) -> None:
    text = proc.stdout + proc.stderr
    assert CORE not in text and "Zq7Secret" not in text, text[-3000:]
    for line in token.splitlines():
        assert len(line.strip()) < 4 or line.strip() not in text


@pytest.mark.parametrize("name, token", CLEANED, ids=[n for n, _ in CLEANED])
def test_a_token_of_an_odd_shape_is_cleaned_sent_to_the_hub_and_never_shown(name, token, hub):
    hub_server, base = hub
    env = {"HF_ENDPOINT": hub_server.url, "HF_TOKEN": token}
    proc = run_cli("data", "inspect", base + "val-000000.tar", env=env, check=False)
    assert proc.returncode == 0 and "100 good samples in 1 shards" in proc.stdout, proc.stderr[-3000:]
    assert set(authorizations(hub_server)) == {f"Bearer {token.strip()}"}
    shown_nowhere(proc, token)


@pytest.mark.parametrize("name, token", REFUSED, ids=[n for n, _ in REFUSED])
def test_a_token_no_token_can_be_is_one_line_naming_hf_token_and_never_shown(name, token, hub):
    hub_server, base = hub
    env = {"HF_ENDPOINT": hub_server.url, "HF_TOKEN": token}
    proc = run_cli("data", "inspect", base + "val-000000.tar", env=env, check=False)
    one_line_failure(proc, "HF_TOKEN holds ", "set it to the token alone")
    assert hub_server.requests == []  # nothing sent
    shown_nowhere(proc, token)


QUOTING_FAILURE = """
import os
from ssl_vit.storage import remote
def probe(url, policy=None):
    raise RuntimeError(f"the server said: token {os.environ['HF_TOKEN']!r} (Authorization: Bearer "
                       f"{os.environ['HF_TOKEN']}) for https://me:{os.environ['HF_TOKEN'].strip()}@host/")
remote.probe = probe
"""


def test_a_failure_that_quotes_a_credential_shows_it_hidden(hub):
    hub_server, base = hub
    token = f"{CORE}123\n"
    env = {"HF_ENDPOINT": hub_server.url, "HF_TOKEN": token}
    proc = run_cli("data", "inspect", base + "val-000000.tar", env=env, check=False, prelude=QUOTING_FAILURE)
    line = one_line_failure(proc, "the server said: token ")
    assert "***" in line
    shown_nowhere(proc, token)
