"""`wds:URLS`: existing WebDataset shards, re-sharded. The reader (`ssl_vit.data.wds_source`) reads them
with the training stream's tar reader, which imports torch: it is imported when the source is read."""

from __future__ import annotations

from ssl_vit.data.sources import register
from ssl_vit.storage.outdir import Input


def shard_inputs(spec: str) -> list[Input]:
    """The local shards among the URLS of `spec`: OUTDIR must not be one or hold one (its shards and
    manifest would land on or beside them); a folder beside them, or inside their directory, is fine,
    since the URLS name their files."""
    from ssl_vit.data.stream.urls import expand  # (see `load`)
    from ssl_vit.storage.remote import local_path

    paths = (local_path(url) for url in expand(spec.partition(":")[2], spec))
    return [Input(path, f"the source's shard {path}") for path in paths if path is not None]


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
