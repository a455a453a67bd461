"""Shard URLs: brace expansion, a check that every shard can be read before anything starts, the
manifest next to the shards, and fsspec URLs (`s3://`, `gs://`, ...) for webdataset's opener.

URLs accept brace ranges (`train-{000000..000127}.tar`), local paths, `file://`, `http(s)://`,
`pipe:CMD` and fsspec URLs when the matching fsspec package is installed, remote ones read with
retries and a read timeout (`ssl_vit.data.remote`). `pipe:` runs a command: recipes and suites are
trusted input (they name the command); a manifest never supplies a URL.
"""

from __future__ import annotations

import json
import math
import re
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

from braceexpand import UnbalancedBracesError
from webdataset.shardlists import expand_urls

from ssl_vit.data import remote
from ssl_vit.data.arrays import ARRAY_DTYPES
from ssl_vit.data.remote import DEFAULT, ReadPolicy
from ssl_vit.data.samples import MAX_CLASSES
from ssl_vit.errors import UserError, shown


def expand(urls: str | Sequence[str] | None, what: str) -> list[str]:
    """Brace-expand a URL string or list (webdataset's syntax: `{000000..000006}`, `::` between lists)."""
    if isinstance(urls, str):
        urls = [urls]
    if urls is not None and not (isinstance(urls, list | tuple) and all(isinstance(u, str) for u in urls)):
        raise UserError(f"{what} is {shown(urls)}: give shard URLs as a string or a list of strings")
    try:
        out = [u for spec in (urls or []) for u in expand_urls(spec)]
    except UnbalancedBracesError as err:
        raise UserError(
            f"{what}: {err}: close each '{{' with '}}', "
            "as in 'data/shards/digits/train-{000000..000001}.tar'"
        ) from None
    if not out:
        raise UserError(
            f"{what} is empty: give shard URLs such as 'data/shards/digits/train-{{000000..000001}}.tar'"
        )
    return out


def local(urls: str | Sequence[str]) -> bool:
    """Whether every URL of `urls` (a string or list, brace ranges unexpanded) names a local file (a path
    or `file://`): a manifest beside them is read for free. A remote one is read once, by the run that
    needs it, not again by a check before it."""
    urls = [urls] if isinstance(urls, str) else urls
    listed = isinstance(urls, list | tuple)
    return listed and all(isinstance(url, str) and local_path(url) is not None for url in urls)


def local_path(url: str) -> Path | None:
    """The file a local URL (a path or `file://`) names; None for any other scheme."""
    parsed = urlparse(url)
    if parsed.scheme == "":
        return Path(url)
    if parsed.scheme == "file":
        return Path(urllib.request.url2pathname(parsed.path))
    return None


def shard_directories(urls: str | Sequence[str], what: str) -> list[Path]:
    """The directories holding the local files among `urls` (brace-expanded), each once: what a command
    that reads them must not write into (`ssl_vit.outdir`)."""
    paths = (local_path(url) for url in expand(urls, what))
    return list(dict.fromkeys(path.parent for path in paths if path is not None))


def _problem(url: str, policy: ReadPolicy = DEFAULT) -> str | None:
    """Why `url` cannot be read, or None when it can (or cannot be checked: `pipe:`). A remote URL is
    asked with `policy`'s retries: a server that fails now and then is not a missing shard."""
    path = local_path(url)
    if path is not None:
        return None if path.is_file() else "no such file"
    try:
        remote.probe(url, policy)
    except remote.Missing as err:
        return f"missing ({_after_url(err, url)})"
    except remote.ReadFailed as err:
        return f"unreachable ({_after_url(err, url)})"
    except ImportError as err:
        scheme = urlparse(url).scheme
        return f"needs the fsspec package for {scheme}:// ({err.name}): pip install {err.name}"
    except Exception as err:
        return f"unreachable ({err})"
    return None


def _after_url(err: Exception, url: str) -> str:
    """A `remote` error's message without the URL it starts with (the caller names it)."""
    return str(err).removeprefix(f"{url}: ")


# Shards found readable in this process: the CLI checks a run's shards before its logger starts, the
# data module again in its setup; each remote shard is asked for once (a HEAD or stat per shard).
_readable: set[str] = set()


def check_urls(urls: Sequence[str], what: str, policy: ReadPolicy = DEFAULT) -> None:
    """Fail at start-up, with one line, on a missing shard or an unreachable URL rather than hang
    or silently lose data later."""
    todo = [u for u in urls if u not in _readable]
    with ThreadPoolExecutor(16) as pool:
        found = list(zip(todo, pool.map(lambda url: _problem(url, policy), todo)))
    _readable.update(u for u, p in found if p is None)
    problems = [(u, p) for u, p in found if p]
    if problems:
        url, why = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{what}: shard {url} is {why}{more}: fix the URLs or re-run `ssl-vit data convert`")


def manifest_url(shard_url: str) -> str | None:
    """The URL of the manifest `{split}.json` next to a shard named `{split}-NNNNNN.tar`, or None
    for other names and `pipe:` URLs."""
    match = re.match(r"^(.*)-\d+\.tar$", shard_url)
    if not match or urlparse(shard_url).scheme == "pipe":
        return None
    return match.group(1) + ".json"


def read_manifest(first_url: str, policy: ReadPolicy = DEFAULT) -> dict | None:
    """The manifest `{split}.json` next to shards named `{split}-NNNNNN.tar`, or None if there is none
    (no such file; HTTP 404 or 410; no such object).

    A manifest that exists but cannot be read (a server error or a timeout after `policy`'s retries, a
    refused connection, a permission) is a UserError naming it, never "no manifest": the readers size
    epochs, count classes and choose the eval view from it. So is one that is not JSON, or whose keys
    have the wrong types (naming the file and the key)."""
    url = manifest_url(first_url)
    if url is None:
        return None
    path = local_path(url)
    try:
        if path is not None:
            if not path.is_file():
                return None
            text = path.read_bytes()
        else:
            text = remote.read_url(url, policy)
    except remote.Missing:
        return None
    except (OSError, ImportError, ValueError) as err:
        reason = (
            _after_url(err, url) if isinstance(err, remote.ReadFailed) else f"{type(err).__name__}: {err}"
        )
        raise UserError(
            f"manifest {url} exists but cannot be read ({reason}): fix the server or the file, or raise "
            "data.init_args.read_retries / read_timeout_s"
        ) from None
    try:
        manifest = json.loads(text)
    except (ValueError, RecursionError) as err:  # RecursionError: nested deeper than the parser goes
        raise UserError(
            f"manifest {url} is not JSON ({err}): re-run `ssl-vit data convert`, or delete it and set "
            "data.init_args.train_batches and num_classes"
        ) from None
    check_manifest(manifest, url)
    return manifest


def check_manifest(manifest: object, where: str) -> None:
    """Raise a one-line UserError naming `where` and the key when `manifest` does not have the types
    data/README.md documents (the keys ssl-vit reads are required; the others are checked when present)."""
    fix = "fix the file or re-run `ssl-vit data convert`"
    if not isinstance(manifest, dict):
        raise UserError(f"manifest {where} is a JSON {type(manifest).__name__}, not an object: {fix}")

    missing = object()

    def bad(key: str, should: str, element: str = "", value: object = missing) -> UserError:
        value = manifest.get(key, missing) if value is missing else value
        text = "missing" if value is missing else shown(value)
        return UserError(f"manifest {where}: {key!r}{element} is {text}, it should be {should}: {fix}")

    def count(value: object) -> bool:  # JSON integers beyond 2^53 are not exact in most readers
        return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**53

    for key in ("num_samples", "num_classes"):
        if not count(manifest.get(key)):
            raise bad(key, "a non-negative integer")
    if manifest["num_classes"] > MAX_CLASSES:
        raise bad("num_classes", f"at most {MAX_CLASSES:,}")
    if "masks" in manifest and not isinstance(manifest["masks"], bool):
        raise bad("masks", "true or false")
    for key in ("version", "skipped"):
        if key in manifest and not count(manifest[key]):
            raise bad(key, "a non-negative integer")
    for key in ("source", "split", "image_format"):
        if key in manifest and not isinstance(manifest[key], str):
            raise bad(key, "a string")
    size = manifest.get("image_size")
    if size is not None and not (isinstance(size, list) and len(size) == 2 and all(map(count, size))):
        raise bad("image_size", "[height, width] or null")
    names = manifest.get("class_names", [])
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise bad("class_names", "a list of strings")
    for key, example in (("class_counts", '{"0": 150, "1": 148}'), ("mask_pixels", '{"0": 9000, "255": 12}')):
        counts = manifest.get(key, {})
        if not isinstance(counts, dict):
            raise bad(key, f"an object of class -> count, such as {example}")
        for label, n in counts.items():
            if not re.fullmatch(r"-?[0-9]{1,20}", label):
                raise bad(key, f'keyed by classes such as "0" or "-1", not {label[:40]!r}')
            if not count(n):
                raise bad(key, "a non-negative integer", f"[{label!r}]", n)
    shards = manifest.get("shards")
    shard = '{"url": NAME, "num_samples": COUNT}'
    if not isinstance(shards, list):
        raise bad("shards", f"a list of {shard}")
    for i, entry in enumerate(shards):
        if not (
            isinstance(entry, dict) and isinstance(entry.get("url"), str) and count(entry.get("num_samples"))
        ):
            raise bad("shards", shard, f"[{i}]", entry)
    _check_bands(manifest, bad, count)


BAND_STATS_KEYS = ("mean", "std", "min", "max")


def _check_bands(manifest: dict, bad, count) -> None:
    """The keys of the images' bands, when present: `channels`, `dtype`, `band_names`, `band_stats`."""
    channels = manifest.get("channels")
    if channels is not None and not (count(channels) and channels > 0):
        raise bad("channels", "a positive integer")
    if "dtype" in manifest and manifest["dtype"] not in ARRAY_DTYPES:
        raise bad("dtype", f"one of {', '.join(ARRAY_DTYPES)}")
    names = manifest.get("band_names")
    if names is not None and not (
        isinstance(names, list) and all(isinstance(n, str) for n in names) and len(names) == channels
    ):
        raise bad("band_names", "a list of strings, one per channel")
    stats = manifest.get("band_stats")
    if stats is None:
        return
    per_band = "{" + ", ".join(f'"{k}": [one number per band]' for k in BAND_STATS_KEYS) + ', "images": K}'
    if not isinstance(stats, dict) or not count(stats.get("images")):
        raise bad("band_stats", per_band)
    for key in BAND_STATS_KEYS:
        values = stats.get(key)
        numbers = isinstance(values, list) and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values
        )
        if not numbers or len(values) != (channels or len(values)) or not values:
            raise bad("band_stats", "one finite number per band", f"[{key!r}]", values)


def channel_choices(manifest: dict) -> tuple[int, ...]:
    """The `channels` a data module may read a manifest's images with (none recorded: any): its
    `channels`, and for a grey 8-bit set also 3, which reads grey images as RGB, as it always has."""
    channels = manifest.get("channels")
    if channels is None:
        return ()
    return (1, 3) if channels == 1 and manifest.get("dtype", "uint8") == "uint8" else (channels,)
