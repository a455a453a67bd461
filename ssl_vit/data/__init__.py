"""Data: the shard format and its limits (`format`: members, manifests, arrays, masks, band statistics);
sources -> WebDataset shards (`writer`); transforms of decoded images (`transforms`: RGB and band
presets, mixing); shards -> batches (`stream`: urls, tar reading, samples, the training and exact-pass
streams, their DataLoaders and workers, positions, identity); `checks` (argument checks, light to
import); `ShardDataModule` (`datamodule`) and its metrics callback `LogSkippedSamples` (`skip_log`).

`ShardDataModule` is imported on first use so that `ssl-vit data convert` does not pay for Lightning.
"""

__all__ = ["ShardDataModule", "LogSkippedSamples"]


def __getattr__(name: str):
    if name == "ShardDataModule":
        from ssl_vit.data.datamodule import ShardDataModule

        return ShardDataModule
    if name == "LogSkippedSamples":
        from ssl_vit.data.skip_log import LogSkippedSamples

        return LogSkippedSamples
    raise AttributeError(f"module 'ssl_vit.data' has no attribute {name!r}")
