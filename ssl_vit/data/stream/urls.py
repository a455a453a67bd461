"""Shard URLs: brace expansion, and a check that every shard can be read before anything starts (the
manifest beside them: `ssl_vit.data.format.manifest`; their opener: `tar_reader`).

URLs accept brace ranges (`train-{000000..000127}.tar`), local paths, `file://`, `http(s)://`,
`pipe:CMD` and fsspec URLs when the matching fsspec package is installed. `pipe:` runs a command:
recipes and suites are trusted input (they name the command); a manifest never supplies a URL.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

from braceexpand import UnbalancedBracesError
from webdataset.shardlists import expand_urls

from ssl_vit.errors import UserError, shown
from ssl_vit.storage import remote
from ssl_vit.storage.remote import DEFAULT, ReadPolicy, local_path, without_url

T = TypeVar("T")


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


def shard_directories(urls: str | Sequence[str], what: str) -> list[Path]:
    """The directories holding the local files among `urls` (brace-expanded), each once: what a command
    that reads them must not write into (`ssl_vit.storage.outdir`)."""
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
        return f"missing ({without_url(err, url)})"
    except remote.ReadFailed as err:
        return f"unreachable ({without_url(err, url)})"
    except ImportError as err:
        scheme = urlparse(url).scheme
        return f"needs the fsspec package for {scheme}:// ({err.name}): pip install {err.name}"
    except UserError:  # the user's to mend, not the URL's (a malformed HF_TOKEN): its own line
        raise
    except Exception as err:
        return f"unreachable ({err})"
    return None


def _in_daemons(work: Callable[[str], T], items: list[str], threads: int = 16) -> list[T]:
    """`[work(item) for item in items]`, 16 at a time, in daemon threads that a stop leaves behind: a
    SIGTERM or Ctrl-C while servers stall ends the command at once (a ThreadPoolExecutor would be joined,
    on the way out and again at the interpreter's exit, until every try had timed out). The first
    exception a `work` raised is raised here."""
    results: list = [None] * len(items)
    failures: list[BaseException] = []
    indices = iter(range(len(items)))
    lock = threading.Lock()

    def run() -> None:
        while not failures:
            with lock:
                i = next(indices, None)
            if i is None:
                return
            try:
                results[i] = work(items[i])
            except BaseException as err:
                failures.append(err)

    started = [threading.Thread(target=run, daemon=True) for _ in range(min(threads, len(items)))]
    for thread in started:
        thread.start()
    for thread in started:
        thread.join()  # a signal's exception is raised here, in the main thread
    if failures:
        raise failures[0]
    return results


# Shards found readable in this process: the CLI checks a run's shards before its logger starts, the
# data module again in its setup; each remote shard is asked for once (a HEAD or stat per shard).
_readable: set[str] = set()


def check_urls(urls: Sequence[str], what: str, policy: ReadPolicy = DEFAULT) -> None:
    """Fail at start-up, with one line, on a missing shard or an unreachable URL rather than hang
    or silently lose data later."""
    todo = [u for u in urls if u not in _readable]
    found = list(zip(todo, _in_daemons(lambda url: _problem(url, policy), todo)))
    _readable.update(u for u, p in found if p is None)
    problems = [(u, p) for u, p in found if p]
    if problems:
        url, why = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UserError(f"{what}: shard {url} is {why}{more}: fix the URLs or re-run `ssl-vit data convert`")
