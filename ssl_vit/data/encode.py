"""One source record -> the image bytes a shard stores (run in `ssl-vit data convert`'s worker processes).

An image file (a path, or bytes read from a shard) already in the output format, grey or RGB, and with
its longer side within `--max-side` is stored as it is, byte for byte: ImageNet-style JPEGs are not
re-encoded lossily, and a re-shard (`wds:`) neither decodes nor re-encodes them. Such a file is still
decoded once to check it (a JPEG at 1/8 scale, which reads all its data at a fraction of the cost),
so a truncated file is skipped and counted here rather than failing a training run later. Everything
else is converted to grey (L) or RGB, shrunk to `--max-side` if larger (PIL's `Image.thumbnail`: aspect
kept, JPEGs decoded at a reduced DCT scale first, then a bicubic resample; never enlarged) and encoded
as PNG or as JPEG at `--quality`.

A record of a source with masks also has its mask (a uint8 array, a `MaskFile`, or the mask a mosaic's
`Tiles` compose with their image): checked to cover the image pixel for pixel and to hold only classes
below the source's count or 255 (else the record is skipped and counted, as an unreadable image is),
shrunk with NEAREST to the stored image's size when `--max-side` shrank it, and stored as a mode-L
PNG (the sample's `seg.png`), with its pixel count per class for the manifest.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from ssl_vit.data.masks import beyond_message, classes_beyond, pixel_counts, size_mismatch
from ssl_vit.data.mosaic import Tiles
from ssl_vit.data.segmentation_sources import MaskFile
from ssl_vit.data.wds_source import Broken, ShardImage

PIL_FORMATS = {"png": "PNG", "jpg": "JPEG"}
PNG_COMPRESS_LEVEL = 6


def encode_record(record, image_format: str, quality: int, max_side: int | None, mask_classes: int | None):
    """Encode one `(payload, label)` or `(payload, label, mask)` record (`mask_classes`: the source's
    mask class count). Returns `(bytes, (H, W), label, key, mask)` with `mask` None or `(PNG bytes,
    {class: pixels})`, or `(None, reason, label, key, None)` for a record that cannot be read (the caller
    skips and counts it); `key` is the sample's key in its source shard (`wds:`), else None."""
    payload, label, mask = (*record, None)[:3]
    key = payload.key if isinstance(payload, ShardImage) else None
    if isinstance(payload, Broken):
        return None, payload.reason, label, key, None
    try:
        if isinstance(payload, Tiles):
            payload, mask = payload.compose()
        data, read, size = _encode_image(payload, image_format, quality, max_side)
        stored = None if mask is None else _encode_mask(mask, read, size, mask_classes)
    except Exception as err:
        where = payload if isinstance(payload, Path) else getattr(payload, "where", "image")
        return None, f"{where}: {err}", label, key, None
    return data, size, label, key, stored


def _encode_image(payload, image_format: str, quality: int, max_side: int | None):
    """`(bytes, (H, W) as read, (H, W) as stored)` of an image payload."""
    if isinstance(payload, np.ndarray):
        img = Image.fromarray(np.ascontiguousarray(payload))
    else:
        data = payload.read_bytes() if isinstance(payload, Path) else payload.data
        img = Image.open(io.BytesIO(data))
        if _keeps(img, image_format, max_side):
            size = (img.height, img.width)  # before `_check_decodes` shrinks the draft
            _check_decodes(img)
            return data, size, size
        if img.mode not in ("L", "RGB"):
            img = img.convert("L" if img.mode in ("L", "1", "I;16") else "RGB")
    read = (img.height, img.width)
    if max_side is not None and max(img.size) > max_side:
        img.thumbnail((max_side, max_side))
    buf = io.BytesIO()
    if image_format == "png":
        img.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    else:
        img.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), read, (img.height, img.width)


def _encode_mask(mask, read: tuple[int, int], size: tuple[int, int], num_classes: int):
    """`(PNG bytes, {class: pixels})` of a mask (uint8 [H, W] or a `MaskFile`) for an image read at
    `read` and stored at `size` ((H, W) each); ValueError when it does not fit the image or the classes."""
    where = f"mask {mask.path}" if isinstance(mask, MaskFile) else "mask"
    array = mask.load() if isinstance(mask, MaskFile) else mask
    if wrong := size_mismatch((read[1], read[0]), array):
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


def _check_decodes(img: Image.Image) -> None:
    """Decode `img` to find truncated or corrupt data; JPEGs at 1/8 scale (`draft`), which still reads
    every byte of the entropy-coded data."""
    img.draft(img.mode, (1, 1))
    img.load()
