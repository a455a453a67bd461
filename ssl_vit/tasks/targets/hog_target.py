"""`target: hog`: the histograms of oriented gradients of each patch's cells (MaskFeat, Wei et al. 2022;
`ssl_vit.targets.hog`, 8-pixel cells, or the whole patch when 8 does not divide it): C x 9 x cells
values, each band's own for other band counts than 3. With no pixels to paste back, the picture fills
each masked patch with the cosine similarity of its predicted and true histograms as a grey level
(white: exact)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_vit import targets
from ssl_vit.tasks.pictures import Scene, filled, masked_rows
from ssl_vit.tasks.target import Target, register


@register
class Hog(Target):
    NAME = "hog"

    def shape(self, task) -> torch.Size:
        cells = (task.patch_size // targets.hog_cell_size(task.patch_size)) ** 2
        return torch.Size([task.bands * targets.HOG_BINS * cells])

    def make(self, task, images: Tensor) -> Tensor:
        return targets.hog(task.target_images(images), task.patch_size)

    def picture(self, task, scene: Scene) -> list[Tensor]:
        agreement = F.cosine_similarity(scene.pred.float(), scene.target.float(), dim=-1).clamp(
            0, 1
        )  # (n, M)
        return masked_rows(task, scene, filled(task, scene, agreement))
