"""`ssl-vit data convert`: image sources -> WebDataset shards. The registry of sources (`source`:
`register`, `Flag`, `SOURCES`, `open_source`), one module per built-in source with its reader beside
its registration (`digits`, `synthetic`, `imagefolder`, `cifar`, `idx`, `npz`, `wds`, `imagenet`, `hf`,
`ade20k`, `voc`, `mosaic`, `tiff`, `eurosat`), what a record carries to the writer (`payload`), one
record -> the bytes a shard stores (`encode`), and the writer of the shards and their manifest
(`shard_writer`).

Importing this package registers the built-in sources and nothing heavier: `ssl-vit --help` lists them
(a reader that needs torch or pyarrow imports it when it runs). A plugin registers its own with
`register` (see `source`)."""

# The order the help lists the built-in sources in. Each module registers itself with `source.register`.
# isort: off
from ssl_vit.data.convert.source import (
    SOURCES, Flag, Source, SourceKind, no_inputs, open_source, register, source_flags, source_inputs,
    sources_help, split_help,
)  # fmt: skip
from ssl_vit.data.convert import digits, synthetic, imagefolder, cifar, idx, npz, wds, imagenet, hf  # noqa: F401
from ssl_vit.data.convert import ade20k, voc, mosaic, tiff, eurosat  # noqa: F401

# isort: on

__all__ = [
    "Flag", "Source", "SourceKind", "SOURCES", "no_inputs", "open_source", "register", "source_flags",
    "source_inputs", "sources_help", "split_help",
]  # fmt: skip
