"""One source record -> the image bytes a shard stores (run in `ssl-vit data convert`'s worker processes).

An image file (a path, or bytes read from a shard) already in the output format, grey or RGB, and with
its longer side within `--max-side` is stored as it is, byte for byte: ImageNet-style JPEGs are not
re-encoded lossily, and a re-shard (`wds:`) neither decodes nor re-encodes them. Such a file is still
decoded once to check it (a JPEG at 1/8 scale, which reads all its data at a fraction of the cost),
so a truncated file is skipped and counted here rather than failing a training run later. Everything
else is converted to grey (L) or RGB, shrunk to `--max-side` if larger (PIL's `Image.thumbnail`: aspect
kept, JPEGs decoded at a reduced DCT scale first, then a bicubic resample; never enlarged) and encoded
as PNG or as JPEG at `--quality`.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image

from ssl_vit.data.wds_source import Broken, ShardImage

PIL_FORMATS = {"png": "PNG", "jpg": "JPEG"}
PNG_COMPRESS_LEVEL = 6


def encode_record(record, image_format: str, quality: int, max_side: int | None):
    """Encode one `(payload, label)` record. Returns `(bytes, (H, W), label, key)`, or
    `(None, reason, label, key)` for an image that cannot be read (the caller skips and counts it);
    `key` is the sample's key in its source shard (`wds:`), else None."""
    payload, label = record
    key = payload.key if isinstance(payload, ShardImage) else None
    if isinstance(payload, Broken):
        return None, payload.reason, label, key
    try:
        if isinstance(payload, np.ndarray):
            img = Image.fromarray(np.ascontiguousarray(payload))
        else:
            data = payload.read_bytes() if isinstance(payload, Path) else payload.data
            img = Image.open(io.BytesIO(data))
            if _keeps(img, image_format, max_side):
                size = (img.height, img.width)  # before `_check_decodes` shrinks the draft
                _check_decodes(img)
                return data, size, label, key
            if img.mode not in ("L", "RGB"):
                img = img.convert("L" if img.mode in ("L", "1", "I;16") else "RGB")
        if max_side is not None and max(img.size) > max_side:
            img.thumbnail((max_side, max_side))
        buf = io.BytesIO()
        if image_format == "png":
            img.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
        else:
            img.save(buf, format="JPEG", quality=quality)
    except Exception as err:
        where = payload if isinstance(payload, Path) else getattr(payload, "where", "image")
        return None, f"{where}: {err}", label, key
    return buf.getvalue(), (img.height, img.width), label, key


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
