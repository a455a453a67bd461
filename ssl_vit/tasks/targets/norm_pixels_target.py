"""`target: norm_pixels`: each patch's pixels standardised by the patch's own mean and variance (MAE's
norm_pix_loss, He et al. 2021 sec 3; `ssl_vit.targets.pixel_targets`); for other band counts than 3,
each band of each patch on its own. The picture undoes the standardisation with the true patch's
statistics before pasting the prediction back."""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_vit import targets
from ssl_vit.masking import token_index
from ssl_vit.tasks.pictures import Scene
from ssl_vit.tasks.target import register
from ssl_vit.tasks.targets.pixels_target import Pixels


@register
class NormPixels(Pixels):
    NAME = "norm_pixels"
    NORMALIZE = True

    def drawn(self, task, scene: Scene) -> Tensor:
        patches = targets.patchify(scene.pixels, task.patch_size)  # (n, N, p*p*C)
        true = torch.gather(patches, 1, token_index(scene.idx, patches))
        mean, var = targets.patch_moments(true, None if task.bands == 3 else task.bands)
        return scene.pred.float() * (var + 1e-6).sqrt() + mean
