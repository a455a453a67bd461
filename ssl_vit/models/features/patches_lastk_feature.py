"""`feature: patches_lastk`: the patch tokens of each of the last k blocks, each through the final norm,
concatenated per token (B, N, k x D): the dense counterpart of `lastk` (DINOv2's linear segmentation
reads the last blocks' patch tokens)."""

import torch

from ssl_vit.models.feature import Feature, register


def _patches_lastk(r):
    return torch.cat([x[:, r.prefix :] for x in r.blocks], dim=2)


register(
    Feature(
        "patches_lastk", "last blocks' patch tokens", _patches_lastk, pooled=False, blocks=True, grid=True
    )
)
