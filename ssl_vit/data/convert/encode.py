"""One source record -> the image bytes a shard stores (run in `ssl-vit data convert`'s worker processes).

An image file (a path, or bytes read from a shard) already in the output format, grey or RGB, and with
its longer side within `--max-side` is stored as it is, byte for byte: ImageNet-style JPEGs are not
re-encoded lossily, and a re-shard (`wds:`) does not re-encode them. Such a file is still decoded
once, in full (its statistics need every pixel), so a truncated file is skipped and counted here
rather than failing a training run later. Everything
else is converted to grey (L) or RGB, shrunk to `--max-side` if larger (PIL's `Image.thumbnail`: aspect
kept, JPEGs decoded at a reduced DCT scale first, then a bicubic resample; never enlarged) and encoded
as PNG or as JPEG at `--quality`.

A record's mask (`payload`; a mosaic's `Tiles` compose theirs with their image) is checked to cover the
image pixel for pixel and to hold only classes below the source's count or 255 (else the record is
skipped and counted, as an unreadable image is), shrunk with NEAREST to the stored image's size when
`--max-side` shrank it, and stored as a mode-L PNG (the sample's `seg.png`), with its pixel count per
class for the manifest.

Every record also gives the statistics of its image's bands as stored (`band_stats.BandStats`: a kept
file decoded in full, a JPEG written here decoded from the bytes written), which the writer merges
into the manifest's `band_stats`: exact over every image written, at the cost of one decode of each
image that was not decoded in full anyway.
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ssl_vit.data.convert.payload import Encoded, EncodeOptions, MaskFile, Payload, Skip
from ssl_vit.data.format.band_stats import BandStats
from ssl_vit.data.format.masks import beyond_message, classes_beyond, pixel_counts, size_mismatch
from ssl_vit.data.format.members import MAX_IMAGE_PIXELS

PIL_FORMATS = {"png": "PNG", "jpg": "JPEG"}
PNG_COMPRESS_LEVEL = 6


def encode_record(record, options: EncodeOptions) -> tuple[Encoded | str, int]:
    """`(the sample to store, or why the record is skipped, label)` of one `(payload, label)` or
    `(payload, label, mask)` record."""
    payload, label, mask = (*record, None)[:3]
    try:
        if isinstance(payload, Payload):
            return payload.encode(options, mask), label
        return encode_image(payload, options, mask), label
    except Skip as why:
        return str(why), label
    except Exception as err:
        where = payload if isinstance(payload, Path) else getattr(payload, "where", "image")
        return f"{where}: {err}", label


@dataclass(frozen=True)
class ImageBytes:
    """An image file as a shard stores it, and its key there (kept in the new shards); or one a parquet
    row holds (`ssl_vit.data.convert.hf`), without a key (the writer numbers it)."""

    data: bytes
    where: str  # "URL: KEY", for messages
    key: str | None = None

    def encode(self, options: EncodeOptions, mask: np.ndarray | MaskFile | None) -> Encoded:
        return encode_image(self.data, options, mask, self.key)


def encode_image(image: np.ndarray | Path | bytes, options: EncodeOptions, mask=None, key=None) -> Encoded:
    """The sample of an image (uint8 (H, W) or (H, W, 3), or an image file's path or bytes) and of its
    mask (uint8 (H, W) or a `MaskFile`), if any; `key`: the sample's own."""
    data, read, size, pixels = _encode_pixels(image, options)
    stored = None if mask is None else encode_mask(mask, read, size, options.mask_classes)
    return Encoded(data, size, BandStats.of(pixels), stored, key)


def _encode_pixels(image: np.ndarray | Path | bytes, options: EncodeOptions):
    """`(bytes, (H, W) as read, (H, W) as stored, the stored pixels)` of an image."""
    image_format, max_side = options.image_format, options.max_side
    if isinstance(image, np.ndarray):
        img = Image.fromarray(np.ascontiguousarray(image))
    else:
        data = image.read_bytes() if isinstance(image, Path) else image
        with warnings.catch_warnings():  # PIL's warning on size: the line below decides
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
        if img.width * img.height > MAX_IMAGE_PIXELS:  # judged from the header: a bomb is never decoded
            raise ValueError(
                f"{img.width}x{img.height} ({img.width * img.height:,} pixels), more than max_image_pixels "
                f"{MAX_IMAGE_PIXELS:,}: skipped without decoding"
            )
        if _keeps(img, image_format, max_side):
            size = (img.height, img.width)
            img.load()  # in full: a truncated file fails here, and the statistics need every pixel
            return data, size, size, np.asarray(img)
        if img.mode not in ("L", "RGB"):
            img = _eight_bit(img)
    read = (img.height, img.width)
    if max_side is not None and max(img.size) > max_side:
        img.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    if image_format == "png":
        img.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
        stored = np.asarray(img)
    else:
        img.save(buf, format="JPEG", quality=options.quality)
        stored = np.asarray(Image.open(io.BytesIO(buf.getvalue())))  # what a reader gets back
    return buf.getvalue(), read, (img.height, img.width), stored


def _eight_bit(img: Image.Image) -> Image.Image:
    """An image of another mode as L or RGB. One of more than 8 bits (16-bit PNGs are I;16 or I, float
    TIFFs F) is converted only when its values are whole numbers in 0..255, which `Image.convert` keeps
    exactly; it clips any other to 0..255 without a word (a 16-bit 300 becomes 255), so such an image is
    a ValueError: skipped and counted, naming the `tiff:` source, which stores any dtype."""
    if img.mode.startswith(("I", "F")):
        values = np.asarray(img)
        low, high = (values.min(), values.max()) if values.size else (0, 0)
        whole = img.mode != "F" or np.array_equal(values, np.rint(values))  # only floats have fractions
        if low < 0 or high > 255 or not whole:
            raise ValueError(
                f"{img.mode} image with values in {low}..{high}, which 8-bit storage would "
                "clip: store such images as TIFF and convert them with tiff:DIR (any band count and dtype)"
            )
        exact = Image.fromarray(values.astype(np.uint8))  # mode L
        return exact if img.mode == "I;16" else exact.convert("RGB")  # the modes `convert` gave them
    return img.convert("L" if img.mode in ("L", "1") else "RGB")


def encode_mask(mask: np.ndarray | MaskFile, read: tuple[int, int], size: tuple[int, int], num_classes: int):
    """`(PNG bytes, {class: pixels})` of a mask (uint8 [H, W] or a `MaskFile`) for an image read at
    `read` and stored at `size` ((H, W) each); ValueError when it does not fit the image or the classes."""
    where, array = ("mask", mask) if isinstance(mask, np.ndarray) else (mask.where, mask.load())
    if wrong := size_mismatch((read[1], read[0]), (array.shape[1], array.shape[0])):
        raise ValueError(f"{where} {wrong}")
    if len(beyond := classes_beyond(array, num_classes)):
        raise ValueError(f"{where} {beyond_message(beyond, num_classes)}")
    img = Image.fromarray(array)
    if size != read:  # shrunk with its image (--max-side): NEAREST, so no class is invented at an edge
        img = img.resize((size[1], size[0]), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue(), pixel_counts(np.asarray(img))


def _keeps(img: Image.Image, image_format: str, max_side: int | None) -> bool:
    """Whether the file's own bytes can be stored as they are."""
    fits = max_side is None or max(img.size) <= max_side
    return fits and img.format == PIL_FORMATS[image_format] and img.mode in ("L", "RGB")
