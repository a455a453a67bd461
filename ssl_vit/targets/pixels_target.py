"""`target: pixels`: each patch's raw pixels, p x p x C values: RGB in [0, 1], other band counts as the
standardised bands the model sees (`seen_pixels`: RGB standardised too, as SimMIM's code). The picture
pastes the predicted patches into the input."""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_vit.targets.masked_picture import Scene, masked_rows, pasted
from ssl_vit.targets.patches import patch_moments, patchify
from ssl_vit.targets.target import Target, TargetContext, register


def pixel_targets(
    images: Tensor, patch_size: int, normalize: bool = False, per_band: bool = False, eps: float = 1e-6
) -> Tensor:
    """Pixel regression targets [B, N, p*p*C]: raw patches, or with `normalize` each patch standardised
    by its own mean and (unbiased) variance, exactly MAE's `forward_loss` with norm_pix_loss
    (He et al. 2021, sec 3 "Reconstruction target"; models_mae.py). With `per_band` (multispectral
    images), each band of each patch by its own: bands of other units and ranges are not mixed."""
    target = patchify(images, patch_size)
    if normalize:
        mean, var = patch_moments(target, images.shape[1] if per_band else None)
        target = (target - mean) / (var + eps) ** 0.5
    return target


@register
class Pixels(Target):
    NAME = "pixels"
    NORMALIZE = False  # each patch standardised by its own statistics (`norm_pixels`)

    def shape(self, ctx: TargetContext) -> torch.Size:
        return torch.Size([ctx.patch_size**2 * ctx.bands])

    def make(self, ctx: TargetContext, images: Tensor) -> Tensor:
        return pixel_targets(ctx.pixels(images), ctx.patch_size, self.NORMALIZE, per_band=ctx.bands != 3)

    def picture(self, ctx: TargetContext, scene: Scene) -> list[Tensor]:
        return masked_rows(ctx, scene, pasted(ctx, scene, self.drawn(ctx, scene)))

    def drawn(self, ctx: TargetContext, scene: Scene) -> Tensor:
        """The predicted patches (n, M, p*p*C), in the input's units."""
        return scene.pred.float()
