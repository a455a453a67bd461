"""Supervised pretraining: the ViT paper's baseline the SSL checkpoints are compared against."""

from __future__ import annotations

import math
from typing import Literal

import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from ssl_vit.errors import BadValue
from ssl_vit.models.heads import zero_linear
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks.base import BackboneTask, Training, step_inputs


class SupervisedPretraining(BackboneTask):
    """Classification pretraining on the pooled output (the `[class]` token or the mean of patches).

    Args:
        num_classes: classes of the head (the shards' manifest says how many).
        loss: `softmax` cross-entropy, or `sigmoid` cross-entropy for multi-label sets (ViT paper on
            JFT). Soft targets (the datamodule's `target`: timm's mixup/cutmix/label smoothing, applied to
            whole batches on the device) are used when present, hard labels otherwise.
        head_bias_init: initial bias of the zero-initialised head; default 0 for softmax and -log(K)
            for sigmoid, so the initial sigmoid loss is small (big_vision's `head_bias_init`).
        training: see `Training`; `training.init_from` starts the backbone from e.g. an SSL checkpoint.
    """

    NEEDS_LABELS = True  # the data module skips and counts unlabelled samples (label -1)

    def __init__(
        self,
        backbone: ViTConfig,
        num_classes: int,
        loss: Literal["softmax", "sigmoid"] = "softmax",
        head_bias_init: float | None = None,
        training: Training = Training(),
    ) -> None:
        if loss not in ("softmax", "sigmoid"):
            raise BadValue(f"unknown loss {loss!r}; valid: 'softmax', 'sigmoid'")
        if num_classes < 1:
            raise BadValue(f"num_classes must be positive, got {num_classes}")
        super().__init__(
            backbone,
            training,
            hparams=dict(num_classes=num_classes, loss=loss),
        )
        if head_bias_init is None:
            head_bias_init = -math.log(num_classes) if loss == "sigmoid" else 0.0
        self.head = zero_linear(self.backbone.embed_dim, num_classes, bias_init=head_bias_init)
        self.loss_kind, self.num_classes = loss, num_classes
        self.tokens_per_image = 1 + self.backbone.grid_size[0] * self.backbone.grid_size[1]
        # One per evaluation stage: a metric logged as an object is computed and reset by its own loop.
        self.val_accuracy = MulticlassAccuracy(num_classes, average="micro", ignore_index=-1)
        self.test_accuracy = MulticlassAccuracy(num_classes, average="micro", ignore_index=-1)

    def forward(self, images: Tensor) -> Tensor:
        """images: (B, 3, H, W) -> logits (B, K)."""
        return self.head(self.backbone.forward_tokens(images).pooled)

    def forward_loss(self, logits: Tensor, batch: dict) -> Tensor:
        labels = batch["label"]
        target = batch.get("target")  # (B, K) soft targets from mixup/cutmix
        if self.loss_kind == "softmax":
            if target is not None:
                return F.cross_entropy(logits, target)
            return F.cross_entropy(logits, labels, ignore_index=-1)
        # Sum over classes, mean over labelled images: big_vision's sigmoid_xent. Unlabelled (-1) images
        # are weighted out rather than indexed out: boolean indexing would sync the host every step.
        weight = (labels >= 0).to(logits.dtype)
        if target is None:
            target = F.one_hot(labels.clamp(min=0), self.num_classes).to(logits.dtype)
        per_image = F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(-1)
        return (per_image * weight).sum() / weight.sum().clamp(min=1)

    def train_loss(self, batch: dict[str, Tensor]) -> Tensor:
        return self.forward_loss(self(batch["image"]), batch)

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        loss = self.train_loss(step_inputs(batch))
        self.log("train/loss", loss, on_step=True, prog_bar=True, batch_size=batch["image"].shape[0])
        return loss

    def eval_step(self, stage: str, batch: dict, batch_idx: int) -> None:
        """`{stage}/loss` and `{stage}/accuracy` over the whole pass (every rank's samples once)."""
        logits = self(batch["image"])
        accuracy = getattr(self, f"{stage}_accuracy")
        accuracy.update(logits, batch["label"])
        size = logits.shape[0]
        self.log(
            f"{stage}/loss", self.forward_loss(logits, batch), on_epoch=True, sync_dist=True, batch_size=size
        )
        self.log(f"{stage}/accuracy", accuracy, on_epoch=True, prog_bar=True, batch_size=size)
