"""Raw samples -> what training uses: the label, the image, its segmentation mask (`seg.png`, see
`ssl_vit.data.masks`), and the count of samples that are skipped because they cannot be used (never
fatal, never silent)."""

from __future__ import annotations

import io
import json
import logging
import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import numpy as np
from PIL import Image

from ssl_vit.data.device_decode import JpegCrop
from ssl_vit.data.masks import MASK_MEMBER, beyond_message, classes_beyond, decode_mask, size_mismatch
from ssl_vit.data.tar_reader import IMAGE_MEMBERS
from ssl_vit.errors import NoUsableData, UserError, shown

log = logging.getLogger("ssl_vit.data")
MAX_SKIPS_IN_A_ROW = 1000
# Bad samples in a row listed one line each; the rest of the run is counted, and said in one line: a
# shard of nothing but bad samples would otherwise print thousands.
LISTED_IN_A_ROW = 10
T = TypeVar("T")


class BadSample(Exception):
    """A sample that cannot be used; the message names its key, shard and what is wrong."""


# The most classes a label may index where no class count is known (`data inspect` and `data convert
# wds:` of shards without a manifest): ImageNet-21k has 21,841, the largest face-identity sets about
# 10^5. A label beyond it is a corrupt sample, not a class (`wds:` would name every class up to it).
MAX_CLASSES = 1_000_000
# A `json` member is a sample's metadata (a label, a caption, EXIF; SA-1B's mask annotations, a few
# MB): one larger than this is skipped before parsing, since Python's objects for a JSON array take up
# to 16x its bytes.
MAX_JSON_BYTES = 16 << 20
_INTEGER = re.compile(r"\s*([+-]?[0-9]+)\s*", re.ASCII)


def parse_label(sample: dict, num_classes: int | None = None) -> int:
    """The label from a `cls` member (ASCII integer) or a `json` member (its `label` or `cls` field:
    an integer or a string of one); -1 when there is neither, or the field is absent or null.

    Every reader of labels (the training stream, `data inspect`, `data convert wds:` and `mosaic:`)
    calls this one function. A label is -1 (unlabelled) or a class index below `num_classes` (None:
    below MAX_CLASSES); anything else is a BadSample saying why: a `json` member that does not parse
    (too large, not UTF-8, not JSON, nested too deeply), a label that is not an integer (`true`, `3.9`,
    `1e400`, NaN, an object) or out of range."""
    if "cls" in sample:
        label = _integer(_text(sample["cls"], "cls"), "cls")
    elif "json" in sample:
        meta = read_json(sample["json"])
        field = next((f for f in ("label", "cls") if isinstance(meta, dict) and f in meta), None)
        label = -1 if field is None or meta[field] is None else _integer(meta[field], f"json {field}")
    else:
        return -1
    if label < -1:
        raise BadSample(f"label {shown(label)} is negative")
    if num_classes is not None and label >= num_classes:
        raise BadSample(f"label {shown(label)} is beyond num_classes {num_classes}")
    if label >= MAX_CLASSES:
        raise BadSample(f"label {shown(label)} is beyond {MAX_CLASSES:,}, the most classes ssl-vit reads")
    return label


def read_json(data: bytes) -> object:
    """A sample's `json` member parsed; BadSample when it cannot be, for any reason."""
    if len(data) > MAX_JSON_BYTES:
        raise BadSample(f"json member of {len(data):,} bytes, more than {MAX_JSON_BYTES:,}: not parsed")
    try:
        return json.loads(data)
    except ValueError as err:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8/16/32
        raise BadSample(f"json does not parse ({str(err)[:80]})") from None
    except RecursionError:
        # CPython's JSON scanner (C or Python) counts every nested array or object against the
        # interpreter's recursion limit and raises RecursionError there: 200 KB of `[` cannot overflow the
        # C stack, and fail only the sample. Nesting that deep is no metadata.
        raise BadSample("json nests arrays or objects too deeply to parse") from None


def _text(data: bytes, member: str) -> str:
    try:
        return data.decode("ascii")
    except UnicodeDecodeError:
        raise BadSample(f"label does not parse: {member} {shown(data)} is not ASCII") from None


def _integer(value: object, where: str) -> int:
    """`value` as a label: an int (not a bool), or a string of decimal digits."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    match = _INTEGER.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise BadSample(f"label does not parse: {where} is {shown(value)}, not an integer or a string of one")
    if len(match[1]) > 20:  # int() of thousands of digits is slow, and refused past 4,300
        raise BadSample(f"label does not parse: {where} has {len(match[1]):,} digits, no class index has")
    return int(match[1])


def read_mask(sample: dict, num_classes: int | None, required: bool) -> np.ndarray | None:
    """The sample's `seg.png` as uint8 [H, W] class indices, or None when it has none and none is
    `required` (its split's manifest says `"masks": true`). BadSample for a missing required mask, one
    that does not decode or is not single-channel 8-bit, and one holding a class of `num_classes` or
    more other than 255 (ignored)."""
    data = sample.get(MASK_MEMBER)
    if data is None:
        if required:
            raise BadSample(f"no {MASK_MEMBER} member, and its split's manifest says every sample has a mask")
        return None
    try:
        mask = decode_mask(data)
    except Exception as err:
        raise BadSample(f"{MASK_MEMBER} does not decode ({type(err).__name__}: {err})") from None
    if num_classes is not None and len(beyond := classes_beyond(mask, num_classes)):
        raise BadSample(f"{MASK_MEMBER} {beyond_message(beyond, num_classes)}")
    return mask


def check_mask_size(image_size: tuple[int, int], mask: np.ndarray) -> None:
    """BadSample when the mask [H, W] does not cover an image of PIL size (W, H) pixel for pixel."""
    if wrong := size_mismatch(image_size, mask):
        raise BadSample(f"{MASK_MEMBER} {wrong}")


# PIL's own limit (`Image.MAX_IMAGE_PIXELS`, 1024^3 / 4 / 3): beyond it PIL warns and decodes, and
# refuses only at twice as many. `max_image_pixels` of the data module skips an image above its limit from
# the header, before any pixel is decoded: one 144 Mpx image would otherwise take 0.5 GB in a worker.
MAX_IMAGE_PIXELS = 89_478_485


def decode_image(
    sample: dict,
    transform: Callable[[Image.Image], T],
    mask: np.ndarray | None = None,
    max_pixels: int | None = MAX_IMAGE_PIXELS,
):
    """`transform` applied to the sample's first image member, opened but not decoded: the transform
    decodes it (see `ssl_vit.data.transforms.decode`), so that a crop can choose the JPEG draft scale.
    `npy` members are raw uint8 arrays. Anything the image bytes make PIL or numpy raise becomes a
    BadSample.

    With `mask` (uint8 [H, W], `read_mask`): `(image, mask)` from `transform.pair`, which gives the mask
    the image's crop, flip and resize; a mask whose size is not the image's is a BadSample. An image of
    more than `max_pixels` pixels (None: no limit) is a BadSample, read from its header only."""
    ext = next((e for e in IMAGE_MEMBERS if e in sample), None)
    if ext is None:
        raise BadSample(f"no image member (one of {', '.join(IMAGE_MEMBERS)}); members: {_members(sample)}")
    try:
        if ext == "npy":
            array = np.load(io.BytesIO(sample[ext]), allow_pickle=False)
            if array.dtype != np.uint8 or array.ndim not in (2, 3):
                raise ValueError(f"npy image must be uint8 (H, W[, C]), got {array.dtype} {array.shape}")
            img = Image.fromarray(array)
        else:
            with warnings.catch_warnings():  # PIL's warning on size: `max_pixels` decides here
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(sample[ext]))
        if max_pixels is not None and img.width * img.height > max_pixels:
            raise BadSample(
                f"{ext} is {img.width}x{img.height} ({img.width * img.height:,} pixels), more than "
                f"max_image_pixels {max_pixels:,}: skipped without decoding"
            )
        if mask is None:
            out = transform(img)
        else:
            check_mask_size(img.size, mask)
            out, mask_out = transform.pair(img, Image.fromarray(mask))
        if isinstance(out, JpegCrop):
            out.data = sample[ext]  # decoded later, on the device
        return out if mask is None else (out, mask_out)
    except (BadSample, UserError):
        raise
    except Exception as err:
        raise BadSample(f"{ext} does not decode ({type(err).__name__}: {err})") from None


def _members(sample: dict) -> str:
    return ", ".join(k for k in sample if not k.startswith("__")) or "none"


class SkipCounter:
    """webdataset exception handler that logs and counts instead of raising. Used for every stage of a
    stream, so shard-level errors (unreadable shard, broken tar) are counted like bad samples.

    A training stream that produces nothing but errors would spin forever on resampled shards; with
    `limit`, that many consecutive failures are a UserError instead (one line). Exact passes are finite
    and never raise here (`stream.DryShards` fails one that delivers nothing). Of a run of failures in a
    row, the first LISTED_IN_A_ROW are logged one line each, the rest in one line when the run ends."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.pending = 0  # skipped since the last batch left this worker
        self.unreadable: set[str] = set()  # shards that could not be opened, since the last batch
        self.in_a_row = 0

    def __call__(self, exn: Exception) -> bool:
        self.pending += 1
        self.in_a_row += 1
        if self.in_a_row <= LISTED_IN_A_ROW:
            log.warning("skipping bad sample: %s", " ".join(str(a) for a in exn.args if a is not None))
        if self.limit and self.in_a_row >= self.limit:
            raise NoUsableData(
                f"{self.in_a_row} bad samples in a row and none usable (last: {exn}): the training shards "
                "hold no usable sample, or too few; check them with `ssl-vit data inspect`"
            )
        return True

    def shard_failed(self, exn: Exception) -> bool:
        """The handler of the shard opener: a shard that could not be opened (after its retries), named
        in the next batch's `unreadable` besides being counted."""
        url = exn.args[-1] if exn.args else None
        if isinstance(url, str):
            self.unreadable.add(url)
        return self(exn)

    def take_unreadable(self) -> list[str]:
        found, self.unreadable = sorted(self.unreadable), set()
        return found

    def passed(self, samples: Iterable[dict]) -> Iterator[dict]:
        """Stage after decoding: every good sample ends a run of failures."""
        for sample in samples:
            self.end_run()
            yield sample

    def end_run(self) -> None:
        """A run of failures in a row has ended (a good sample, or the end of the stream)."""
        if self.in_a_row > LISTED_IN_A_ROW:
            log.warning(
                "skipped %d bad samples in a row, %d of them not listed above",
                self.in_a_row, self.in_a_row - LISTED_IN_A_ROW,
            )  # fmt: skip
        self.in_a_row = 0

    def take(self) -> int:
        n, self.pending = self.pending, 0
        return n
