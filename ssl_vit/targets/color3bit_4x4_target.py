"""`target: color3bit_4x4`: the ViT paper's variant of `color3bit`: each patch downsized to 4x4, its 16
mean colours predicted as 16 x 512 classes. RGB only, as `color3bit`."""

from __future__ import annotations

import torch
from einops import reduce
from torch import Tensor

from ssl_vit.errors import BadValue
from ssl_vit.targets.color3bit_target import COLOR_CLASSES, MeanColour, check_colour_bands, quantise
from ssl_vit.targets.patches import check_divisible
from ssl_vit.targets.target import TargetContext, register


def mean_color_3bit_4x4(images: Tensor, patch_size: int) -> Tensor:
    """ViT paper's variant: each patch downsized to 4x4 by average pooling, the 16 colours quantised
    as in `mean_color_3bit` -> LongTensor [B, N, 16], sub-blocks row-major within the patch."""
    if patch_size % 4:
        raise BadValue(f"the 4x4 target needs a patch size divisible by 4, got {patch_size}")
    check_colour_bands(images)
    check_divisible(images, patch_size, "patch size")
    s = patch_size // 4
    means = reduce(images, "b c (h i s1) (w j s2) -> b (h w) (i j) c", "mean", i=4, j=4, s1=s, s2=s)
    return quantise(means)


@register
class MeanColour4x4(MeanColour):
    NAME = "color3bit_4x4"

    def shape(self, ctx: TargetContext) -> torch.Size:
        return torch.Size([16, COLOR_CLASSES])

    classes = staticmethod(mean_color_3bit_4x4)  # (B, N, 16) class ids
