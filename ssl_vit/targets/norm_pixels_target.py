"""`target: norm_pixels`: each patch's pixels standardised by its own mean and variance, each band on its
own for other band counts than 3 (MAE's norm_pix_loss; `pixels_target.pixel_targets`). The picture
undoes the standardisation with the true patch's statistics before pasting the prediction back."""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_vit.masking import token_index
from ssl_vit.targets.masked_picture import Scene
from ssl_vit.targets.patches import patch_moments, patchify
from ssl_vit.targets.pixels_target import Pixels
from ssl_vit.targets.target import TargetContext, register


@register
class NormPixels(Pixels):
    NAME = "norm_pixels"
    NORMALIZE = True

    def drawn(self, ctx: TargetContext, scene: Scene) -> Tensor:
        patches = patchify(scene.pixels, ctx.patch_size)  # (n, N, p*p*C)
        true = torch.gather(patches, 1, token_index(scene.idx, patches))
        mean, var = patch_moments(true, None if ctx.bands == 3 else ctx.bands)
        return scene.pred.float() * (var + 1e-6).sqrt() + mean
