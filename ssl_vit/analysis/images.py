"""A few images of a split, exactly as evaluation sees them: the project's data pipeline, the eval
transform (resize, centre crop), normalised."""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_vit.data import ShardDataModule
from ssl_vit.errors import UserError


def read_images(datamodule: ShardDataModule, split: str, count: int) -> tuple[Tensor, list[str]]:
    """The first `count` images of an exact pass over `split` (fewer if the split is smaller).

    Returns (images (n, 3, H, W) float32, normalised as the model takes them, their `__key__`s).
    A split that yields no image is a UserError.
    """
    images, keys = [], []
    for batch in datamodule.exact_dataloader(split):
        batch = datamodule.prepare_batch(batch)
        images.append(batch["image"][: count - len(keys)])
        keys.extend(batch["key"][: count - len(keys)])
        if len(keys) >= count:
            break
    if not keys:
        urls = getattr(datamodule, f"{split}_urls")
        raise UserError(
            f"{urls} yielded no images: give shard URLs that hold samples (ssl-vit data inspect URLS)"
        )
    return torch.cat(images), keys
