"""Linear probing: a frozen backbone and linear heads on its features, several learning rates at once.

Legend: B batch, D width, K classes, H heads (one per learning rate).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.optim import SGD, Optimizer

from ssl_vit.errors import BadValue
from ssl_vit.models.heads import zero_linear
from ssl_vit.models.vit import ViTConfig, WidthFeature
from ssl_vit.tasks.base import Training
from ssl_vit.tasks.frozen_probe import FrozenProbe


def sgd_momentum(params) -> Optimizer:
    """The default probe optimizer: SGD, momentum 0.9, no weight decay (each head's lr is set per group)."""
    return SGD(params, lr=0.1, momentum=0.9, weight_decay=0.0)


class LinearProbe(FrozenProbe):
    """Zero-initialised linear heads, one per learning rate, on one pooled feature per image of a
    frozen backbone (`FrozenProbe`): the ViT paper's linear evaluation, MAE's (sec 4, appendix A.2).

    Args:
        num_classes: classes of the heads (linked from the data).
        feature: `cls`, the [class] token (MAE's probe), or `mean` of the patch tokens.
        batch_norm: BatchNorm without affine parameters before the heads (MAE's protocol: it normalises
            the features, so one lr grid suits every checkpoint).
        lrs: one head per learning rate, each head one param group with its lr in place of the
            optimizer's, per `training.lr_reference_batch` images when that is set (MAE: base lr 0.1).
            Metrics are named by these values: `val/accuracy_lr0.1`.
        training: see `Training`; `init_from` is the probed checkpoint. The optimizer is SGD with
            momentum 0.9 and no weight decay by default; MAE's LARS is `class_path: timm.optim.Lars` (with
            `always_adapt: true`: timm's LARS adapts only with weight decay otherwise, MAE's always does).
    """

    def __init__(
        self,
        backbone: ViTConfig,
        num_classes: int,
        feature: WidthFeature = "cls",
        batch_norm: bool = True,
        lrs: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
        training: Training = Training(optimizer=sgd_momentum),
    ) -> None:
        lrs = [float(lr) for lr in lrs]
        if not lrs or len(set(lrs)) != len(lrs) or min(lrs) <= 0:
            raise BadValue(f"lrs must be distinct positive learning rates, got {lrs}")
        super().__init__(
            backbone, num_classes, lrs, None, training, hparams=dict(feature=feature, batch_norm=batch_norm)
        )
        self.backbone.check_feature(feature, kinds=WidthFeature.valid())
        self.feature = feature
        width = self.backbone.embed_dim
        # MAE: BatchNorm1d(affine=False, eps=1e-6) in front of the head; shared, as it learns nothing.
        self.norm = nn.BatchNorm1d(width, affine=False, eps=1e-6) if batch_norm else nn.Identity()
        self.heads.extend(zero_linear(width, num_classes) for _ in lrs)
        self.tokens_per_image = 1 + self.backbone.grid_size[0] * self.backbone.grid_size[1]

    def classify(self, features: Tensor, head: int | None = None) -> Tensor:
        """features: (B, D) -> logits of every head (H, B, K), or of head `head` only (1, B, K)."""
        features = self.norm(features)
        return torch.stack([h(features) for h in self.chosen(head)])


__all__ = ["LinearProbe", "sgd_momentum"]
