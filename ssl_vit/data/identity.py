"""What a training stream reads, as a checkpoint records it, and how a resume's data differ from it.

Exact resume rebuilds each worker's position from (seed, epoch, rank, worker, segment) and the shard
list: a shard replaced, added or removed between a checkpoint and its resume changes which samples
those positions name, and the run would diverge without a word. The checkpoint therefore keeps the
shard list, each local shard's size and the manifest's sample count and hash; a resume compares them
with what it reads now (`changes`). Sizes of remote shards are not asked for (a request per shard at
every save); their manifest stands for them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ssl_vit.data.urls import local_path


def identity(urls: list[str], manifest: dict | None) -> dict:
    """`{"shards", "sizes", "num_samples", "manifest_sha256"}` of the training stream over `urls`:
    sizes in bytes (None for a remote or missing shard), the manifest's fields None without one."""
    sizes = []
    for url in urls:
        path = local_path(url)
        try:
            sizes.append(os.path.getsize(path) if path is not None else None)
        except OSError:
            sizes.append(None)
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest() if manifest else None
    return {
        "shards": list(urls),
        "sizes": sizes,
        "num_samples": manifest.get("num_samples") if manifest else None,
        "manifest_sha256": digest,
    }


def changes(saved: dict, now: dict) -> list[str]:
    """How the data `now` differ from the checkpoint's `saved` identity, in a few words each (empty
    when they read the same)."""
    found = []
    before, after = saved.get("shards", []), now["shards"]
    gone = [url for url in before if url not in set(after)]
    added = [url for url in after if url not in set(before)]
    if gone:
        found.append(f"{len(gone)} shard(s) no longer given ({_names(gone)})")
    if added:
        found.append(f"{len(added)} shard(s) added ({_names(added)})")
    if not gone and not added and before != after:
        found.append("the shards are given in another order")
    sizes_before = dict(zip(before, saved.get("sizes", [])))
    resized = [
        f"{Path(url).name} {sizes_before[url]} -> {size} bytes"
        for url, size in zip(after, now["sizes"])
        if url in sizes_before and sizes_before[url] is not None and size != sizes_before[url]
    ]
    if resized:
        found.append(f"{len(resized)} shard(s) changed ({_names(resized, paths=False)})")
    if saved.get("num_samples") != now["num_samples"]:
        found.append(
            f"the manifest counts {now['num_samples']} samples, the checkpoint's {saved.get('num_samples')}"
        )
    elif saved.get("manifest_sha256") != now["manifest_sha256"]:
        found.append("the manifest changed")
    return found


def _names(items: list[str], paths: bool = True, most: int = 3) -> str:
    shown = [Path(item).name if paths else item for item in items[:most]]
    return ", ".join(shown) + (f", ... {len(items) - most} more" if len(items) > most else "")
