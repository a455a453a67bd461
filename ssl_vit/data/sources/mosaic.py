"""`mosaic:URLS --grid K`: K x K grids of a labelled shard set's images, each tile's pixels labelled with
its class (a dense task built from real images). The reader, `ssl_vit.data.mosaic`, reads the tiles
as `wds:` does (it imports torch): it is imported when the source is read."""

from __future__ import annotations

from ssl_vit.data.sources import Flag, register
from ssl_vit.data.sources.wds import shard_inputs


@register(
    "mosaic",
    argument="URLS",
    help="K x K grids of a labelled shard set's images, read like wds:, each tile's pixels labelled with "
    "its class: a dense task built from real images",
    masks=True,
    flags=(
        Flag(
            "grid",
            "K x K tiles per image (e.g. --grid 2 for 2x2), consecutive groups of K*K samples in the shards' "
            "order (a last group of fewer is left out); the mask labels each tile's pixels with its class",
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
def load(arg: str, split: str, grid: int, background_threshold: int | None):
    from ssl_vit.data import mosaic

    return mosaic.load(arg, split, grid, background_threshold)
