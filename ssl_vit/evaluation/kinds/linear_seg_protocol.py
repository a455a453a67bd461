"""`kind: linear_seg`: a linear classifier on every frozen patch token, upsampled to the mask
(DINOv2's linear segmentation probe, `ssl_vit.tasks.LinearSegProbe`), one per learning rate, chosen on
held-out training images by mIoU; scored on the test split by mIoU and pixel accuracy, each with a
bootstrap interval over test images (`ssl_vit.evaluation.segmentation`).

The data are shards whose samples carry a `seg.png` mask (255 ignored): `ssl-vit data convert
ade20k:DIR`, `voc:DIR`, or `mosaic:URLS` for a dense task built from a labelled set.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic.dataclasses import dataclass
from torch import Tensor

from ssl_vit.errors import UserError
from ssl_vit.evaluation.features import Features
from ssl_vit.evaluation.kinds.probe_protocol import ProbeProtocol
from ssl_vit.evaluation.protocol import STRICT, register
from ssl_vit.evaluation.segmentation import (
    MIOU,
    PIXEL_ACCURACY,
    intersections_and_unions,
    mean_iou,
    pixel_counts,
)
from ssl_vit.evaluation.stats import Metric, Score
from ssl_vit.evaluation.trained import task_training
from ssl_vit.models.feature import FEATURES
from ssl_vit.tasks.seg_probe import LinearSegProbe, upsample

SUFFIXES = ("miou", "pixel_acc")  # its columns per label fraction: NAME_miou, NAME_pixel_acc


def _mean_iou_of_all(means: Tensor) -> Tensor:
    """mIoU from the protocol's whole statistics (..., 2K + 2): intersections and unions, then pixels."""
    return mean_iou(means[..., :-2])


@register
@dataclass(config=STRICT)
class LinearSegProtocol(ProbeProtocol):
    """Per-patch linear heads on the frozen `patches` (the last block's) or `lastk` (the last 4 blocks'
    patch tokens, concatenated); columns `SUFFIXES` (a label fraction: of the training images)."""

    feature: Literal["patches", "lastk"] = "patches"
    batch_norm: bool = True

    KIND: ClassVar[str] = "linear_seg"
    TITLE: ClassVar[str] = "linear segmentation"
    NOTHING_TO_SCORE: ClassVar[str] = "no labelled pixel in the test masks (every one 255, ignored) to score"
    TARGET: ClassVar[str] = "mask"

    def columns(self) -> list[str]:
        return [f"{column}_{suffix}" for column in super().columns() for suffix in SUFFIXES]

    def result_column(self, fraction: float) -> str:
        return f"{self.column(fraction)}_miou"

    def metric(self, column: str) -> Metric:
        return PIXEL_ACCURACY if column.endswith("_pixel_acc") else MIOU

    def describe(self, column: str) -> str:
        return f"{column} ({self.TITLE}, {self.metric(column).name}, {FEATURES[self._kind()].words})"

    def _kind(self) -> str:
        return "patches_lastk" if self.feature == "lastk" else "patches"

    def cached_kind(self) -> str | None:
        return self._kind() if self.augmentation == "eval" else None

    def settle(self, data, backbone, where) -> None:
        if self.classes is not None:
            raise UserError(
                f"{where}: classes keeps images by label; a segmentation reads every mask: drop it"
            )
        if self.randaugment is not None:
            raise UserError(
                f"{where}: randaugment changes an image's pixels without its mask's: a segmentation takes "
                "augmentation pretrain (crops and flips, which its masks follow) or eval"
            )
        super().settle(data, backbone, where)

    def targets(self, found: Features) -> Tensor:
        if found.mask is None:
            raise UserError(
                f"protocol {self.name!r}: the dataset's samples carry no seg.png masks: give shards written "
                "by `ssl-vit data convert` from ade20k:, voc: or mosaic:"
            )
        return found.mask

    def statistics(self, outputs: Tensor, targets: Tensor) -> Tensor:
        """(C, B, K, h, w) class maps, (B, Hm, Wm) masks -> (C, B, 2K + 2): per head and image, each
        class's intersection and union pixels, then correct and labelled pixels."""
        classes = outputs.shape[2]
        found = []
        for maps in outputs:  # one head at a time: scoring needs no graph, so nothing need be kept
            predicted = upsample(maps.float(), targets.shape[-2:]).argmax(1)
            found.append(
                torch.cat(
                    [intersections_and_unions(predicted, targets, classes), pixel_counts(predicted, targets)],
                    1,
                )
            )
        return torch.stack(found)

    def selection_metric(self) -> Metric:
        return Metric(MIOU.name, _mean_iou_of_all)

    def test_scores(self, found: Tensor) -> dict[str | None, Score]:
        return {
            "miou": Score(found[None, ..., :-2], MIOU),
            "pixel_acc": Score(found[None, ..., -2:], PIXEL_ACCURACY),
        }

    def build(self, features, config):
        return LinearSegProbe(
            backbone=config,
            num_classes=features.num_classes(),
            feature=self._kind(),
            lrs=list(self.lrs),
            batch_norm=self.batch_norm,
            training=task_training(self, self.lrs[0], features),
        )
