"""The members of a sample in a shard and the limits every reader judges them by: which members hold
its image (`IMAGE_MEMBERS`, in the order they are looked for) and its label (`LABEL_MEMBERS`), how a
label is read (`parse_label`, `read_json`) and what makes a sample unusable (`BadSample`), the largest
class index, `json` member and image (`MAX_CLASSES`, `MAX_JSON_BYTES`, `MAX_IMAGE_PIXELS`,
`max_member_bytes`), and the bands a data module reads (`Bands`). Light to import (no torch): the
manifest, `data inspect`, the sources of `data convert` and the evaluation's checks read them too."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ssl_vit.errors import UserError, first_line, shown

# The members a sample's image may be, in the order `samples.open_image` looks for them, and those
# `parse_label` reads its label from.
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "npy", "tif", "tiff")
LABEL_MEMBERS = ("cls", "json")
# The image members `data convert wds:` keeps (their bytes copied as they are).
CONVERTIBLE_IMAGES = ("jpg", "jpeg", "png", "webp")


class BadSample(Exception):
    """A sample that cannot be used; the message names its key, shard and what is wrong."""


@contextmanager
def decoding(member: str, told: type[Exception]) -> Iterator[None]:
    """Anything the bytes of `member` (`jpg`, `seg.png`) make the parsers and decoders raise, as a
    BadSample naming the member: a `told` error's message as it is (it says what is wrong), any other's
    first line as why it does not decode. BadSample and UserError pass as they are."""
    try:
        yield
    except (BadSample, UserError):
        raise
    except told as err:
        raise BadSample(f"{member} {err}") from None
    except Exception as err:
        raise BadSample(f"{member} does not decode ({first_line(err)})") from None


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


# PIL's own limit (`Image.MAX_IMAGE_PIXELS`, 1024^3 / 4 / 3): beyond it PIL warns and decodes, and
# refuses only at twice as many. `max_image_pixels` of the data module skips an image above its limit from
# the header, before any pixel is decoded: one 144 Mpx image would otherwise take 0.5 GB in a worker.
# An array is also held to 4 bytes per pixel of that limit (an 8-bit RGBA image at the limit), however
# its bytes are spread over bands.
MAX_IMAGE_PIXELS = 89_478_485


def max_member_bytes(max_pixels: int | None) -> int | None:
    """The largest tar member a sample within `max_pixels` can need (None: no limit), which the tar
    reader judges from each member's header and reads past, unheld, when exceeded: an array is held to 4
    bytes per pixel of the limit, an 8-bit image file takes at most as many (an RGBA PNG of
    incompressible pixels adds a filter byte per row and deflate's block headers, under 1%), and a
    label, a mask or a json member far less. Without it a 400 MB member of a 389 KB `.tar.gz` is
    read into memory before its header says it is too large."""
    return None if max_pixels is None else math.ceil(4 * max_pixels * 1.01) + (1 << 20)


@dataclass(frozen=True)
class Bands:
    """The images a data module reads: `channels` bands (None: as stored, for `ssl-vit data inspect`),
    of `dtype` where its split's manifest records one (None: any of `arrays.ARRAY_DTYPES`, each in its
    own model units)."""

    channels: int | None = 3
    dtype: str | None = None


RGB = Bands()
