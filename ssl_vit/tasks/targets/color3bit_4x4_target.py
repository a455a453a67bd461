"""`target: color3bit_4x4`: the ViT paper's variant of `color3bit`: each patch downsized to 4x4, its 16
mean colours predicted as 16 x 512 classes (`ssl_vit.targets.mean_color_3bit_4x4`). RGB only, as
`color3bit`."""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_vit import targets
from ssl_vit.tasks.target import register
from ssl_vit.tasks.targets.color3bit_target import COLOR_CLASSES, MeanColour


@register
class MeanColour4x4(MeanColour):
    NAME = "color3bit_4x4"

    def shape(self, task) -> torch.Size:
        return torch.Size([16, COLOR_CLASSES])

    def classes(self, pixels: Tensor, patch_size: int) -> Tensor:
        """pixels: (B, 3, H, W) in [0, 1] -> (B, N, 16) class ids."""
        return targets.mean_color_3bit_4x4(pixels, patch_size)
