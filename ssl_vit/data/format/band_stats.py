"""Per-band statistics of a set of images, in model units: what `ssl-vit data convert` (over every image
it writes) and `ssl-vit data inspect --stats` (over a bounded sample) record in a manifest as
`band_stats`, and what `ShardDataModule(mean="auto", std="auto")` normalises with.

Model units: 8-bit images divided by 255 (the units of timm's IMAGENET_DEFAULT_MEAN), every other
dtype in its stored units. `std` is the population standard deviation (ddof 0) over every pixel of
every image, each band on its own.

Each image gives its count, mean and sum of squared deviations per band (float64); sets of them are
combined with Chan, Golub and LeVeque's pairwise update ("Updating formulae and a pairwise algorithm
for computing sample variances", 1979), which stays accurate where the textbook sum of squares loses
the variance to cancellation (a float band with a large mean and a small spread). Written here because
numpy has no mergeable running moments, and merging is what lets encoding workers, shards of a resumed
conversion and inspected shards each contribute their part.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ssl_vit.errors import BadValue, UserError

log = logging.getLogger("ssl_vit.data")


@dataclass
class BandStats:
    """Moments of `images` images: `pixels` per band, and per band `mean`, `m2` (sum of squared
    deviations from the mean), `min`, `max`, in stored units (float64 arrays [C])."""

    images: int
    pixels: int
    mean: np.ndarray
    m2: np.ndarray
    min: np.ndarray
    max: np.ndarray

    @classmethod
    def of(cls, image: np.ndarray) -> BandStats:
        """The statistics of one image, (H, W) or (H, W, C): integer images exactly (int64 sums of each
        band's values and squares, which cannot overflow below 2^63 / 2^32 = 2 billion pixels of 16
        bits, far beyond `max_image_pixels`; band by band, because numpy reduces a contiguous vector
        several times faster than a strided column), float images in two passes over float64 values."""
        bands = image.reshape(-1, 1 if image.ndim == 2 else image.shape[-1])
        n = len(bands)
        if image.dtype.kind in "ui":
            moments = []
            for b in range(bands.shape[1]):
                x = bands[:, b].astype(np.int64)
                total, squares = int(x.sum()), int(x @ x)
                moments.append((total / n, (n * squares - total * total) / n, x.min(), x.max()))  # exact ints
            return cls(1, n, *np.array(moments, dtype=np.float64).T)
        values = bands.astype(np.float64)
        mean = values.mean(axis=0)
        return cls(1, n, mean, ((values - mean) ** 2).sum(axis=0), values.min(0), values.max(0))

    @property
    def channels(self) -> int:
        return len(self.mean)

    def widen(self, channels: int) -> BandStats:
        """One band's statistics as those of `channels` equal bands (a grey image read as RGB)."""
        if self.channels == channels:
            return self
        if self.channels != 1:
            raise ValueError(f"statistics of {self.channels} bands cannot stand for {channels}")
        return BandStats(*(self.images, self.pixels), *(np.repeat(a, channels) for a in self.arrays()))

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.mean, self.m2, self.min, self.max

    def merge(self, other: BandStats | None) -> BandStats:
        """The statistics of both sets (Chan et al.'s update); a grey set merged with a colour one is
        widened first."""
        if other is None:
            return self
        channels = max(self.channels, other.channels)
        a, b = self.widen(channels), other.widen(channels)
        n = a.pixels + b.pixels
        delta = b.mean - a.mean
        mean = a.mean + delta * (b.pixels / n)
        m2 = a.m2 + b.m2 + delta**2 * (a.pixels * b.pixels / n)
        return BandStats(a.images + b.images, n, mean, m2, np.minimum(a.min, b.min), np.maximum(a.max, b.max))

    def to_json(self) -> dict:
        """Exactly (floats round-trip through JSON), for a conversion's progress record."""
        return {
            "images": self.images,
            "pixels": self.pixels,
            **{k: v.tolist() for k, v in zip(("mean", "m2", "min", "max"), self.arrays(), strict=True)},
        }

    @classmethod
    def from_json(cls, entry: dict) -> BandStats:
        arrays = (np.asarray(entry[key], np.float64) for key in ("mean", "m2", "min", "max"))
        return cls(entry["images"], entry["pixels"], *arrays)

    def manifest(self, dtype: str) -> dict:
        """The manifest's `band_stats`: per band `mean`, `std`, `min`, `max` in model units of an image
        of `dtype`, and the `images` they are over."""
        scale = 255.0 if dtype == "uint8" else 1.0
        std = np.sqrt(self.m2 / self.pixels)
        return {
            "mean": (self.mean / scale).tolist(),
            "std": (std / scale).tolist(),
            "min": (self.min / scale).tolist(),
            "max": (self.max / scale).tolist(),
            "images": self.images,
        }


def merged(stats) -> BandStats | None:
    """All of an iterable of BandStats (None entries skipped) merged in order; None when there are none."""
    total = None
    for part in stats:
        if part is not None:
            total = part if total is None else total.merge(part)
    return total


def normalisation(
    name: str,
    given: Sequence[float] | str,
    channels: int,
    manifest: dict | None,
    default: Sequence[float],
    urls: str,
) -> tuple[float, ...]:
    """A data module's `mean` or `std` as one float per band: as given, or with "auto" the `band_stats` of
    `manifest` (the first of its splits', over the shards `urls`); a grey 8-bit set's one band stands for
    the three it is read as with channels 3. One line for a wrong count (naming `default`, ImageNet's
    RGB, when it is that), a std that is not positive, or "auto" without stats."""
    if given == "auto":
        values = _auto(name, channels, manifest, urls)
    elif isinstance(given, str):
        raise BadValue(f"{name} {given!r}: give {channels} numbers (one per band) or 'auto'")
    else:
        values = tuple(float(v) for v in given)
    if len(values) != channels:
        named = " (the default: ImageNet's RGB)" if tuple(given) == tuple(default) else ""
        raise BadValue(
            f"{name} has {len(values)} values{named} for channels {channels}: give one per band in model "
            "units (8-bit data / 255, other dtypes as stored), or 'auto' for the manifest's band_stats"
        )
    if not all(math.isfinite(v) for v in values) or (name == "std" and min(values) <= 0):
        raise BadValue(f"{name} {list(values)}: give finite numbers{', all above 0' * (name == 'std')}")
    return values


def _auto(name: str, channels: int, manifest: dict | None, urls: str) -> tuple[float, ...]:
    stats = (manifest or {}).get("band_stats")
    if not isinstance(stats, dict) or not isinstance(stats.get(name), list):
        where = "the shards have no manifest" if manifest is None else "their manifest has no band_stats"
        raise UserError(
            f"{name} 'auto' reads the manifest's band_stats, and {where}: add them with `ssl-vit data "
            f"inspect --stats {urls}`, or give data.init_args.{name} as {channels} numbers"
        )
    values = [float(v) for v in stats[name]]
    if len(values) == 1 and channels == 3 and manifest.get("dtype", "uint8") == "uint8":
        values *= 3  # a grey 8-bit set, read as RGB: three equal bands
    if len(values) != channels:  # the count error below would ask for 'auto', which was given
        raise BadValue(
            f"{name} 'auto': the manifest's band_stats are of {len(values)} bands and "
            f"data.init_args.channels is {channels}: set channels to {len(values)}, the shards' band count"
        )
    if name == "std" and 0 in values:
        constant = ", ".join(str(i) for i, v in enumerate(values) if v == 0)
        if constant not in _CONSTANT_SAID:  # evaluate and compare build a data module per checkpoint
            log.warning(
                "band(s) %s are constant over the manifest's band_stats (std 0): normalised with std 1",
                constant,
            )
        _CONSTANT_SAID.add(constant)
        values = [v or 1.0 for v in values]
    return tuple(values)


_CONSTANT_SAID: set[str] = set()  # the constant bands this command has said
