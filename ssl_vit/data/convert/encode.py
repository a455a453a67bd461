"""One source record -> the image bytes a shard stores (run in `ssl-vit data convert`'s worker processes).

An image file (a path, or bytes read from a shard) already in the output format, grey or RGB, and with
its longer side within `--max-side` is stored as it is, byte for byte: ImageNet-style JPEGs are not
re-encoded lossily, and a re-shard (`wds:`) does not re-encode them. Such a file is still decoded
once, in full (its statistics need every pixel), so a truncated file is skipped and counted here
rather than failing a training run later. Everything
else is converted to grey (L) or RGB, shrunk to `--max-side` if larger (PIL's `Image.thumbnail`: aspect
kept, JPEGs decoded at a reduced DCT scale first, then a bicubic resample; never enlarged) and encoded
as PNG or as JPEG at `--quality`.

A record of a source with masks also has its mask (a uint8 array, a `MaskFile`, or the mask a mosaic's
`Tiles` compose with their image): checked to cover the image pixel for pixel and to hold only classes
below the source's count or 255 (else the record is skipped and counted, as an unreadable image is),
shrunk with NEAREST to the stored image's size when `--max-side` shrank it, and stored as a mode-L
PNG (the sample's `seg.png`), with its pixel count per class for the manifest.

Every record also gives the statistics of its image's bands as stored (`band_stats.BandStats`: a kept
file decoded in full, a JPEG written here decoded from the bytes written), which the writer merges
into the manifest's `band_stats`: exact over every image written, at the cost of one decode of each
image that was not decoded in full anyway.

A record of an array source (`tiff:`, `eurosat:`; its payload a `tiff.ArrayFile`) is read
with tifffile, its header judged against the size limit, the split's band count and dtype before
its pixels are decoded, and stored losslessly as a `.npy` member, band-last `(H, W, C)`.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

from ssl_vit.data.convert.mosaic import Tiles
from ssl_vit.data.convert.tiff import ArrayFile
from ssl_vit.data.convert.wds import Broken, ShardImage
from ssl_vit.data.format.arrays import npy_bytes, open_tiff
from ssl_vit.data.format.band_stats import BandStats
from ssl_vit.data.format.masks import (
    MaskFile,
    array_size,
    beyond_message,
    classes_beyond,
    pixel_counts,
    size_mismatch,
)
from ssl_vit.data.format.members import MAX_IMAGE_PIXELS

PIL_FORMATS = {"png": "PNG", "jpg": "JPEG"}
PNG_COMPRESS_LEVEL = 6


def encode_record(record, image_format: str, quality: int, max_side: int | None, mask_classes: int | None):
    """Encode one `(payload, label)` or `(payload, label, mask)` record (`mask_classes`: the source's
    mask class count). Returns `(bytes, (H, W), label, key, mask, stats)` with `mask` None or `(PNG
    bytes, {class: pixels})` and `stats` the image's `BandStats`, or `(None, reason, label, key, None,
    None)` for a record that cannot be read (the caller skips and counts it); `key` is the sample's key
    in its source shard (`wds:`), else None."""
    payload, label, mask = (*record, None)[:3]
    key = payload.key if isinstance(payload, ShardImage) else None
    if isinstance(payload, Broken):
        return None, payload.reason, label, key, None, None
    try:
        if isinstance(payload, ArrayFile):
            data, size, stats = _encode_array(payload)
            return data, size, label, key, None, stats
        if isinstance(payload, Tiles):
            payload, mask = payload.compose()
        data, read, size, pixels = _encode_image(payload, image_format, quality, max_side)
        stored = None if mask is None else _encode_mask(mask, read, size, mask_classes)
    except Exception as err:
        where = payload if isinstance(payload, Path) else getattr(payload, "where", "image")
        return None, f"{where}: {err}", label, key, None, None
    return data, size, label, key, stored, BandStats.of(pixels)


def _encode_image(payload, image_format: str, quality: int, max_side: int | None):
    """`(bytes, (H, W) as read, (H, W) as stored, the stored pixels)` of an image payload."""
    if isinstance(payload, np.ndarray):
        img = Image.fromarray(np.ascontiguousarray(payload))
    else:
        data = payload.read_bytes() if isinstance(payload, Path) else payload.data
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
        img.save(buf, format="JPEG", quality=quality)
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


def _encode_array(payload: ArrayFile) -> tuple[bytes, tuple[int, int], BandStats]:
    """`(.npy bytes, (H, W), stats)` of an array file, its header judged first."""
    member = open_tiff(payload.path.read_bytes(), payload.channels, payload.band_axis)
    if member.width * member.height > MAX_IMAGE_PIXELS or member.nbytes > 4 * MAX_IMAGE_PIXELS:
        raise ValueError(f"{member.shape_text()}: larger than {MAX_IMAGE_PIXELS:,} pixels or 4 bytes each")
    if (member.bands, member.dtype) != (payload.channels, payload.dtype):
        raise ValueError(
            f"{member.bands} bands of {member.dtype}, the split's are {payload.channels} of {payload.dtype} "
            f"(set by its first file, {payload.first})"
        )
    array = member.read()
    return npy_bytes(array), (member.height, member.width), BandStats.of(array)


def _encode_mask(mask, read: tuple[int, int], size: tuple[int, int], num_classes: int):
    """`(PNG bytes, {class: pixels})` of a mask (uint8 [H, W] or a `MaskFile`) for an image read at
    `read` and stored at `size` ((H, W) each); ValueError when it does not fit the image or the classes."""
    where = f"mask {mask.path}" if isinstance(mask, MaskFile) else "mask"
    array = mask.load() if isinstance(mask, MaskFile) else mask
    if wrong := size_mismatch((read[1], read[0]), array_size(array)):
        raise ValueError(f"{where} {wrong}")
    if len(beyond := classes_beyond(array, num_classes)):
        raise ValueError(f"{where} {beyond_message(beyond, num_classes)}")
    img = Image.fromarray(array)
    if size != read:  # shrunk with its image (--max-side): NEAREST, so no class is invented at an edge
        img = img.resize((size[1], size[0]), Image.Resampling.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return buf.getvalue(), pixel_counts(np.asarray(img))


def encode_star(args):
    return encode_record(*args)


def _keeps(img: Image.Image, image_format: str, max_side: int | None) -> bool:
    """Whether the file's own bytes can be stored as they are."""
    fits = max_side is None or max(img.size) <= max_side
    return fits and img.format == PIL_FORMATS[image_format] and img.mode in ("L", "RGB")
