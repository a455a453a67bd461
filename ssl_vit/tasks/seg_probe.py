"""Linear segmentation probing: a linear classifier on every frozen patch token, its class map
upsampled to the mask, one per learning rate, all trained on the same frozen tokens.

DINOv2's linear evaluation of dense features (Oquab et al. 2023, sec 7.4 "linear": BatchNorm, then a
1x1 convolution on the patch tokens, logits upsampled bilinearly to the label resolution; "+ms" reads
the last four blocks, here `feature: lastk`), which CAPI reports too. The loss is cross-entropy over the
mask's pixels, 255 ignored, as mmseg's.

Legend: B batch, N = h x w patch tokens, D width (k x D for `lastk`), K classes, H heads, (Hm, Wm) mask.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ssl_vit.data.format.masks import IGNORE_INDEX
from ssl_vit.models.feature import FEATURES
from ssl_vit.models.heads import zero_linear
from ssl_vit.models.vit import LAST_K, ViTConfig
from ssl_vit.tasks.base import Training
from ssl_vit.tasks.frozen_probe import FrozenProbe
from ssl_vit.tasks.linear_probe import sgd_momentum

# The per-token features over the patch grid (`feature`).
PatchFeature = FEATURES.choice("PatchFeature", pooled=False, grid=True)


def upsample(logits: Tensor, size: tuple[int, int]) -> Tensor:
    """(B, K, h, w) class map -> (B, K, Hm, Wm), bilinear (DINOv2's and mmseg's resize of the logits)."""
    return F.interpolate(logits, size=size, mode="bilinear", align_corners=False)


class LinearSegProbe(FrozenProbe):
    """Per-patch linear classifiers on a frozen backbone, one per learning rate.

    Args:
        num_classes, lrs, training: as `LinearProbe` (num_classes: the mask's classes, 255 aside).
        feature: `patches` (the last block's patch tokens) or `patches_lastk` (the last 4 blocks').
        batch_norm: BatchNorm without affine parameters over the tokens' channels before the heads.
    """

    TARGET = "mask"
    IGNORED = IGNORE_INDEX  # mask pixels without a class
    NEEDS_LABELS = False  # masks, not image labels

    def __init__(
        self,
        backbone: ViTConfig,
        num_classes: int,
        feature: PatchFeature = "patches",
        batch_norm: bool = True,
        lrs: tuple[float, ...] = (0.01, 0.1),
        training: Training = Training(optimizer=sgd_momentum),
    ) -> None:
        hparams = dict(feature=feature, batch_norm=batch_norm)
        super().__init__(backbone, num_classes, list(lrs), None, training, hparams=hparams)
        self.backbone.check_feature(feature, LAST_K, kinds=PatchFeature.valid())
        self.feature = feature
        width = FEATURES[feature].size(0, 0, self.backbone.embed_dim, LAST_K)[1]
        self.norm = nn.BatchNorm1d(width, affine=False, eps=1e-6) if batch_norm else nn.Identity()
        self.heads.extend(zero_linear(width, num_classes) for _ in self.lrs)
        self.tokens_per_image = self.backbone.grid_size[0] * self.backbone.grid_size[1]

    def classify(self, features: Tensor, head: int | None = None) -> Tensor:
        """patch tokens (B, N, D) -> every head's class map at the patch grid (H, B, K, h, w), or head
        `head`'s only (1, B, K, h, w)."""
        tokens = self.norm(features.transpose(1, 2)).transpose(1, 2)
        h, w = self.backbone.grid_size
        return torch.stack([c(tokens).transpose(1, 2).unflatten(2, (h, w)) for c in self.chosen(head)])

    def scored(self, outputs: Tensor, targets: Tensor) -> Iterator[Tensor]:
        """Each head's class map upsampled to the masks (B, K, Hm, Wm), one head at a time: its pixels'
        accuracy."""
        return (upsample(head, targets.shape[-2:]) for head in outputs)

    def head_losses(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """Every head's (H, B, K, h, w) class map against masks (B, Hm, Wm): each head's cross-entropy per
        pixel of its logits upsampled to the mask, pixels of 255 ignored (H,). All heads in one
        upsampling and one cross-entropy."""
        heads = outputs.shape[0]
        logits = upsample(outputs.flatten(0, 1), targets.shape[-2:])  # (H B, K, Hm, Wm)
        labels = targets.long().repeat(heads, 1, 1)
        per_pixel = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
        labelled = (targets != IGNORE_INDEX).sum().clamp_min(1)  # the same pixels for every head
        return per_pixel.unflatten(0, (heads, -1)).flatten(1).sum(1) / labelled


__all__ = ["LinearSegProbe", "PatchFeature", "upsample"]
