"""`digits`: scikit-learn's 8x8 handwritten digits (1797 real images), the offline default source."""

from __future__ import annotations

import numpy as np

from ssl_vit.data.convert.source import SourceKind, check_split, register

DIGITS_SIZE = 32
DIGITS_VAL_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0


def load(_: str, split: str) -> tuple[list[str], list]:
    """scikit-learn's 8x8 handwritten digits (1797 images, values 0-16), upscaled to 32x32 RGB.

    The train/val split is fixed: a permutation seeded with 0, the first 20% (360 images) is `val`,
    the rest (1437) is `train`. Upscaling is bilinear on the 0-255 rescaled values, so ViT patches of
    4 or 8 pixels see smooth strokes rather than hard 4x4 blocks.
    """
    from PIL import Image
    from sklearn.datasets import load_digits

    check_split("digits", split, ("train", "val"))
    digits = load_digits()
    order = np.random.default_rng(DIGITS_SPLIT_SEED).permutation(len(digits.images))
    n_val = int(round(len(order) * DIGITS_VAL_FRACTION))
    chosen = np.sort(order[:n_val] if split == "val" else order[n_val:])
    records = []
    for i in chosen:
        small = Image.fromarray(np.round(digits.images[i] * (255 / 16)).astype(np.uint8))
        big = np.asarray(small.resize((DIGITS_SIZE, DIGITS_SIZE), Image.BILINEAR))
        records.append((np.repeat(big[:, :, None], 3, axis=2), int(digits.target[i])))
    return [str(c) for c in range(10)], records


register(SourceKind("digits", load, None, splits="train|val"))
