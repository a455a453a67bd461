"""`target: color3bit`: each patch's mean colour, 3 bits per RGB channel: one of 512 classes, learnt with
softmax cross-entropy (the ViT paper's masked patch prediction, appendix B.1.2;
`ssl_vit.targets.mean_color_3bit`). It quantises 3 RGB bands: images of other band counts are refused."""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_vit import targets
from ssl_vit.tasks.pictures import Scene, colour_rows
from ssl_vit.tasks.target import Target, register

COLOR_CLASSES = targets.LEVELS**3  # 512


@register
class MeanColour(Target):
    NAME = "color3bit"
    BANDS = 3
    REFUSES = "quantises the mean colour of 3 RGB bands"

    def shape(self, task) -> torch.Size:
        return torch.Size([COLOR_CLASSES])

    def classes(self, pixels: Tensor, patch_size: int) -> Tensor:
        """pixels: (B, 3, H, W) in [0, 1] -> (B, N) class ids."""
        return targets.mean_color_3bit(pixels, patch_size)

    def make(self, task, images: Tensor) -> Tensor:
        return self.classes(task.target_images(images), task.patch_size)

    def picture(self, task, scene: Scene) -> list[Tensor]:
        return colour_rows(task, scene, self.classes(scene.pixels, task.patch_size))
