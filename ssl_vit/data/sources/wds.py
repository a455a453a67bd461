"""`wds:URLS`: existing WebDataset shards, re-sharded. The reader (`ssl_vit.data.wds_source`) reads them
with the training stream's tar reader, which imports torch: it is imported when the source is read."""

from __future__ import annotations

from ssl_vit.data.sources import register
from ssl_vit.outdir import Input


def shard_inputs(spec: str) -> list[Input]:
    """The directories of the local shards among the URLS of `spec` (what OUTDIR must keep out of)."""
    from ssl_vit.data.urls import shard_directories  # (see `load`)

    folders = shard_directories(spec.partition(":")[2], spec)
    return [Input(folder, f"the directory of the source's shards {folder}") for folder in folders]


@register(
    "wds",
    argument="URLS",
    help="existing WebDataset shards, re-sharded: image jpg/jpeg/png/webp, label from cls or a json "
    "member's label/cls, keys kept",
    inputs=shard_inputs,
)
def load(arg: str, split: str):
    from ssl_vit.data import wds_source

    return wds_source.load(arg, split)
