"""Data: the shard format and its limits (`format`); transforms of images (`transforms`); shards ->
batches (`stream`); image sources -> WebDataset shards (`convert`); `checks` (argument checks, light to
import), `inspect` (`ssl-vit data inspect`); `ShardDataModule` (`datamodule`, its options in `options`)
and its metrics callback `LogSkippedSamples` (`skip_log`).

`ShardDataModule` is imported on first use so that `ssl-vit data convert` does not pay for Lightning.
"""

import importlib

_LAZY = {"ShardDataModule": "ssl_vit.data.datamodule", "LogSkippedSamples": "ssl_vit.data.skip_log"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'ssl_vit.data' has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)
