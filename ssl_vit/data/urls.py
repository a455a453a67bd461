"""Shard URLs: brace expansion, a check that every shard can be read before anything starts, the
manifest next to the shards, and fsspec URLs (`s3://`, `gs://`, ...) for webdataset's opener.

URLs accept brace ranges (`train-{000000..000127}.tar`), local paths, `file://`, `http(s)://`,
`pipe:CMD` and fsspec URLs when the matching fsspec package is installed. `pipe:` runs a command:
recipes and suites are trusted input (they name the command); a manifest never supplies a URL.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from webdataset.gopen import gopen_schemes
from webdataset.shardlists import expand_urls

from ssl_vit.errors import UserError


def _gopen_fsspec(url, mode="rb", bufsize=8192, **kw):
    """Open `s3://`, `gs://`, ... through fsspec: webdataset 1.0's gopen has no fsspec fallback."""
    import fsspec

    return fsspec.open(url, mode).open()


def _register_fsspec() -> None:
    import fsspec

    for proto in fsspec.available_protocols():
        if proto not in gopen_schemes or proto == "gs":  # gs: fsspec (gcsfs) rather than the gsutil CLI
            gopen_schemes[proto] = _gopen_fsspec


_register_fsspec()


def expand(urls: str | Sequence[str] | None, what: str) -> list[str]:
    """Brace-expand a URL string or list (webdataset's syntax: `{000000..000006}`, `::` between lists)."""
    if isinstance(urls, str):
        urls = [urls]
    out = [u for spec in (urls or []) for u in expand_urls(spec)]
    if not out:
        raise UserError(
            f"{what} is empty: give shard URLs such as 'data/shards/digits/train-{{000000..000001}}.tar'"
        )
    return out


def _local_path(url: str) -> Path | None:
    parsed = urlparse(url)
    if parsed.scheme == "":
        return Path(url)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    return None


def _problem(url: str) -> str | None:
    """Why `url` cannot be read, or None when it can (or cannot be checked: `pipe:`)."""
    scheme = urlparse(url).scheme
    path = _local_path(url)
    if path is not None:
        return None if path.is_file() else "no such file"
    if scheme == "pipe":
        return None
    if scheme in ("http", "https"):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=15):
                return None
        except (urllib.error.URLError, OSError) as err:
            return f"unreachable ({getattr(err, 'reason', err)})"
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        return None if fs.exists(path) else "no such object"
    except ImportError as err:
        return f"needs the fsspec package for {scheme}:// ({err.name}): pip install {err.name}"
    except Exception as err:
        return f"unreachable ({err})"


def check_urls(urls: Sequence[str], what: str) -> None:
    """Fail at start-up, with one line, on a missing shard or an unreachable URL rather than hang
    or silently lose data later."""
    with ThreadPoolExecutor(16) as pool:
        problems = [(u, p) for u, p in zip(urls, pool.map(_problem, urls)) if p]
    if problems:
        url, why = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{what}: shard {url} is {why}{more}: fix the URLs or re-run `ssl-vit data convert`")


def read_manifest(first_url: str) -> dict | None:
    """The manifest `{split}.json` next to shards named `{split}-NNNNNN.tar`, or None if there is none."""
    match = re.match(r"^(.*)-\d+\.tar$", first_url)
    if not match or urlparse(first_url).scheme == "pipe":
        return None
    url = match.group(1) + ".json"
    try:
        path = _local_path(url)
        if path is not None:
            return json.loads(path.read_text()) if path.is_file() else None
        if urlparse(url).scheme in ("http", "https"):
            with urllib.request.urlopen(url, timeout=15) as f:
                return json.loads(f.read())
        import fsspec

        with fsspec.open(url, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError, ImportError):
        return None
