"""Raw samples -> what training uses: the label, the image, its segmentation mask (`seg.png`, see
`ssl_vit.data.masks`), and the count of samples that are skipped because they cannot be used (never
fatal, never silent)."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import numpy as np
from PIL import Image

from ssl_vit.data.device_decode import JpegCrop
from ssl_vit.data.masks import MASK_MEMBER, beyond_message, classes_beyond, decode_mask, size_mismatch
from ssl_vit.data.tar_reader import IMAGE_MEMBERS
from ssl_vit.errors import UserError

log = logging.getLogger("ssl_vit.data")
MAX_SKIPS_IN_A_ROW = 1000
T = TypeVar("T")


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
    `limit`, that many consecutive failures raise instead. Exact passes are finite and never raise."""

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.pending = 0  # skipped since the last batch left this worker
        self.unreadable: set[str] = set()  # shards that could not be opened, since the last batch
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
            self.in_a_row = 0
            yield sample

    def take(self) -> int:
        n, self.pending = self.pending, 0
        return n
