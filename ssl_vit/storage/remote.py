"""Reading over a network: every fetch of a manifest, shard or checkpoint from an `http(s)://`, fsspec
(`s3://`, `gs://`, ...) or `pipe:` URL tries again a bounded number of times, waits longer before
each try, gives up on a read that gets no byte for a while, and continues where the data broke off.

- `ReadPolicy`: how hard; `ShardDataModule`'s `read_retries` and `read_timeout_s`, and
  `SafeCheckpointIO`'s for checkpoints.
- `open_url` / `read_url` / `probe`: a stream, the whole content, whether it exists. A URL that does not
  exist is `Missing` at once. A server's passing trouble (5xx but those that mean "never": 501, 505,
  ...; 408, 429, a timeout, a refused or dropped connection, a command that exits non-zero) is tried
  again, and is `ReadFailed` after the last try; any other status (403, 501, ...) is `ReadFailed` at once.
- `local_path` / `without_url`: the file a local URL names; an error's message without its URL.

http(s) redirects (the Hugging Face Hub answers a `resolve/` URL with a redirect to its CDN) are
followed as `_Redirects` says; a `Range` goes along, so probes and resumed reads work through them. A
Hub token (`HF_TOKEN`, as huggingface_hub reads it) is sent as `Authorization: Bearer` to the Hub only
(`_on_hub`), never to the host a redirect leads to, and it is never written anywhere (messages, logs,
configs, checkpoints).

A fetch that breaks off after some bytes continues at the next byte rather than starting again: an
HTTP range request (`Range: bytes=N-`; from a server that ignores ranges, the first N bytes are read
again and dropped), a seek for fsspec files, and for a `pipe:` command the command run again with its
first N bytes dropped. So a shard read through a dropped connection gives exactly the samples of an
uninterrupted read. A file that changes between tries (another length, ETag or Last-Modified) fails
instead of being stitched together from two versions.

Hand-written, because none of the libraries does this for a stream: webdataset opens http(s) with
`curl` writing to a pipe, which has no read timeout (only `--connect-timeout`) and whose exit status is
raised only when the pipe is closed; and curl's `--retry` restarts a transfer that broke after bytes
were written, writing them into the pipe again (curl's manual warns of it: a 3 MB file whose first
response stops half way comes out as 4.5 MB, exit status 0). urllib and fsspec open and read without
retrying. The timeouts are the libraries': urllib's socket timeout (per read, connect included),
`select` on a command's output, and for fsspec the backend's own (botocore's `read_timeout`, ...).

Every retry is logged as a warning (logger `ssl_vit.data`) with the URL, the reason and the wait.
"""

from __future__ import annotations

import http.client
import io
import logging
import os
import random
import select
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ssl_vit.errors import UserError, check_count, check_positive_seconds
from ssl_vit.redact import clean_token

log = logging.getLogger("ssl_vit.data")

MAX_BACKOFF_S = 30.0  # the longest wait between two tries
BUFFER = 1 << 18  # bytes read from the network at a time; tar headers are then read from memory


@dataclass(frozen=True)
class ReadPolicy:
    """How hard one fetch tries: after a failure, up to `retries` more tries, waiting `backoff_s`,
    then twice as long before each next one (at most MAX_BACKOFF_S, drawn between half and all of it so
    that many workers do not come back at once); a read, or a connection, that gets no byte for
    `timeout_s` seconds has failed. The tries are counted over the whole fetch, a fetch that resumes
    included."""

    retries: int = 5
    timeout_s: float = 60.0
    backoff_s: float = 1.0

    def delay(self, retry: int) -> float:
        """The longest wait before retry number `retry` (0 for the first)."""
        return min(MAX_BACKOFF_S, self.backoff_s * 2**retry)

    def worst_case_s(self) -> float:
        """The longest one fetch goes without a byte before it gives up: every try timing out, and the
        waits between them."""
        return (self.retries + 1) * self.timeout_s + sum(self.delay(k) for k in range(self.retries))


DEFAULT = ReadPolicy()
# More retries are a mistake (a typo, a number pasted into the wrong key), not a setting.
MAX_RETRIES = 100


def checked_policy(retries: object = None, timeout_s: object = None) -> ReadPolicy:
    """The `ReadPolicy` of the settings `read_retries` and `read_timeout_s` (None: the default), each
    checked first (one line for a bad value)."""
    check_count("read_retries", retries, 0, MAX_RETRIES)
    check_positive_seconds("read_timeout_s", timeout_s)
    return ReadPolicy(
        retries=DEFAULT.retries if retries is None else retries,
        timeout_s=DEFAULT.timeout_s if timeout_s is None else float(timeout_s),
    )


class Missing(FileNotFoundError):
    """The URL names nothing (HTTP 404 or 410, no such object or file): an answer, never retried."""


class ReadFailed(OSError):
    """A fetch that failed for good: after its last try, or at once for an error no retry can mend
    (HTTP 403, a bad certificate). The message is one line: URL, reason, tries."""


class _Changed(OSError):
    """The file changed between two tries of one fetch: its two parts would not be one file."""


class _TooManyRedirects(OSError):
    """A request redirected more than MAX_REDIRECTS times (a loop), or to a scheme other than http(s)
    (`_Redirects`): never mended by trying again."""


def is_remote(url: str) -> bool:
    """Whether `url` is read by this module (not a local path or `file://`)."""
    return urlparse(url).scheme not in ("", "file")


def local_path(url: str) -> Path | None:
    """The file a local URL (a path or `file://`) names; None for any other scheme."""
    parsed = urlparse(url)
    if parsed.scheme == "":
        return Path(url)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    return None


def without_url(err: Exception, url: str) -> str:
    """An error's message of this module without the URL it starts with (the caller names it)."""
    return str(err).removeprefix(f"{url}: ")


def open_url(url: str, policy: ReadPolicy = DEFAULT) -> io.BufferedReader:
    """A stream of the remote file `url`, read with `policy` (see the module's docstring). Opening
    raises `Missing` or `ReadFailed`; reading raises `ReadFailed` once the tries are spent."""
    return io.BufferedReader(_Resumable(url, _source(url, policy.timeout_s), policy), BUFFER)


def read_url(url: str, policy: ReadPolicy = DEFAULT) -> bytes:
    """The whole content of the remote file `url` (a manifest): `Missing` or `ReadFailed` as `open_url`."""
    with open_url(url, policy) as stream:
        return stream.read()


def download(url: str, path: str, policy: ReadPolicy = DEFAULT) -> None:
    """The remote file `url` copied to the local file `path` (a checkpoint), as `open_url` reads it."""
    with open_url(url, policy) as stream, open(path, "wb") as out:
        while chunk := stream.read(BUFFER):
            out.write(chunk)


def probe(url: str, policy: ReadPolicy = DEFAULT) -> None:
    """Returns if the remote file `url` exists; raises `Missing` if it does not, `ReadFailed` if that
    cannot be told after the tries (an http(s) HEAD request; `exists` for fsspec; nothing for `pipe:`,
    whose command runs only when the shard is read)."""
    scheme = urlparse(url).scheme
    if scheme == "pipe":
        return
    if scheme in ("http", "https"):

        def head() -> None:
            try:
                with _http_open(url, policy.timeout_s, method="HEAD"):
                    return
            except urllib.error.HTTPError as err:
                if err.code not in HEAD_REFUSED:
                    raise
            # Presigned S3 and GCS URLs sign the method, so HEAD is refused (403) where GET is allowed;
            # some servers have no HEAD (405, 501). One byte of a GET tells (200: a server that ignores
            # ranges; the body is not read).
            with _http_open(url, policy.timeout_s, headers={"Range": "bytes=0-0"}):
                pass

        _tried(url, policy, head, _http_verdict)
        return
    import fsspec

    def exists() -> None:
        fs, path = fsspec.core.url_to_fs(url)
        if not fs.exists(path):
            raise Missing(f"{url}: no such object")

    _tried(url, policy, exists, _fsspec_verdict)


# --- retrying -------------------------------------------------------------------------------------

# What a failure means: the URL names nothing, try again, or give up at once.
MISSING, RETRY, FATAL = "missing", "retry", "fatal"
# HTTP statuses that no retry mends, though 5xx: the server does not implement the method or protocol
# (501, 505), or is set up so that it never can answer (506, 508, 510, 511). Other 5xx are a server's
# passing trouble (500, 502-504, and the 52x of proxies in front of one).
PERMANENT_5XX = {501, 505, 506, 508, 510, 511}
HEAD_REFUSED = {403, 405, 501}


def _tried(url: str, policy: ReadPolicy, attempt: Callable[[], object], verdict: Callable) -> object:
    """`attempt()`, tried up to 1 + policy.retries times."""
    tries = 0
    while True:
        tries += 1
        try:
            return attempt()
        except UserError:  # the user's to mend (HF_TOKEN): no try mends it
            raise
        except Exception as err:
            _after_failure(url, policy, err, verdict(err), tries)


def _after_failure(url: str, policy: ReadPolicy, err: Exception, kind: str, tries: int) -> None:
    """Raise what a failure of try number `tries` comes to, or wait before the next try."""
    reason = _reason(err, policy)
    if isinstance(err, urllib.error.HTTPError) and err.code in (401, 403) and _on_hub(url):
        reason += " (a gated or private dataset: set HF_TOKEN to a Hugging Face token with access to it)"
    if kind == MISSING:
        raise Missing(f"{url}: {reason}") from None
    if kind == FATAL:
        raise ReadFailed(f"{url}: {reason}") from None
    if tries > policy.retries:
        raise ReadFailed(f"{url}: {reason} (tried {tries} times)") from None
    wait = policy.delay(tries - 1) * _jitter.uniform(0.5, 1.0)
    log.warning(
        "reading %s failed (%s): try %d of %d in %.1f s", url, reason, tries + 1, policy.retries + 1, wait
    )
    time.sleep(wait)


_jitter = random.Random()  # its own: the global RNGs are seeded per sample (ssl_vit.data.stream.pipeline)


def _reason(err: BaseException, policy: ReadPolicy) -> str:
    """What went wrong, in a few words on one line."""
    if isinstance(err, urllib.error.HTTPError):
        return f"HTTP {err.code} {err.reason}"
    if isinstance(err, urllib.error.URLError):
        return _reason(err.reason, policy) if isinstance(err.reason, BaseException) else str(err.reason)
    if isinstance(err, TimeoutError) and str(err) in ("", "timed out"):  # the socket's own
        return f"no byte for {policy.timeout_s:g} s"
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    ours = (_Changed, _TooManyRedirects)
    if isinstance(err, (ConnectionError, TimeoutError, ChildProcessError, *ours)) and text:
        return text  # ours, or the system's "[Errno N] ..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _http_verdict(err: Exception) -> str:
    if isinstance(err, urllib.error.HTTPError):
        if err.code in (404, 410):
            return MISSING
        transient = err.code >= 500 and err.code not in PERMANENT_5XX
        return RETRY if transient or err.code in (408, 425, 429) else FATAL
    if isinstance(err, (_Changed, _TooManyRedirects, http.client.InvalidURL)):  # no try mends them
        return FATAL
    if isinstance(err, urllib.error.URLError) and isinstance(err.reason, ssl.SSLCertVerificationError):
        return FATAL
    if isinstance(err, (OSError, http.client.HTTPException)):  # timeouts, refused and cut connections
        return RETRY
    return FATAL


def _fsspec_verdict(err: Exception) -> str:
    if isinstance(err, FileNotFoundError):
        return MISSING
    if isinstance(err, (_Changed, ImportError, ValueError, PermissionError)):
        return FATAL
    return RETRY  # the backends raise their own types for network trouble (botocore, aiohttp, ...)


def _command_verdict(err: Exception) -> str:
    return FATAL if isinstance(err, (_Changed, ValueError)) else RETRY


class _Resumable(io.RawIOBase):
    """The bytes of one remote file from its start to its end, through failures: a try that breaks off
    is followed, after a wait, by one that opens the source at the next byte (`_source`)."""

    def __init__(self, url: str, source, policy: ReadPolicy):
        super().__init__()
        self.url, self.source, self.policy = url, source, policy
        self.position = 0  # bytes delivered
        self.tries = 0
        self.body = None
        self.body = self._open()

    def readable(self) -> bool:
        return True

    def _open(self):
        while True:
            self.tries += 1
            try:
                return self.source.open(self.position)
            except Exception as err:
                _after_failure(self.url, self.policy, err, self.source.verdict(err), self.tries)

    def readinto(self, buffer) -> int:
        while True:
            if self.body is None:
                self.body = self._open()  # raises Missing or ReadFailed once the tries are spent
            try:
                n = self.body.readinto(buffer)
            except Exception as err:
                self._drop_body()
                # the failed read belongs to the current try; the next one is counted by `_open`
                _after_failure(self.url, self.policy, err, self.source.verdict(err), self.tries)
                continue
            self.position += n
            return n

    def _drop_body(self) -> None:
        if self.body is not None:
            body, self.body = self.body, None
            try:
                body.close()
            except Exception:  # a broken connection or command: its failure is being handled
                pass

    def close(self) -> None:
        self._drop_body()
        super().close()


def _source(url: str, timeout_s: float):
    scheme = urlparse(url).scheme
    if scheme in ("http", "https"):
        return _Http(url, timeout_s)
    if scheme == "pipe":
        return _Command(url.removeprefix("pipe:"), timeout_s)
    return _Fsspec(url)


def _skip(body, count: int) -> None:
    """Read and drop the first `count` bytes of `body` (a source that cannot start at a byte)."""
    scratch, left = bytearray(min(count, BUFFER)), count
    while left:
        n = body.readinto(memoryview(scratch)[: min(left, len(scratch))])
        if n == 0:
            raise _Changed(f"the data now ends before byte {count}: it changed between two tries")
        left -= n


# --- http(s) ----------------------------------------------------------------------------------------


class _Http:
    """urllib with its timeout on every socket operation; later tries ask for the rest (`Range`)."""

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        self.identity: tuple | None = None  # (length, ETag, Last-Modified) of the first response

    verdict = staticmethod(_http_verdict)

    def open(self, offset: int):
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        response = _http_open(self.url, self.timeout_s, headers=headers)
        try:
            if offset and response.status == 206:
                start, _, total = response.headers.get("Content-Range", "").partition(" ")[2].partition("/")
                if not start.startswith(f"{offset}-"):
                    raise _Changed(f"asked for byte {offset} on, the server sent {start or 'no range'}")
                length = int(total) if total.isdigit() else None
            else:
                length = _int(response.headers.get("Content-Length"))
            identity = (length, response.headers.get("ETag"), response.headers.get("Last-Modified"))
            if self.identity is None:
                self.identity = identity
            elif any(a != b for a, b in zip(identity, self.identity) if a is not None and b is not None):
                raise _Changed("the file changed between two tries (length, ETag or Last-Modified)")
            body = _HttpBody(
                response, None if length is None else length - (offset if response.status == 206 else 0)
            )
            if offset and response.status != 206:
                _skip(body, offset)  # a server that ignores ranges sends it all again
            return body
        except BaseException:
            response.close()
            raise


MAX_REDIRECTS = 10  # per request; a Hub `resolve/` URL takes one (to the CDN), two for a renamed repository
HUB = "https://huggingface.co"


def _http_open(url: str, timeout_s: float, method: str = "GET", headers: dict | None = None):
    """urllib's response to one request, redirects followed (`_Redirects`), the Hub token added on the Hub."""
    request = urllib.request.Request(url, method=method, headers=headers or {})
    _authorize(request)
    return _OPENER.open(request, timeout=timeout_s)


def _authorize(request: urllib.request.Request) -> None:
    """`Authorization: Bearer $HF_TOKEN` on a request to the Hub, none on any other."""
    request.remove_header("Authorization")
    token = hub_token() if _on_hub(request.full_url) else None
    if token:
        request.add_header("Authorization", f"Bearer {token}")


def hub_token() -> str | None:
    """HF_TOKEN as huggingface_hub reads it (`clean_token`), or None; a one-line UserError, which quotes
    none of it, when what is left holds a character no token has (a control character, a space, a letter
    outside ASCII): http.client would refuse it with a message quoting the whole header."""
    token = clean_token(os.environ.get("HF_TOKEN") or "")
    wrong = [i for i, c in enumerate(token) if not 33 <= ord(c) <= 126]
    if wrong:
        where = ", ".join(str(i + 1) for i in wrong[:5]) + (" ..." if len(wrong) > 5 else "")
        raise UserError(
            f"HF_TOKEN holds {len(wrong)} character(s) no token has (a control character, a space or a "
            f"letter outside ASCII; at character {where} of {len(token)}): set it to the token alone, as "
            "huggingface.co/settings/tokens shows it"
        )
    return token or None


def _on_hub(url: str) -> bool:
    """Whether `url` is on the Hub: the scheme, host and port of HF_ENDPOINT, as huggingface_hub uses it."""
    return _origin(url) == _origin(os.environ.get("HF_ENDPOINT") or HUB)


def _origin(url: str) -> tuple:
    parts = urlparse(url)
    try:
        port = parts.port
    except ValueError:  # a port that is not a number names no origin
        return (None,)
    return parts.scheme, parts.hostname, port or {"http": 80, "https": 443}.get(parts.scheme)


class _Redirects(urllib.request.HTTPRedirectHandler):
    """urllib's redirects, with four changes. Only http(s) is followed (urllib follows `ftp://` too, each
    try waiting out the read timeout). A HEAD stays a HEAD: urllib's handler (Python 3.11's
    `redirect_request`) follows it with a GET, and a probe would start downloading the shard. The token
    is decided again for every hop (`_authorize`): urllib copies every header to the next host. More
    than MAX_REDIRECTS hops fail with `_TooManyRedirects` (urllib's own loop error has three lines)."""

    max_repeats = max_redirections = MAX_REDIRECTS + 1  # so that the count below decides

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        scheme = urlparse(newurl).scheme
        if scheme not in ("http", "https"):
            fp.close()
            raise _TooManyRedirects(f"redirected to a {scheme}:// URL; only http(s) redirects are followed")
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        hops = getattr(req, "hops", 0) + 1
        if hops > MAX_REDIRECTS:
            fp.close()
            raise _TooManyRedirects(f"redirected more than {MAX_REDIRECTS} times (a redirect loop?)")
        new.hops, new.method = hops, req.get_method()
        _authorize(new)
        return new


_OPENER = urllib.request.build_opener(_Redirects)


def _int(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


class _HttpBody:
    """A response's body that raises when the connection ends before Content-Length (http.client
    returns 0, as at the end)."""

    def __init__(self, response, remaining: int | None):
        self.response, self.remaining = response, remaining

    def readinto(self, buffer) -> int:
        n = self.response.readinto(buffer)
        if self.remaining is not None:
            if n == 0 and self.remaining > 0 and len(buffer):
                raise ConnectionError(f"the connection closed {self.remaining} bytes before the end")
            self.remaining -= n
        return n

    def close(self) -> None:
        self.response.close()


# --- pipe: commands -----------------------------------------------------------------------------------


class _Command:
    """A `pipe:` command's output. A try runs the command (in a process group of its own, so that
    closing early ends it and what it started); its exit status is read at the end of its output."""

    def __init__(self, command: str, timeout_s: float):
        self.command, self.timeout_s = command, timeout_s

    verdict = staticmethod(_command_verdict)

    def open(self, offset: int):
        from webdataset import utils

        if utils.enforce_security:  # as webdataset's own `pipe:` opener
            raise ValueError("pipe: URLs are refused while webdataset's enforce_security is set")
        body = _CommandBody(self.command, self.timeout_s)
        try:
            _skip(body, offset)
        except BaseException:
            body.close()
            raise
        return body


class _CommandBody:
    def __init__(self, command: str, timeout_s: float):
        self.command, self.timeout_s = command, timeout_s
        self.process = subprocess.Popen(
            command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True
        )  # a shell, as webdataset runs `pipe:` commands: recipes are trusted input
        self.fd = self.process.stdout.fileno()

    def readinto(self, buffer) -> int:
        if not select.select([self.fd], [], [], self.timeout_s)[0]:
            raise TimeoutError(f"`{self.command}` wrote nothing for {self.timeout_s:g} s")
        n = os.readv(self.fd, [buffer])
        if n == 0 and len(buffer):
            try:
                status = self.process.wait(self.timeout_s)
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"`{self.command}` closed its output but did not exit") from None
            if status != 0:
                raise ChildProcessError(f"`{self.command}` exited with status {status}")
        return n

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.stdout.close()
        self.process.wait()


# --- fsspec -------------------------------------------------------------------------------------------


class _Fsspec:
    """An fsspec file; a later try seeks to the next byte."""

    def __init__(self, url: str):
        self.url = url
        self.size: int | None = None

    verdict = staticmethod(_fsspec_verdict)

    def open(self, offset: int):
        import fsspec

        f = fsspec.open(self.url, "rb").open()
        try:
            size = getattr(f, "size", None)
            if self.size is None:
                self.size = size
            elif size is not None and size != self.size:
                raise _Changed(f"the file changed between two tries (size {self.size}, now {size})")
            if offset:
                f.seek(offset)
            return _FileBody(f, None if size is None else size - offset)
        except BaseException:
            f.close()
            raise


class _FileBody(_HttpBody):
    def readinto(self, buffer) -> int:
        data = self.response.read(len(buffer))
        buffer[: len(data)] = data
        if self.remaining is not None:
            if not data and self.remaining > 0 and len(buffer):
                raise ConnectionError(f"the data ended {self.remaining} bytes before its size")
            self.remaining -= len(data)
        return len(data)
