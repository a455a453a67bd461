"""What a segmentation mask is in a shard: the sample's `seg.png` member, single-channel uint8 (PIL mode
L, or P whose palette indices are the classes), one class index per pixel of the sample's image, and
`IGNORE_INDEX` (255) for pixels that belong to no class (object borders, "other") and are never
scored. Read and checked the same way where shards are written (`ssl-vit data convert`), streamed
(`ssl_vit.data.stream`) and inspected (`ssl-vit data inspect`).
"""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

MASK_MEMBER = "seg.png"
IGNORE_INDEX = 255
MASK_MODES = ("L", "P")


def decode_mask(data: bytes) -> np.ndarray:
    """PNG bytes -> uint8 [H, W] class indices (P: the palette indices). ValueError for a file that does
    not decode or is not single-channel 8-bit."""
    with Image.open(io.BytesIO(data)) as mask:
        if mask.mode not in MASK_MODES:
            raise ValueError(
                f"a mode {mask.mode} image, not single-channel 8-bit (mode L, or P whose indices are the "
                "classes)"
            )
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


def size_mismatch(image_size: tuple[int, int], mask: np.ndarray) -> str | None:
    """What is wrong when the mask [H, W] does not cover an image of PIL size (W, H) pixel for pixel."""
    if image_size == (mask.shape[1], mask.shape[0]):
        return None
    return f"is {mask.shape[1]}x{mask.shape[0]} pixels, its image {image_size[0]}x{image_size[1]}"


def pixel_counts(mask: np.ndarray) -> dict[int, int]:
    """Class (or IGNORE_INDEX) -> pixels of that value in `mask`, the values present only."""
    counts = np.bincount(mask.ravel(), minlength=256)
    return {int(c): int(counts[c]) for c in np.flatnonzero(counts)}
