"""What a segmentation mask is in a shard: the sample's `seg.png` member, single-channel uint8 (PIL mode
L, or P whose palette indices are the classes), one class index per pixel of the sample's image, and
`IGNORE_INDEX` (255) for pixels that belong to no class (object borders, "other") and are never
scored. Read and checked the same way where shards are written (`ssl-vit data convert`), streamed
(`ssl_vit.data.stream.pipeline`) and inspected (`ssl-vit data inspect`).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image

from ssl_vit.data.format.members import BadSample, decoding

MASK_MEMBER = "seg.png"
IGNORE_INDEX = 255
MASK_MODES = ("L", "P")


class MaskSizeError(ValueError):
    """A mask whose header says it does not cover its image pixel for pixel."""


def decode_mask(
    data: bytes, image_size: tuple[int, int] | None = None, max_pixels: int | None = None
) -> np.ndarray:
    """PNG bytes -> uint8 [H, W] class indices (P: the palette indices). ValueError for a file that does
    not decode, is not single-channel 8-bit or has more than `max_pixels` pixels; MaskSizeError for one
    whose size is not `image_size` (W, H). All judged from the header, before a pixel is decoded."""
    with warnings.catch_warnings():  # PIL's warning on size: `max_pixels` decides here
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        mask = Image.open(io.BytesIO(data))
    with mask:
        if mask.mode not in MASK_MODES:
            raise ValueError(
                f"a mode {mask.mode} image, not single-channel 8-bit (mode L, or P whose indices are the "
                "classes)"
            )
        if max_pixels is not None and mask.width * mask.height > max_pixels:
            raise ValueError(
                f"is {mask.width}x{mask.height} ({mask.width * mask.height:,} pixels), more than "
                f"max_image_pixels {max_pixels:,}: skipped without decoding"
            )
        if image_size is not None and (wrong := size_mismatch(image_size, mask.size)):
            raise MaskSizeError(wrong)
        return np.array(mask)


def classes_beyond(mask: np.ndarray, num_classes: int) -> np.ndarray:
    """The sorted values of `mask` that are neither a class below `num_classes` nor IGNORE_INDEX."""
    if num_classes >= IGNORE_INDEX or mask.max() < num_classes:  # the usual case, one pass
        return np.empty(0, dtype=np.uint8)
    return np.unique(mask[(mask >= num_classes) & (mask != IGNORE_INDEX)])


def beyond_message(beyond: np.ndarray, num_classes: int) -> str:
    shown = ", ".join(map(str, beyond[:5])) + (", ..." if len(beyond) > 5 else "")
    return (
        f"holds class {shown}, beyond num_classes {num_classes} ({IGNORE_INDEX}, ignored, is the only other "
        "value)"
    )


def size_mismatch(image_size: tuple[int, int], mask_size: tuple[int, int]) -> str | None:
    """What is wrong when a mask of size (W, H) does not cover an image of size (W, H) pixel for pixel."""
    if tuple(image_size) == tuple(mask_size):
        return None
    return f"is {mask_size[0]}x{mask_size[1]} pixels, its image {image_size[0]}x{image_size[1]}"


def pixel_counts(mask: np.ndarray) -> dict[int, int]:
    """Class (or IGNORE_INDEX) -> pixels of that value in `mask`, the values present only."""
    counts = np.bincount(mask.ravel(), minlength=256)
    return {int(c): int(counts[c]) for c in np.flatnonzero(counts)}


def read_mask(
    sample: dict,
    num_classes: int | None,
    required: bool,
    image_size: tuple[int, int] | None = None,
    max_pixels: int | None = None,
) -> np.ndarray | None:
    """The sample's `seg.png` as uint8 [H, W] class indices, or None when it has none and none is
    `required` (its split's manifest says `"masks": true`). BadSample for a missing required mask, one
    `decode_mask` refuses, and one holding a class of `num_classes` or more other than 255 (ignored)."""
    data = sample.get(MASK_MEMBER)
    if data is None:
        if required:
            raise BadSample(f"no {MASK_MEMBER} member, and its split's manifest says every sample has a mask")
        return None
    with decoding(MASK_MEMBER, MaskSizeError):
        mask = decode_mask(data, image_size, max_pixels)
    if num_classes is not None and len(beyond := classes_beyond(mask, num_classes)):
        raise BadSample(f"{MASK_MEMBER} {beyond_message(beyond, num_classes)}")
    return mask
