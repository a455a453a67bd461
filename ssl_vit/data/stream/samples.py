"""Raw samples -> what training uses: the image, opened from its header, judged and decoded (the label
and the segmentation mask are read by `ssl_vit.data.format.members.parse_label` and
`ssl_vit.data.format.masks.read_mask`), and the count of samples that are skipped because they cannot
be used (never fatal, never silent)."""

from __future__ import annotations

import io
import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch
from PIL import Image

from ssl_vit.data.format.arrays import (
    ARRAY_MEMBERS,
    ArrayMember,
    BadArray,
    open_array,
    open_png16,
    png_bit_depth,
)
from ssl_vit.data.format.members import IMAGE_MEMBERS, MAX_IMAGE_PIXELS, RGB, BadSample, Bands, decoding
from ssl_vit.data.stream.device_decode import JpegCrop
from ssl_vit.errors import NoUsableData

log = logging.getLogger("ssl_vit.data")
MAX_SKIPS_IN_A_ROW = 1000
LISTED_IN_A_ROW = 10
T = TypeVar("T")


# PIL modes read as arrays (`channels` other than 3) -> the mode they are read in (None: as they are)
PIL_ARRAY_MODES = {
    "1": "L", "L": "L", "LA": "LA", "P": "RGB", "RGB": "RGB", "RGBA": "RGBA", "CMYK": "RGB", "YCbCr": "RGB",
    "I;16": None, "I;16L": None, "I;16B": None, "F": None,
}  # fmt: skip
PIL_ARRAY_LAYOUT = {
    "L": (1, "uint8"), "LA": (2, "uint8"), "RGB": (3, "uint8"), "RGBA": (4, "uint8"), "I;16": (1, "uint16"),
    "I;16L": (1, "uint16"), "I;16B": (1, "uint16"), "F": (1, "float32"),
}  # fmt: skip


@dataclass
class Opened:
    """A sample's image member, its header read and judged, nothing decoded: `image` is an opened PIL
    image or an `arrays.ArrayMember`; `data` its bytes."""

    ext: str
    data: bytes
    image: Image.Image | ArrayMember

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def open_image(sample: dict, bands: Bands = RGB, max_pixels: int | None = MAX_IMAGE_PIXELS) -> Opened:
    """The sample's first image member, opened from its header: BadSample for one that does not parse,
    one of more than `max_pixels` pixels (None: no limit), and one whose band count or dtype is not
    what `bands` reads (`layout`), all before a pixel is decoded. `npy`, `tif` and `tiff` members and
    16-bit PNGs are arrays (`ssl_vit.data.format.arrays`); the rest PIL images."""
    ext = next((e for e in IMAGE_MEMBERS if e in sample), None)
    if ext is None:
        raise BadSample(f"no image member (one of {', '.join(IMAGE_MEMBERS)}); members: {_members(sample)}")
    data = sample[ext]
    with decoding(ext, BadArray):
        if ext in ARRAY_MEMBERS:
            image = open_array(ext, data, bands.channels)
        else:
            with warnings.catch_warnings():  # PIL's warning on size: `max_pixels` decides here
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                image = Image.open(io.BytesIO(data))
            if image.format == "PNG" and png_bit_depth(data) == 16:
                image = open_png16(data)
    width, height = image.size
    if max_pixels is not None and width * height > max_pixels:
        raise BadSample(
            f"{ext} is {width}x{height} ({width * height:,} pixels), more than max_image_pixels "
            f"{max_pixels:,}: skipped without decoding"
        )
    if max_pixels is not None and isinstance(image, ArrayMember) and image.nbytes > 4 * max_pixels:
        raise BadSample(
            f"{ext} is {image.shape_text()} ({image.nbytes:,} bytes), more than 4 bytes per pixel of "
            f"max_image_pixels {max_pixels:,}: skipped without decoding"
        )
    channels, dtype = layout(image, bands)
    if bands.channels is not None and channels != bands.channels:
        raise BadSample(
            f"{ext} has {channels} band{'s' * (channels != 1)}, the data module reads channels "
            f"{bands.channels}"
        )
    if bands.dtype is not None and dtype != bands.dtype:
        raise BadSample(f"{ext} is {dtype}, its split's manifest says dtype {bands.dtype}")
    return Opened(ext, data, image)


def layout(image: Image.Image | ArrayMember, bands: Bands) -> tuple[int, str]:
    """(channels, dtype) an opened image is read as: with 3 channels, 8-bit images (PIL's, and uint8
    arrays of 1 or 3 bands) are RGB, as they always were (grey expanded); otherwise as stored."""
    if isinstance(image, ArrayMember):
        if bands.channels == 3 and image.dtype == "uint8" and image.bands in (1, 3):
            return 3, "uint8"
        return image.bands, image.dtype
    if bands.channels == 3:
        return 3, "uint8"
    if image.mode not in PIL_ARRAY_MODES:
        raise BadSample(f"a mode {image.mode} image: not read as bands")
    return PIL_ARRAY_LAYOUT[PIL_ARRAY_MODES[image.mode] or image.mode]


def transform_image(
    opened: Opened,
    transform: Callable[[Image.Image], T],
    array_transform: Callable | None = None,
    bands: Bands = RGB,
    mask: np.ndarray | None = None,
    refusal: str = "",
):
    """`transform` applied to an 8-bit image read as RGB, as it always was: an opened (not decoded) PIL
    image, which the transform decodes (so that a crop can choose the JPEG draft scale), or a uint8
    array of 1 or 3 bands made one. Every other image is read into an array and given to
    `array_transform` as a tensor [C, H, W] (`ssl_vit.data.transforms.bands`); without one it is a
    BadSample whose reason is `refusal`. With `mask` (uint8 [H, W] of the image's size): `(image,
    mask)` from the transform's `pair`, which gives the mask the image's crop, flip and resize.
    Anything the image bytes make the decoders raise becomes a BadSample."""
    image = opened.image
    with decoding(opened.ext, BadArray):
        if bands.channels == 3 and not isinstance(image, ArrayMember):
            pil = image
        elif bands.channels == 3 and layout(image, bands) == (3, "uint8"):
            array = image.read()
            pil = Image.fromarray(array[:, :, 0] if image.bands == 1 else array)
        else:
            return _transform_array(pixels(opened, bands), array_transform, mask, refusal)
        out = transform(pil) if mask is None else transform.pair(pil, Image.fromarray(mask))
        crop = out if mask is None else out[0]
        if isinstance(crop, JpegCrop):
            crop.data = opened.data  # decoded later, on the device
        return out


def _transform_array(array: np.ndarray, array_transform, mask: np.ndarray | None, refusal: str):
    if array_transform is None:
        raise BadSample(refusal)
    image = torch.from_numpy(array if array.flags.writeable else array.copy()).permute(2, 0, 1)
    return array_transform(image) if mask is None else array_transform.pair(image, torch.from_numpy(mask))


def pixels(opened: Opened, bands: Bands = RGB) -> np.ndarray:
    """The opened image decoded in full as `bands` reads it: (H, W, C) in its stored dtype (8-bit images
    read as RGB with 3 channels, as `transform_image` gives them to its transform). BadSample for bytes
    that do not decode."""
    image = opened.image
    with decoding(opened.ext, BadArray):
        if isinstance(image, ArrayMember):
            array = image.read()
            grey_as_rgb = image.bands == 1 and layout(image, bands) == (3, "uint8")
            array = np.repeat(array, 3, axis=2) if grey_as_rgb else array
        else:
            mode = "RGB" if bands.channels == 3 else PIL_ARRAY_MODES[image.mode]
            array = np.asarray(image.convert(mode) if mode is not None and image.mode != mode else image)
            array = array[:, :, None] if array.ndim == 2 else array
    if array.dtype.kind == "f" and not np.isfinite(array).all():  # would poison statistics and losses
        raise BadSample(f"{opened.ext} holds NaN or infinite values")
    return array


def _members(sample: dict) -> str:
    return ", ".join(k for k in sample if not k.startswith("__")) or "none"


class SkipCounter:
    """webdataset exception handler that logs and counts instead of raising. Used for every stage of a
    stream, so shard-level errors (unreadable shard, broken tar) are counted like bad samples.

    A training stream that produces nothing but errors would spin forever on resampled shards; with
    `limit`, that many consecutive failures are a UserError instead (one line). Exact passes are finite
    and never raise here (`stream.DryShards` fails one that delivers nothing). Of a run of failures in a
    row, the first LISTED_IN_A_ROW are logged one line each, the rest in one line when the run ends: a
    shard of nothing but bad samples would otherwise print thousands."""

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
