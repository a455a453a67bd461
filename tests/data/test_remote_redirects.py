"""Shards behind redirects, as the Hugging Face Hub serves them: a `resolve/` URL on the Hub (`hub_http`,
HF_ENDPOINT) answers with a redirect to its CDN (`faulty_http`, another host). Reads, probes, resumed
reads and manifests go through the redirect; a HEAD stays a HEAD; a loop or too long a chain is one
line, never retried; the token (HF_TOKEN) reaches the Hub and never the CDN, and never appears in what
a command prints or writes."""

import os
import shutil
from pathlib import Path

import pytest
from cli_helpers import run_cli
from test_remote_faults import checkpoints, fit_args, one_line_failure

from ssl_vit.storage import remote
from ssl_vit.storage.remote import MAX_REDIRECTS, ReadPolicy

pytest_plugins = ["server_helpers"]  # the `faulty_http` and `hub_http` fixtures

QUICK = ReadPolicy(retries=2, timeout_s=2, backoff_s=0.05)
DATA = os.urandom(300_001)
TOKEN = "hf_NotARealTokenButSecret123"
RESOLVE = "/datasets/org/set/resolve/main/"


@pytest.fixture
def hub(hub_http, faulty_http, monkeypatch):
    """(hub, cdn, the Hub's resolve base URL): the Hub redirects every `resolve/main/` path to the CDN's
    file of that name (302), as huggingface.co does for LFS files; HF_ENDPOINT names the Hub."""
    hub_http.redirect(RESOLVE, f"{faulty_http.url}/")
    monkeypatch.setenv("HF_ENDPOINT", hub_http.url)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    (faulty_http.root / "file.bin").write_bytes(DATA)
    return hub_http, faulty_http, hub_http.url + RESOLVE


def authorizations(server) -> list:
    return [headers.get("Authorization") for headers in server.headers]


def test_a_read_a_probe_and_a_resumed_read_go_through_the_redirect(hub):
    """The body is the CDN's; the probe is a HEAD on both hosts (urllib would follow it with a GET, the
    download of the whole shard); a read cut half way continues with a Range through the redirect."""
    hub_server, cdn, base = hub
    assert remote.read_url(base + "file.bin", QUICK) == DATA
    remote.probe(base + "file.bin", QUICK)
    assert [(m, p) for m, p, _ in cdn.requests] == [("GET", "/file.bin"), ("HEAD", "/file.bin")]
    assert [m for m, _, _ in hub_server.requests] == ["GET", "HEAD"]

    cdn.reset()
    hub_server.reset()
    cdn.fail("file.bin", "half", 1)
    assert remote.read_url(base + "file.bin", QUICK) == DATA
    assert [f for _, _, f in cdn.requests] == ["half", None]
    resumed = cdn.headers[1]["Range"]
    assert resumed.startswith("bytes=") and int(resumed[6:].rstrip("-")) > 0  # the rest, not it all again
    assert [h.get("Range") for h in hub_server.headers] == [None, resumed]  # asked of the Hub, carried on


def test_the_token_reaches_the_hub_and_never_the_cdn(hub):
    """On every hop on the Hub (a renamed repository's 307 to its new name, then the 302 to the CDN) the
    token goes along; to the CDN, another host, never. Without HF_TOKEN nothing is sent."""
    hub_server, cdn, base = hub
    hub_server.redirect("/datasets/org/old-name/", f"{hub_server.url}/datasets/org/set/", code=307)
    old = f"{hub_server.url}/datasets/org/old-name/resolve/main/file.bin"
    assert remote.read_url(old, QUICK) == DATA
    remote.probe(old, QUICK)
    assert authorizations(hub_server) == [f"Bearer {TOKEN}"] * 4
    assert authorizations(cdn) == [None, None]

    cdn.reset()
    hub_server.reset()
    os.environ.pop("HF_TOKEN")
    assert remote.read_url(base + "file.bin", QUICK) == DATA
    assert authorizations(hub_server) == authorizations(cdn) == [None]


def test_a_token_for_the_hub_is_not_sent_to_another_server(hub, monkeypatch):
    """A shard URL on any other server gets no token, HF_TOKEN set or not."""
    _, cdn, _ = hub
    assert remote.read_url(f"{cdn.url}/file.bin", QUICK) == DATA
    monkeypatch.setenv("HF_ENDPOINT", "https://huggingface.co")
    assert remote.read_url(f"{cdn.url}/file.bin", QUICK) == DATA
    assert authorizations(cdn) == [None, None]


@pytest.mark.parametrize("hops", [MAX_REDIRECTS, MAX_REDIRECTS + 1])
def test_redirects_are_followed_within_a_bound(hub, hops):
    """A chain of MAX_REDIRECTS redirects is followed; one more fails at once with one line naming the
    URL (a redirect error no retry mends): each hop asked once."""
    hub_server, cdn, _ = hub
    for i in range(hops - 1):
        hub_server.redirect(f"/hop{i}/", f"{hub_server.url}/hop{i + 1}/")
    hub_server.redirect(f"/hop{hops - 1}/", f"{cdn.url}/")
    url = f"{hub_server.url}/hop0/file.bin"
    if hops <= MAX_REDIRECTS:
        assert remote.read_url(url, QUICK) == DATA
        return
    with pytest.raises(remote.ReadFailed) as caught:
        remote.read_url(url, QUICK)
    assert str(caught.value) == f"{url}: redirected more than {MAX_REDIRECTS} times (a redirect loop?)"
    assert len(hub_server.requests) == MAX_REDIRECTS + 1 and cdn.requests == []


def serve_digits(cdn, digits_shards: Path) -> None:
    for path in digits_shards.iterdir():
        shutil.copy(path, cdn.root / path.name)


def test_inspect_reads_shards_and_their_manifest_through_the_redirect(hub, digits_shards, tmp_path):
    """`ssl-vit data inspect` on Hub URLs: each shard probed (a HEAD on the CDN, never a GET) and read,
    the manifest fetched through the redirect and compared; the token only on the Hub's requests."""
    hub_server, cdn, base = hub
    serve_digits(cdn, digits_shards)
    proc = run_cli("data", "inspect", base + "val-{000000..000003}.tar")
    assert "359 good samples in 4 shards, 10 classes, 0 problems" in proc.stdout, proc.stdout
    for i in range(4):
        assert cdn.count(f"val-00000{i}.tar", "HEAD") == cdn.count(f"val-00000{i}.tar", "GET") == 1
    assert cdn.count("val.json") == 1 and hub_server.count("val.json") == 1
    assert set(authorizations(hub_server)) == {f"Bearer {TOKEN}"} and set(authorizations(cdn)) == {None}
    assert TOKEN not in proc.stdout + proc.stderr


def test_a_redirect_loop_is_one_line_and_not_retried(hub, tmp_path):
    hub_server, _, _ = hub
    hub_server.redirect("/loop/", f"{hub_server.url}/loop/")
    url = f"{hub_server.url}/loop/train-000000.tar"
    proc = run_cli("data", "inspect", url, check=False)
    one_line_failure(proc, f"shard {url} is unreachable (redirected more than {MAX_REDIRECTS} times")
    assert len(hub_server.requests) == MAX_REDIRECTS + 1  # once along the loop, no retry
    assert TOKEN not in proc.stdout + proc.stderr


@pytest.mark.parametrize("token", [None, "hf_WrongTokenAlsoSecret456"])
def test_a_gated_set_without_its_token_is_one_line_that_names_hf_token(hub, digits_shards, token):
    """The Hub answers 401 without the right token: one line naming HF_TOKEN, after one request (no
    retry), and the token given appears nowhere in the output."""
    hub_server, cdn, base = hub
    serve_digits(cdn, digits_shards)
    hub_server.token = TOKEN
    env = {"HF_ENDPOINT": hub_server.url, "HF_TOKEN": token or ""}
    proc = run_cli("data", "inspect", base + "val-000000.tar", env=env, check=False)
    one_line_failure(proc, "HTTP 401", "set HF_TOKEN to a Hugging Face token with access to it")
    assert hub_server.count("val-000000.tar", "HEAD") == 1 and cdn.requests == []
    if token:
        assert token not in proc.stdout + proc.stderr
    hub_server.reset()
    proc = run_cli("data", "inspect", base + "val-000000.tar", env={**env, "HF_TOKEN": TOKEN})
    assert "100 good samples in 1 shards" in proc.stdout and TOKEN not in proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fit_reads_hub_urls_and_writes_the_token_nowhere(hub, digits_shards, tmp_path):
    """`ssl-vit fit` (its W&B logger offline, checkpoints, config) on Hub URLs through the redirect and a
    dropped connection: it trains, and no file of the run and no line of its output holds the token.
    A failing fit (a shard the CDN refuses) names the URL, not the token."""
    hub_server, cdn, base = hub
    serve_digits(cdn, digits_shards)
    cdn.fail(".tar", "half", 1)  # the first shard read is cut half way, and resumed
    run = tmp_path / "run"
    env = {"HF_ENDPOINT": hub_server.url, "HF_TOKEN": TOKEN, "PYTHONPATH": str(Path(__file__).parents[1])}
    args = fit_args(base.rstrip("/"), run, tmp_path / "steps.jsonl")
    logger = args.index("--trainer.logger")
    del args[logger : logger + 4]  # the recipe's own logger: W&B, offline
    args[3:3] = ["--trainer.callbacks=[]"]  # not the few-shot monitor (the step recorder is added after)
    proc = run_cli(*args, env=env, check=False, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert checkpoints(run) and len((tmp_path / "steps.jsonl").read_text().splitlines()) == 4
    assert set(authorizations(hub_server)) == {f"Bearer {TOKEN}"} and set(authorizations(cdn)) == {None}
    assert "half" in [f for _, _, f in cdn.requests]
    written = [p for p in run.rglob("*") if p.is_file()]
    assert any(p.suffix == ".wandb" for p in written) and any(p.name == "config.yaml" for p in written)
    for path in written:
        assert TOKEN.encode() not in path.read_bytes(), path
    assert TOKEN not in proc.stdout + proc.stderr

    cdn.reset()
    for method in ("HEAD", "GET"):  # the start-up check's HEAD, then its ranged GET
        cdn.fail("train-", "403", method=method)
    proc = run_cli(
        *fit_args(base.rstrip("/"), tmp_path / "failed", tmp_path / "f.jsonl"), env=env, check=False
    )
    one_line_failure(proc, f"shard {base}train-", "HTTP 403")
    assert TOKEN not in proc.stdout + proc.stderr
