"""What a training stream reads, as a checkpoint records it, and how a resume's data differ from it.

Exact resume rebuilds each worker's position from (seed, epoch, rank, worker, segment) and the shard
list: a shard replaced, added, removed or rewritten between a checkpoint and its resume changes which
samples those positions name, and the run would diverge without a word. The checkpoint therefore keeps
what `identity` lists, and a resume compares it with what it reads now (`changes`).

The fingerprint hashes the shard's first and last 64 KiB (`fingerprint`): samples reordered, replaced
or re-encoded at the same size change the tar headers and data there. A change in the middle alone
shows in the modification time. Reading all of every shard at every save
would read the whole data set; these 128 KiB are read once per shard and process (`_fingerprints`,
kept while the file's size and times stay the same). Sizes of remote shards are not asked
for (a request per shard at every save); their manifest stands for them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from ssl_vit.errors import UserError
from ssl_vit.storage.remote import local_path

log = logging.getLogger("ssl_vit.data")

EDGE = 64 << 10  # bytes hashed at each end of a shard
# (path, device, inode, size, mtime_ns, ctime_ns) -> fingerprint, of the shards this process has read: a
# write changes the ctime, which (unlike the mtime) cannot be set back
_fingerprints: dict[tuple, str] = {}


def identity(urls: list[str], manifest: dict | None) -> dict:
    """`{"shards", "sizes", "mtimes", "fingerprints", "num_samples", "manifest_sha256"}` of the training
    stream over `urls`: sizes in bytes, modification times in ns and content fingerprints (`fingerprint`)
    of local shards, None for a remote or missing one; the manifest's fields None without one."""
    found = [_local_identity(url) for url in urls]
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest() if manifest else None
    return {
        "shards": list(urls),
        "sizes": [size for size, _, _ in found],
        "mtimes": [mtime for _, mtime, _ in found],
        "fingerprints": [fingerprint for _, _, fingerprint in found],
        "num_samples": manifest.get("num_samples") if manifest else None,
        "manifest_sha256": digest,
    }


def _local_identity(url: str) -> tuple[int | None, int | None, str | None]:
    """(size, mtime_ns, fingerprint) of a local shard; Nones for a remote or missing one."""
    path = local_path(url)
    try:
        if path is None:
            return None, None, None
        st = os.stat(path)
        key = (str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key not in _fingerprints:
            _fingerprints[key] = fingerprint(path, st.st_size)
        return st.st_size, st.st_mtime_ns, _fingerprints[key]
    except OSError:
        return None, None, None


def fingerprint(path: str | os.PathLike, size: int) -> str:
    """SHA-256 (its first 16 hex digits) of the first and last `EDGE` bytes of the file at `path` of
    `size` bytes: the whole file when it is at most 2 x EDGE."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(EDGE))
        if size > EDGE:
            f.seek(max(size - EDGE, EDGE))
            digest.update(f.read(EDGE))
    return digest.hexdigest()[:16]


def changes(saved: dict, now: dict) -> list[str]:
    """How the data `now` differ from the checkpoint's `saved` identity, in a few words each (empty
    when they read the same). A checkpoint from before a field was recorded is not compared by it."""
    return [*_list_changes(saved, now), *_shard_changes(saved, now), *_manifest_changes(saved, now)]


def check_same_data(saved: dict, now: dict, on_data_change: str, say: bool = True) -> None:
    """One line when the training data `now` differ from the checkpoint's `saved` identity: a warning
    (when `say`: rank 0 says it for all), or with `on_data_change` "refuse" the error that stops the
    resume."""
    found = changes(saved, now)
    if not found:
        return
    text = (
        f"the training data differ from the checkpoint's ({'; '.join(found)}), so this resume is not "
        "exact: the epoch's remaining samples are drawn from the data as they are now"
    )
    if on_data_change == "refuse":
        raise UserError(
            f"{text}: give the shards the run was trained on, or resume anyway with "
            "--data.init_args.stream.on_data_change warn"
        )
    if say:
        log.warning("%s (--data.init_args.stream.on_data_change refuse stops instead)", text)


def _list_changes(saved: dict, now: dict) -> list[str]:
    """Shards no longer given, added, or given in another order."""
    before, after = saved.get("shards", []), now["shards"]
    gone = [url for url in before if url not in set(after)]
    added = [url for url in after if url not in set(before)]
    found = []
    if gone:
        found.append(f"{len(gone)} shard(s) no longer given ({_names(gone)})")
    if added:
        found.append(f"{len(added)} shard(s) added ({_names(added)})")
    if not gone and not added and before != after:
        found.append("the shards are given in another order")
    return found


def _shard_changes(saved: dict, now: dict) -> list[str]:
    """Local shards given then and now whose size, contents (`fingerprint`) or modification time
    differ; a shard remote or missing then or now is left to the manifest."""
    then = {
        field: dict(zip(saved.get("shards", []), saved.get(field) or []))
        for field in ("sizes", "mtimes", "fingerprints")
    }
    resized, rewritten, modified = [], [], []
    for url, size, mtime, content in zip(now["shards"], now["sizes"], now["mtimes"], now["fingerprints"]):
        old = then["sizes"].get(url)
        if old is None or size is None:
            continue
        if size != old:
            resized.append(f"{Path(url).name} {old} -> {size} bytes")
        elif then["fingerprints"].get(url) not in (None, content):
            rewritten.append(url)
        elif then["mtimes"].get(url) not in (None, mtime):
            modified.append(url)
    found = []
    if resized:
        found.append(f"{len(resized)} shard(s) changed ({_names(resized, paths=False)})")
    if rewritten:
        found.append(
            f"{len(rewritten)} shard(s) rewritten with other contents of the same size ({_names(rewritten)})"
        )
    if modified:
        found.append(
            f"{len(modified)} shard(s) modified since, with the same size and first and last 64 KiB "
            f"({_names(modified)}; a copy that keeps modification times, cp -p or rsync -a, is no change)"
        )
    return found


def _manifest_changes(saved: dict, now: dict) -> list[str]:
    counted, then = now["num_samples"], saved.get("num_samples")
    if then != counted:
        return [f"the manifest counts {counted} samples, the checkpoint's {then}"]
    if saved.get("manifest_sha256") != now["manifest_sha256"]:
        return ["the manifest changed"]
    return []


def _names(items: list[str], paths: bool = True, most: int = 3) -> str:
    shown = [Path(item).name if paths else item for item in items[:most]]
    return ", ".join(shown) + (f", ... {len(items) - most} more" if len(items) > most else "")
