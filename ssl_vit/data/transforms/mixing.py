"""Mixup, cutmix and label smoothing (timm) of whole training batches, on the device the batch is on:
the images blended and a soft `target` float [B, K] added to the batch (the data module's
`augment.mixup_alpha`, `cutmix_alpha`, `label_smoothing`)."""

from __future__ import annotations

from timm.data import Mixup
from timm.data.mixup import mixup_target

from ssl_vit.errors import UserError


class Mixing:
    """timm's `Mixup` over training batches (dicts with `image` [B,C,H,W] and `label` [B]), built at the
    first batch, when the class count is known."""

    def __init__(self, mixup_alpha: float, cutmix_alpha: float, label_smoothing: float) -> None:
        self.args = {
            "mixup_alpha": mixup_alpha,
            "cutmix_alpha": cutmix_alpha,
            "label_smoothing": label_smoothing,
        }
        self.mixup: Mixup | None = None

    def __call__(self, batch: dict, num_classes: int | None) -> dict:
        """`batch` with its images mixed and its soft `target` [B, num_classes]; one line for shards with
        masks (mixup would blend images but not masks) or without a class count."""
        blends = bool(self.args["mixup_alpha"] or self.args["cutmix_alpha"])
        if "mask" in batch and blends:
            raise UserError(
                "mixup/cutmix blend images but not their segmentation masks (seg.png): set "
                "data.init_args.augment.mixup_alpha and cutmix_alpha to 0 for shards with masks"
            )
        if not num_classes:
            raise UserError("mixup/cutmix/label_smoothing need num_classes: set data.init_args.num_classes")
        if not blends:  # label smoothing alone: timm's Mixup asserts that one of its alphas is set
            smoothing = self.args["label_smoothing"]
            batch["target"] = mixup_target(batch["label"], num_classes, smoothing=smoothing)
            return batch
        if self.mixup is None:
            self.mixup = Mixup(**self.args, num_classes=num_classes)
        batch["image"], batch["target"] = self.mixup(batch["image"], batch["label"])
        return batch
