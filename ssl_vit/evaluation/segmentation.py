"""Per-image statistics of a segmentation and the metrics they make: mIoU and pixel accuracy.

mIoU is a ratio of sums over the test set (per class: intersections summed over images, divided by
unions summed over images; then the mean over classes), not a mean of per-image IoUs (mmseg's
`IoUMetric`, the ADE20K benchmark's own). So each image contributes its per-class intersection and
union pixel counts, and the metric is computed from their (bootstrap-weighted) sums: the intervals of
`ssl_vit.evaluation.stats` then resample images as for accuracy. A class with no pixel in the
predictions or the masks of a sample has no IoU there and is left out of the mean (nan), as mmseg does.

Legend: B images, H x W mask pixels, K classes; masks hold a class per pixel, 255 ignored.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_vit.data.format.masks import IGNORE_INDEX
from ssl_vit.evaluation.stats import Metric


def intersections_and_unions(predicted: Tensor, masks: Tensor, num_classes: int) -> Tensor:
    """predicted (B, H, W) class indices, masks (B, H, W) with IGNORE_INDEX where unlabelled -> (B, 2K)
    float64: per image, each class's intersection pixels, then its union pixels. Pixels whose mask is not
    a class (IGNORE_INDEX) count in neither."""
    batch = predicted.shape[0]
    valid = masks.long() < num_classes
    truth = masks.long().where(valid, 0)
    offset = torch.arange(batch, device=masks.device).view(batch, 1, 1) * num_classes
    size = batch * num_classes

    def count(where: Tensor, classes: Tensor) -> Tensor:
        return torch.bincount((classes + offset)[where], minlength=size).view(batch, num_classes)

    hit = count(valid & (predicted == truth), truth)
    union = count(valid, truth) + count(valid, predicted) - hit
    return torch.cat([hit, union], dim=1).double()


def pixel_counts(predicted: Tensor, masks: Tensor) -> Tensor:
    """predicted, masks (B, H, W) -> (B, 2) float64: per image, correctly classified labelled pixels and
    labelled pixels."""
    valid = masks != IGNORE_INDEX
    correct = (valid & (predicted == masks.long())).flatten(1).sum(1)
    return torch.stack([correct, valid.flatten(1).sum(1)], dim=1).double()


def mean_iou(means: Tensor) -> Tensor:
    """(..., 2K) mean intersections then unions -> (...) the mean over classes of intersection / union,
    classes without a pixel (union 0) left out."""
    hit, union = means.chunk(2, dim=-1)
    return (hit / union).where(union > 0, torch.nan).nanmean(-1)


def pixel_ratio(means: Tensor) -> Tensor:
    """(..., 2) mean correct and labelled pixels -> (...) pixel accuracy."""
    return means[..., 0] / means[..., 1]


MIOU = Metric("mIoU", mean_iou)
PIXEL_ACCURACY = Metric("pixel accuracy", pixel_ratio)
