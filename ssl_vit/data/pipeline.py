"""The streaming pipeline: URLs -> webdataset stages -> batches `{"image", "label", "key", "skipped"}`.

Two kinds of stream (DESIGN.md section 4):

- training: shards resampled per rank and worker, a shuffle buffer over raw bytes, a fixed number of
  batches per rank per epoch so every rank steps together;
- exact pass: shards split by rank and worker so every sample is seen exactly once across ranks.

Rank and world size are arguments of `ShardStream`, read by the datamodule in the main process: a
DataLoader worker has no process group, so webdataset's own `split_by_node` would see rank 0 in every
worker of every rank and duplicate the data. Every random choice is seeded from
`(seed, epoch, rank, worker)`, so a stream's position is a function of those and of the batches
consumed (what a checkpoint needs to resume it).

Bad samples (undecodable image, missing image member, unparsable label, unreadable shard) are skipped,
logged with their key and shard, and counted; each batch carries in `skipped` how many its worker
dropped since its previous batch, so the count reaches the main process and can be logged as a metric
(`ssl_vit.data.datamodule.LogSkippedSamples`).
"""

from __future__ import annotations

import io
import json
import logging
import random
import tarfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from itertools import islice
from pathlib import Path
from typing import TypeVar
from urllib.parse import urlparse

import numpy as np
import torch
import webdataset as wds
from PIL import Image
from torch.utils.data import IterableDataset, get_worker_info
from webdataset.gopen import gopen_schemes
from webdataset.shardlists import expand_urls
from webdataset.tariterators import group_by_keys, url_opener
from webdataset.utils import make_seed

from ssl_vit.errors import UserError

log = logging.getLogger("ssl_vit.data")
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "npy")
MAX_SKIPS_IN_A_ROW = 1000
T = TypeVar("T")


# --- URLs ------------------------------------------------------------------------------------------


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
    import re

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


# --- tar members -----------------------------------------------------------------------------------


def tar_samples(handler: Callable[[Exception], bool]) -> list:
    """Stages: shard URLs -> samples `{"__key__", "__url__", ext: bytes ...}`, as webdataset's
    `tarfile_to_samples` (its URL opener and its grouping of members by key), with the tar headers
    parsed by `tar_files` instead of Python's `tarfile`."""
    return [
        partial(url_opener, handler=handler),
        partial(tar_file_members, handler=handler),
        partial(group_by_keys, handler=handler),
    ]


def tar_file_members(sources: Iterable[dict], handler: Callable[[Exception], bool]) -> Iterator[dict]:
    """webdataset's `tar_file_expander`: opened shards -> `{"fname", "data", "__url__"}` per member,
    `{}` at the end of each shard (so that `group_by_keys` never joins samples across shards)."""
    for source in sources:
        stream, url = source["stream"], source["url"]
        try:
            for fname, data in tar_files(stream):
                yield {"fname": fname, "data": data, "__url__": url}
            yield {}
        except Exception as exn:
            exn.args = (*exn.args, url)
            if not handler(exn):
                break
        finally:
            stream.close()


def _octal(field: bytes) -> int:
    if field[0] & 0x80:  # GNU base-256 for values that do not fit in octal
        return int.from_bytes(field[1:], "big")
    return int(field.strip(b"\0 ") or b"0", 8)


def tar_files(stream) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of each regular file of a tar stream (ustar, pax and GNU long names).

    Hand-written rather than `tarfile.open(mode="r|")` as webdataset does: `tarfile` spends about
    0.2 ms per sample (two members, each with a pax header as `webdataset.TarWriter` writes them) in
    Python header parsing, 10-15% of decoding and cropping an ImageNet-sized JPEG, which is what
    `ssl-vit bench data` measures; this reads each header with one slice per field. Like webdataset,
    it skips names whose first component is `__...__` (metadata)."""
    pax: dict[bytes, bytes] = {}
    long_name = None
    while True:
        header = stream.read(512)
        if not header or header == _ZERO_BLOCK:  # end of archive (or of a stream without end blocks)
            return
        if len(header) < 512:
            raise tarfile.ReadError("unexpected end of data in a tar header")
        if _octal(header[148:156]) != sum(header[:148]) + 256 + sum(header[156:]):  # chksum as spaces
            raise tarfile.ReadError("bad tar header checksum")
        kind = header[156:157]
        size = int(pax[b"size"]) if b"size" in pax and kind not in _META_KINDS else _octal(header[124:136])
        data = stream.read(size)
        if len(data) < size:
            raise tarfile.ReadError("unexpected end of data in a tar member")
        stream.read(-size % 512)
        if kind == b"x":  # pax extended header of the next member: "LEN key=value\n" records
            pax = {}
            pos = 0
            while pos < len(data):
                space = data.index(b" ", pos)
                end = pos + int(data[pos:space])
                key, _, value = data[space + 1 : end - 1].partition(b"=")
                pax[key] = value
                pos = end
            continue
        if kind == b"L":  # GNU long name of the next member
            long_name = data.rstrip(b"\0")
            continue
        if kind in (b"0", b"\0", b"7"):  # regular files (7: contiguous, read as regular by tarfile)
            name = header[:100].rstrip(b"\0")
            if header[257:262] == b"ustar" and header[345] != 0:
                name = header[345:500].rstrip(b"\0") + b"/" + name
            name = pax.get(b"path", long_name or name).decode("utf-8", "surrogateescape")
            first = name.split("/", 1)[0]
            if not (first.startswith("__") and first.endswith("__") and len(first) >= 4):
                yield name, data
        pax, long_name = {}, None  # they describe one member only (global pax headers, "g", are ignored)


_ZERO_BLOCK = bytes(512)
_META_KINDS = (b"x", b"g", b"L")


# --- decoding --------------------------------------------------------------------------------------


class BadSample(Exception):
    """A sample that cannot be used; the message names its key, shard and what is wrong."""


def parse_label(sample: dict) -> int:
    """The label from a `cls` member (ASCII integer) or a `json` member (its `label` or `cls` field);
    -1 when there is neither."""
    try:
        if "cls" in sample:
            label = int(sample["cls"].decode("ascii").strip())
        elif "json" in sample:
            meta = json.loads(sample["json"])
            label = meta.get("label", meta.get("cls", -1)) if isinstance(meta, dict) else -1
            label = int(label) if label is not None else -1
        else:
            return -1
    except (ValueError, TypeError, UnicodeDecodeError) as err:
        raise BadSample(f"label does not parse ({err})") from None
    if label < -1:
        raise BadSample(f"label {label} is negative")
    return label


def decode_image(sample: dict, transform: Callable[[Image.Image], T]) -> T:
    """`transform` applied to the sample's first image member, opened but not decoded: the transform
    decodes it (see `ssl_vit.data.transforms.decode`), so that a crop can choose the JPEG draft scale.
    `npy` members are raw uint8 arrays. Anything the image bytes make PIL or numpy raise becomes a
    BadSample."""
    ext = next((e for e in IMAGE_MEMBERS if e in sample), None)
    if ext is None:
        raise BadSample(f"no image member (one of {', '.join(IMAGE_MEMBERS)}); members: {_members(sample)}")
    try:
        if ext == "npy":
            array = np.load(io.BytesIO(sample[ext]), allow_pickle=False)
            if array.dtype != np.uint8 or array.ndim not in (2, 3):
                raise ValueError(f"npy image must be uint8 (H, W[, C]), got {array.dtype} {array.shape}")
            return transform(Image.fromarray(array))
        return transform(Image.open(io.BytesIO(sample[ext])))
    except Exception as err:
        raise BadSample(f"{ext} does not decode ({type(err).__name__}: {err})") from None


def _members(sample: dict) -> str:
    return ", ".join(k for k in sample if not k.startswith("__")) or "none"


class SkipCounter:
    """webdataset exception handler that logs and counts instead of raising. Used for every stage of a
    stream, so shard-level errors (unreadable shard, broken tar) are counted like bad samples.

    A training stream that produces nothing but errors would spin forever on resampled shards; with
    `limit`, that many consecutive failures raise instead. Exact passes are finite and never raise."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.pending = 0  # skipped since the last batch left this worker
        self.in_a_row = 0

    def __call__(self, exn: Exception) -> bool:
        self.pending += 1
        self.in_a_row += 1
        log.warning("skipping bad sample: %s", " ".join(str(a) for a in exn.args if a is not None))
        if self.limit and self.in_a_row >= self.limit:
            raise RuntimeError(
                f"{self.in_a_row} bad samples in a row (last: {exn}): "
                "check the shards with `ssl-vit data inspect`"
            ) from exn
        return True

    def passed(self, samples: Iterable[dict]) -> Iterator[dict]:
        """Stage after decoding: every good sample ends a run of failures."""
        for sample in samples:
            self.in_a_row = 0
            yield sample

    def take(self) -> int:
        n, self.pending = self.pending, 0
        return n


# --- the stream ------------------------------------------------------------------------------------


class ShardStream(IterableDataset):
    """One rank's stream of batches over `urls`; a training stream when `batches_per_epoch` is set,
    otherwise an exact pass. Load it with `DataLoader(stream, batch_size=None, num_workers=...)`.

    The webdataset pipeline is built inside each worker (in `__iter__`), where the worker id is known;
    `epoch` is set from the main process before each pass (see `EpochLoader`).
    """

    def __init__(
        self,
        urls: list[str],
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        transform: Callable[[Image.Image], torch.Tensor],
        classes: Sequence[int] | None = None,
        seed: int = 0,
        batches_per_epoch: int | None = None,
        shuffle_buffer: int = 1000,
    ):
        super().__init__()
        self.urls = list(urls)
        self.rank, self.world_size = rank, world_size
        self.batch_size = batch_size
        self.transform = transform
        self.classes = frozenset(classes) if classes is not None else None
        self.seed = seed
        self.batches_per_epoch = batches_per_epoch
        self.shuffle_buffer = shuffle_buffer
        self.epoch = 0

    def __len__(self) -> int:
        if self.batches_per_epoch is None:
            raise TypeError("an exact pass has no length known in advance")
        return self.batches_per_epoch

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info else (0, 1)
        seed = make_seed(self.seed, self.epoch, self.rank, worker)
        if info is not None:
            # Augmentations (torchvision, timm) draw from the global RNGs; in a worker process those are
            # ours to seed, which makes a training stream a function of (seed, epoch, rank, worker).
            torch.manual_seed(seed)
            random.seed(seed)
            np.random.seed(seed)
        counter = SkipCounter(limit=MAX_SKIPS_IN_A_ROW if self.batches_per_epoch else None)
        stages = (
            self._training_stages(seed, worker, num_workers, counter)
            if self.batches_per_epoch
            else self._exact_stages(counter)
        )
        for batch in wds.DataPipeline(*stages):
            batch["skipped"] = torch.tensor(counter.take())
            yield batch
        if counter.pending:
            log.warning(
                "%d bad samples at the end of a stream with no batch left to report them", counter.pending
            )

    def _training_stages(self, seed: int, worker: int, num_workers: int, counter: SkipCounter) -> list:
        # This worker's share of the rank's batches; the DataLoader interleaves workers and moves on when
        # one is done, so the rank yields exactly batches_per_epoch.
        n = self.batches_per_epoch
        share = n // num_workers + (worker < n % num_workers)
        return [
            # an endless, seeded draw of shards, different for every (epoch, rank, worker)
            wds.ResampledShards(self.urls, seed=seed, worker_seed=lambda: 0, deterministic=True),
            *tar_samples(counter),
            # shuffle raw bytes before decoding: cheap to buffer, and decoding is the expensive part
            wds.shuffle(self.shuffle_buffer, initial=min(self.shuffle_buffer, 100), seed=seed),
            wds.map(self.decode, handler=counter),
            counter.passed,
            wds.batched(self.batch_size, collation_fn=self.collate, partial=False),
            lambda batches: islice(batches, share),
        ]

    def _exact_stages(self, counter: SkipCounter) -> list:
        return [
            wds.SimpleShardList(self.urls),
            lambda shards: islice(shards, self.rank, None, self.world_size),  # rank from the main process
            wds.split_by_worker,
            *tar_samples(counter),
            wds.map(self.decode, handler=counter),
            counter.passed,
            wds.batched(self.batch_size, collation_fn=self.collate, partial=True),
        ]

    def collate(self, samples: list[dict]) -> dict:
        """Samples -> batch: `image` [B,3,H,W] uint8, `label` [B] int64, `key` list[str]. The datamodule
        turns `image` into normalised floats on the device (`ShardDataModule.prepare_batch`)."""
        images = [s["image"] for s in samples]
        # The transforms give channel-first views of HWC pixels (`transforms.to_uint8_tensor`): stack
        # the HWC memory (one plain copy per image) rather than transpose every image into CHW; the
        # batch is then a channels-last [B,3,H,W] view, made contiguous by `normalize` on the device.
        hwc = all(i.dim() == 3 and i.permute(1, 2, 0).is_contiguous() for i in images)
        if hwc:
            images = [i.permute(1, 2, 0) for i in images]
        out = None
        if get_worker_info() is not None:
            # as torch's default_collate: stack straight into shared memory, so handing the batch to
            # the main process costs no extra copy
            storage = images[0]._typed_storage()._new_shared(len(images) * images[0].numel())
            out = images[0].new(storage).resize_(len(images), *images[0].shape)
        stacked = torch.stack(images, out=out)
        return {
            "image": stacked.permute(0, 3, 1, 2) if hwc else stacked,
            "label": torch.tensor([s["label"] for s in samples], dtype=torch.int64),
            "key": [s["__key__"] for s in samples],
        }

    def decode(self, sample: dict) -> dict | None:
        """Raw sample -> `{"__key__", "image", "label"}`; None (dropped, not an error) when the class
        filter rejects its label. Raises BadSample for anything unusable."""
        try:
            label = parse_label(sample)
            if self.classes is not None and label not in self.classes:
                return None
            image = decode_image(sample, self.transform)
        except BadSample as err:
            raise BadSample(f"{sample.get('__key__')} in {sample.get('__url__')}: {err}") from None
        return {"image": image, "label": label}


def iter_samples(urls: Iterable[str], handler: Callable[[Exception], bool]) -> Iterator[dict]:
    """Raw samples of `urls` in order, one process (for `inspect`)."""
    return iter(wds.DataPipeline(wds.SimpleShardList(list(urls)), *tar_samples(handler)))
