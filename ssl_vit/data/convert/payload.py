"""What a source's records hand the shard writer, and what it gets back (`ssl-vit data convert`).

A record is `(payload, label)` (-1: unlabelled), or `(payload, label, mask)` from a source with masks
(`ade20k:`, `voc:`: a uint8 array or a `MaskFile`; `mosaic.Tiles` make image and mask together). A uint8
array `(H, W)` or `(H, W, 3)` or an image file's path is an image (`encode.encode_image`; a path is read
in the writer's worker processes, so the parent never holds a whole image folder in memory); anything
else implements `Payload`: its `encode` runs in the writer's worker processes and returns the sample as
stored (`Encoded`), or raises for a record that cannot be stored, which is skipped and counted (`Skip`:
its reason whole; any other error: the payload's `where`, then the error). A source keeps its own kind of
payload beside its reader (`tiff.ArrayFile`, `mosaic.Tiles`, `encode.ImageBytes`), and so can a plugin's;
the writer knows none.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

from ssl_vit.data.format.band_stats import BandStats
from ssl_vit.data.format.masks import decode_mask


@dataclass(frozen=True)
class EncodeOptions:
    """What `data convert` asks of every record of a split."""

    image_format: str  # the image member's format: "png" or "jpg", "npy" for an array source
    quality: int  # JPEG quality
    max_side: int | None  # --max-side: a longer side shrunk to at most this
    mask_classes: int | None  # the source's mask class count, None without masks


@dataclass(frozen=True)
class Encoded:
    """One sample as the shard stores it."""

    data: bytes  # the image member, in `EncodeOptions.image_format`
    size: tuple[int, int]  # (H, W) as stored
    stats: BandStats  # of the stored pixels' bands
    mask: tuple[bytes, dict[int, int]] | None = None  # the `seg.png` bytes and its pixels per class
    key: str | None = None  # the sample's own key (`wds:`), else the writer numbers it


class Skip(ValueError):
    """A record that cannot be stored, its reason already naming it: skipped and counted."""


@runtime_checkable
class Payload(Protocol):
    """A record's first element when it is neither an array nor a path."""

    where: str  # what a skipped record's line names

    def encode(self, options: EncodeOptions, mask) -> Encoded:
        """The sample to store; `mask`: the record's third element (None without)."""


@dataclass(frozen=True)
class Broken:
    """A record, or the rest of a shard, that cannot be converted: skipped and counted by the writer."""

    reason: str
    where = "a broken record"  # its reason names it

    def encode(self, options: EncodeOptions, mask) -> Encoded:
        raise Skip(self.reason)


@dataclass(frozen=True)
class MaskFile:
    """A segmentation source's annotation PNG (`ade20k:`, `voc:`), and the lookup table from its values to
    class indices (None: they are); its records' third element, decoded in the writer's workers. A mask
    of another kind is anything with a `where` and a `load` like these."""

    path: Path
    to_classes: np.ndarray | None = None

    @property
    def where(self) -> str:
        return f"mask {self.path}"

    def load(self) -> np.ndarray:
        """uint8 [H, W] class indices (255 ignored); ValueError naming the file when it does not decode."""
        try:
            mask = decode_mask(self.path.read_bytes())
        except Exception as err:
            raise ValueError(f"{self.where} does not decode: {err}") from None
        return mask if self.to_classes is None else self.to_classes[mask]
