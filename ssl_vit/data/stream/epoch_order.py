"""The training stream's order: every sample of the epoch once, in a uniform random order of the whole
epoch that depends on the seed, the epoch and the data only, read back sample by sample from local
shards. So a batch is as mixed as a uniform shuffle whatever order the shards were written in (class by
class, sorted files, one class per shard), and a run resumes exactly on any number of ranks and workers.

`SampleIndex` (`build_index`, once in each rank's main process, after the class and key filters, which
read only the `cls`/`json` members), `EpochOrder` (the epoch's permutation of it) and `SampleReader` (a
worker's reads of single samples).

Position `g` of the epoch is where the stream's slots meet it: data step `t` (one batch on every rank)
holds positions `[t*B*W, (t+1)*B*W)`, rank `r` the `B` of them from `t*B*W + r*B`, and a rank's
DataLoader worker `w` (of `N`) the data steps `t = w, w + N, ...` of its pass. A sample is augmented
from the seed of its position, so nothing depends on how many slots there are.

Why not webdataset: its shuffle is a buffer over each worker's stream of shards read one after
another, which cannot mix a worker's batch beyond the few shards it reads at a time (a batch of
class-sorted shards then holds a handful of classes), and whose order depends on the workers. Random
access needs the byte ranges of samples, which webdataset's readers do not give; `wids`, its indexed
reader, keeps shards whole in a cache and indexes them by reading every byte.

Memory per worker: the index (two int64 per kept sample), the epoch's permutation (one int64 per
sample), and one batch of raw samples in flight; no shuffle buffer.
"""

from __future__ import annotations

import io
import logging
import tarfile
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
from webdataset.tariterators import group_by_keys

from ssl_vit.data.format.members import MAX_JSON_BYTES, BadSample, parse_label
from ssl_vit.data.stream.tar_reader import DroppedMember, UnkeyedMember, sample_spans, tar_files
from ssl_vit.storage.remote import local_path

log = logging.getLogger("ssl_vit.data")

_GZIP = b"\x1f\x8b"
_OPEN_SHARDS = 64  # files a worker keeps open (least recently read closed first)
_END = bytes(1024)  # the end blocks a sample's bytes, read alone, are given


def indexable(urls: Sequence[str]) -> bool:
    """Whether every shard of `urls` is a local, uncompressed file, which `SampleIndex` can index and
    `SampleReader` read at random. Remote and gzip-compressed shards are read as streams instead
    (`ssl_vit.data.stream.pipeline`: segments of shards and a shuffle buffer)."""
    for url in urls:
        path = local_path(url)
        if path is None or not path.is_file():
            return False
        with open(path, "rb") as f:
            if f.read(2) == _GZIP:
                return False
    return True


@dataclass(frozen=True)
class SampleIndex:
    """The kept samples of each shard: `starts[i]`, `ends[i]` their byte ranges in `urls[i]`."""

    urls: tuple[str, ...]
    starts: tuple[np.ndarray, ...]
    ends: tuple[np.ndarray, ...]

    @property
    def total(self) -> int:
        return int(sum(len(s) for s in self.starts))

    def counts(self) -> np.ndarray:
        return np.array([len(s) for s in self.starts], dtype=np.int64)


def build_index(
    urls: Sequence[str],
    *,
    classes: Collection[int] | None = None,
    keys: Collection[str] | None = None,
    num_classes: int | None = None,
    require_labels: bool = False,
) -> SampleIndex:
    """The index of `urls` (local uncompressed tars), keeping the samples whose label is in `classes`
    and key in `keys` (None: all). A sample whose label does not parse, or that has none where
    `require_labels`, is kept: the stream skips and counts it where it comes. A shard that breaks off
    keeps the samples before the damage, said in one warning line."""
    starts, ends = [], []
    wanted = frozenset(classes) | {None, *([-1] if require_labels else [])} if classes is not None else None
    for url in urls:
        spans = []
        path = local_path(url)
        try:
            with open(path, "rb") as f:
                for key, start, end, labels in sample_spans(f, path.stat().st_size, MAX_JSON_BYTES):
                    if keys is not None and key not in keys:
                        continue
                    if wanted is not None and _label(labels, num_classes) not in wanted:
                        continue
                    spans.append((start, end))
        except UnkeyedMember as err:  # after every sample: said, nothing else lost
            log.warning("shard %s: %s", url, err.args[0])
        except (OSError, tarfile.ReadError) as err:
            log.warning(
                "skipping the rest of shard %s (%s): its %d samples before that are read",
                url,
                err,
                len(spans),
            )
        array = np.array(spans, dtype=np.int64).reshape(-1, 2)
        starts.append(array[:, 0].copy())
        ends.append(array[:, 1].copy())
    return SampleIndex(tuple(urls), tuple(starts), tuple(ends))


def _label(labels: dict[str, bytes], num_classes: int | None) -> int | None:
    """The label of a sample's label members; None where it does not parse (kept, and counted later)."""
    try:
        return parse_label(labels, num_classes)
    except BadSample:
        return None


class EpochOrder:
    """Position `g` of epoch `epoch` -> `(shard, sample)` of the index: a uniform permutation of all its
    samples, seeded by `(seed, epoch)`; positions past the epoch's samples go on into further
    permutations (`cycle`), for an epoch longer than the data (`train_batches`)."""

    def __init__(self, index: SampleIndex, seed: int, epoch: int) -> None:
        self.seed, self.epoch, self.total = seed, epoch, index.total
        self.bounds = np.cumsum(index.counts())
        self._cycle: tuple[int, np.ndarray] | None = None

    def locate(self, g: int) -> tuple[int, int]:
        cycle, place = divmod(g, self.total)
        if self._cycle is None or self._cycle[0] != cycle:
            rng = np.random.default_rng([self.seed, self.epoch, cycle, 0x5EED])
            self._cycle = (cycle, rng.permutation(self.total))
        flat = int(self._cycle[1][place])
        shard = int(np.searchsorted(self.bounds, flat, side="right"))
        return shard, flat - (int(self.bounds[shard - 1]) if shard else 0)


class UnreadableShard(BadSample):
    """A shard that can no longer be opened; its URL is the last of `args`, as the stream's
    `SkipCounter.shard_failed` reads it for the batch's `unreadable`."""


class SampleReader:
    """A worker's reads of single samples: the shards it has open (a bounded number), one seek and one
    read per sample, the bytes parsed by the same tar reader as a streamed shard (`tar_files`), with
    members over `max_member_bytes` passed over and the sample counted as bad."""

    def __init__(self, index: SampleIndex, max_member_bytes: int | None) -> None:
        self.index, self.max_member_bytes = index, max_member_bytes
        self.files: OrderedDict[int, io.BufferedReader] = OrderedDict()

    def read(self, shard: int, sample: int) -> dict:
        """`{"__key__", "__url__", ext: bytes}` of the index's `sample` of `shard`; BadSample when it
        cannot be read back."""
        url = self.index.urls[shard]
        start, end = int(self.index.starts[shard][sample]), int(self.index.ends[shard][sample])
        try:
            f = self._open(shard)
        except OSError as err:  # gone or unreadable since it was indexed: named once, each sample counted
            raise UnreadableShard(f"{url}: {err.strerror or err}", url) from None
        try:
            f.seek(start)
            data = f.read(end - start)
        except OSError as err:
            raise BadSample(f"{url}: {err}") from None
        return self._parse(data, url)

    def _parse(self, data: bytes, url: str) -> dict:
        dropped: list[DroppedMember] = []
        try:
            members = tar_files(io.BytesIO(data + _END), dropped.append, self.max_member_bytes)
            samples = list(group_by_keys({"fname": n, "data": d, "__url__": url} for n, d in members))
        except (tarfile.ReadError, ValueError) as err:
            raise BadSample(f"{url}: {err} (the shard changed since it was indexed?)") from None
        if dropped:
            raise BadSample(f"{dropped[0]} in {url}")
        if len(samples) != 1:
            raise BadSample(f"{url}: the bytes of one sample hold {len(samples)} (the shard changed?)")
        return samples[0]

    def _open(self, shard: int) -> io.BufferedReader:
        if shard in self.files:
            self.files.move_to_end(shard)
            return self.files[shard]
        if len(self.files) >= _OPEN_SHARDS:
            self.files.popitem(last=False)[1].close()
        self.files[shard] = open(local_path(self.index.urls[shard]), "rb")  # noqa: SIM115 (kept open)
        return self.files[shard]

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files.clear()
