"""The `mosaic:URLS --grid K` source: a dense-prediction task built from a labelled set's real images,
for when no segmentation set is at hand (2x2 mosaics of Fashion-MNIST: 56 px images whose masks say
which of four garments each pixel belongs to).

The tile shards are read like `wds:URLS` (`ssl_vit.data.convert.wds`) and cut into consecutive groups of
K*K samples in the shards' order; each group becomes one image, its tiles placed row by row, and a mask
holding each tile's class on the tile's pixels. Samples that cannot be tiles (no image member, a
label that does not parse, none, or one outside the tiles' manifest's classes) are skipped and counted
and do not take a place in a group. The tiles after the last whole group (fewer than K*K) are left out,
said in a warning and recorded in the manifest (`mosaic.remainder`); tiles (or labelled tiles, as the
manifest counts them) too few for one grid are one line before anything is read. Every tile takes the
size of its group's first tile (resized bilinearly where it differs; no change for sets of one size
such as MNIST or CIFAR); the mosaic is grey (mode L) when every tile is, else RGB.

With `--background-threshold T`, pixels whose grey level is below T belong to an extra class,
`background`, appended after the tiles' classes (index = their number). The grey level of an RGB
pixel is the maximum of its three channels, so that a dark but saturated colour (a red object on
black) counts as object, not background; a grey pixel's is its value.

The tiles' class names come from the ssl-vit manifest next to their shards, which is required: it
fixes the classes (and so the background's index) before the first tile is read.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from ssl_vit.data.convert.encode import ImageBytes, encode_image
from ssl_vit.data.convert.payload import Broken, Encoded, EncodeOptions
from ssl_vit.data.convert.source import Flag, SourceKind, register
from ssl_vit.data.convert.wds import ShardRecords, shard_inputs
from ssl_vit.data.convert.wds import load as load_shards
from ssl_vit.data.format.manifest import manifest_url
from ssl_vit.data.format.masks import IGNORE_INDEX
from ssl_vit.errors import UserError, first_line

log = logging.getLogger(__name__)
BACKGROUND = "background"


@dataclass(frozen=True)
class Tiles:
    """The K*K tiles of one mosaic, row by row, and how to label its pixels (composed in a worker of the
    writer, `encode`)."""

    tiles: tuple[ImageBytes, ...]
    labels: tuple[int, ...]
    grid: int
    threshold: int | None  # grey level below which a pixel is background
    background: int  # the background class's index

    @property
    def where(self) -> str:
        return f"mosaic of {self.tiles[0].where} and the next {len(self.tiles) - 1} tiles"

    def encode(self, options: EncodeOptions, mask: None) -> Encoded:
        image, composed = self.compose()
        return encode_image(image, options, composed)

    def compose(self) -> tuple[np.ndarray, np.ndarray]:
        """(image uint8 [K*h, K*w] or [K*h, K*w, 3], mask uint8 [K*h, K*w]); ValueError naming a tile
        that does not decode."""
        images = []
        for tile in self.tiles:
            try:
                img = Image.open(io.BytesIO(tile.data))
                img.load()
            except Exception as err:
                raise ValueError(f"tile {tile.where} does not decode ({first_line(err)})") from None
            images.append(img)
        mode = "L" if all(img.mode == "L" for img in images) else "RGB"
        width, height = images[0].size
        k = self.grid
        canvas = np.zeros((k * height, k * width) + (() if mode == "L" else (3,)), dtype=np.uint8)
        mask = np.empty((k * height, k * width), dtype=np.uint8)
        for i, (img, label) in enumerate(zip(images, self.labels)):
            if img.size != (width, height):
                img = img.resize((width, height), Image.Resampling.BILINEAR)
            rows = slice(i // k * height, (i // k + 1) * height)
            cols = slice(i % k * width, (i % k + 1) * width)
            canvas[rows, cols] = np.asarray(img.convert(mode))
            mask[rows, cols] = label
        if self.threshold is not None:
            grey = canvas if canvas.ndim == 2 else canvas.max(axis=2)
            mask[grey < self.threshold] = self.background
        return canvas, mask


class MosaicRecords:
    """The `(Tiles | Broken, -1)` records of mosaics of the tile shards, read afresh by each iteration.
    `total`: the number of mosaics when the tiles' manifest counts exactly these shards and none is
    broken (progress and resuming), else None. `manifest`: what the split's manifest records of the
    mosaics, complete once an iteration has ended."""

    def __init__(self, tiles: ShardRecords, grid: int, num_classes: int, threshold: int | None):
        self.tiles, self.grid, self.num_classes, self.threshold = tiles, grid, num_classes, threshold
        self.total = tiles.total // grid**2 if tiles.total is not None else None
        self.manifest = {"mosaic": {"grid": grid, "background_threshold": threshold, "remainder": None}}

    def __iter__(self) -> Iterator[tuple[Tiles | Broken, int]]:
        group: list[tuple[ImageBytes, int]] = []
        made = 0
        for payload, label in self.tiles:
            if isinstance(payload, Broken):
                yield payload, -1
            elif label < 0:
                yield Broken(f"{payload.where}: no label: a mosaic's tiles need their labels"), -1
            else:
                group.append((payload, label))
                if len(group) == self.grid**2:
                    tiles, labels = zip(*group)
                    yield Tiles(tiles, labels, self.grid, self.threshold, self.num_classes), -1
                    group, made = [], made + 1
        if group:
            log.warning(
                "mosaic: the last %d tiles do not fill a %dx%d grid and are left out",
                len(group), self.grid, self.grid,
            )  # fmt: skip
        self.manifest["mosaic"]["remainder"] = len(group)
        if not made:
            raise UserError(
                f"mosaic: fewer usable tiles than one grid: {len(group)} labelled images that decode, a "
                f"{self.grid}x{self.grid} grid needs {self.grid**2}; give a smaller --grid or more tiles"
            )


def load(
    arg: str, split: str, grid: int, background_threshold: int | None
) -> tuple[list[str], MosaicRecords]:
    """`(class names, records)` of K x K mosaics of the labelled shards URLS in `arg`: the tiles' class
    names, plus `background` with `--background-threshold`."""
    if grid < 1:
        raise UserError(f"--grid must be at least 1, got {grid}")
    if background_threshold is not None and not 0 <= background_threshold <= 255:
        raise UserError(
            f"--background-threshold must be a grey level of 0 to 255, got {background_threshold}"
        )
    names, tiles = load_shards(arg, split, what="mosaic:URLS")
    if names is None:
        from ssl_vit.data.stream.urls import expand  # (imports webdataset: see `wds.load`)

        where = (
            manifest_url(expand(arg, "mosaic:URLS")[0]) or "SPLIT.json beside shards named SPLIT-NNNNNN.tar"
        )
        raise UserError(
            f"mosaic:{arg}: no class names for the tiles: their manifest {where} is missing or lists none; "
            "a mosaic needs a labelled set written by `ssl-vit data convert`"
        )
    classes = len(names) + (background_threshold is not None)
    if classes > IGNORE_INDEX:
        raise UserError(
            f"mosaic:{arg}: {classes} mask classes do not fit a uint8 mask whose {IGNORE_INDEX} means "
            f"ignored: use a set of at most {IGNORE_INDEX - (background_threshold is not None)} classes"
        )
    if tiles.labelled == 0:
        raise UserError(
            f"mosaic:{arg}: none of the {tiles.total} tiles has a label (their manifest's class_counts): a "
            "mosaic's masks are its tiles' labels; give a labelled set"
        )
    for count, what in ((tiles.total, "images"), (tiles.labelled, "labelled images")):
        if count is not None and count < grid**2:
            raise UserError(
                f"mosaic:{arg}: fewer tiles than one grid: {count} {what}, a {grid}x{grid} grid needs "
                f"{grid**2}; give a smaller --grid"
            )
    records = MosaicRecords(tiles, grid, len(names), background_threshold)
    return names + [BACKGROUND] * (background_threshold is not None), records


register(
    SourceKind(
        "mosaic",
        load,
        "URLS",
        help="K x K grids of a labelled shard set's images, read like wds:, each tile's pixels labelled with "
        "its class: a dense task built from real images",
        masks=True,
        flags=(
            Flag(
                "grid",
                "K x K tiles per image (e.g. --grid 2 for 2x2), consecutive groups of K*K samples in the "
                "shards' order (a last group of fewer is left out); the mask labels each tile's pixels with "
                "its class",
                type=int,
                metavar="K",
                required=True,
            ),
            Flag(
                "background_threshold",
                "pixels whose grey level (the maximum of R, G and B) is below T (0-255) get an extra class "
                "'background', numbered after the tiles' classes",
                type=int,
                metavar="T",
            ),
        ),
        inputs=shard_inputs,
    )
)
