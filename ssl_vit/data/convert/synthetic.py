"""`synthetic:N`: N deterministic images in 10 classes, for tests and smoke runs."""

from __future__ import annotations

import zlib

import numpy as np

from ssl_vit.data.convert.source import SourceKind, no_inputs, register
from ssl_vit.errors import UserError


def load(arg: str, split: str) -> tuple[list[str], list]:
    """N deterministic 32x32 RGB images in 10 classes: class c is a gradient at angle c*36 degrees in
    its own colour, plus noise; seeded by the split name so train and val differ."""
    try:
        n = int(arg)
    except ValueError:
        n = 0
    if n <= 0:
        raise UserError(f"synthetic:{arg}: N must be a positive integer, e.g. synthetic:1000")
    rng = np.random.default_rng(zlib.crc32(split.encode()))
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    records = []
    for i in range(n):
        c = i % 10
        angle = np.deg2rad(36 * c)
        ramp = np.cos(angle) * xx + np.sin(angle) * yy
        colour = np.array([(c * 97) % 256, (c * 53 + 80) % 256, (c * 29 + 160) % 256]) / 255.0
        img = ramp[:, :, None] * colour + rng.normal(0, 0.08, (32, 32, 3))
        records.append((np.clip(img * 255, 0, 255).astype(np.uint8), c))
    return [str(c) for c in range(10)], records


register(SourceKind("synthetic", load, "N", inputs=no_inputs))
