"""Data: sources -> WebDataset shards (`writer`); the streaming pipeline, one job per module: `urls`
(expansion, checks, manifests) -> `tar_reader` (tar members) -> `samples` (labels, images, skip
counting) -> `stream` (training and exact-pass streams), with `transforms`; and `ShardDataModule`
(`datamodule`).

`ShardDataModule` is imported on first use so that `ssl-vit data convert` does not pay for Lightning.
"""

__all__ = ["ShardDataModule", "LogSkippedSamples"]


def __getattr__(name: str):
    if name in __all__:
        from ssl_vit.data import datamodule

        return getattr(datamodule, name)
    raise AttributeError(f"module 'ssl_vit.data' has no attribute {name!r}")
