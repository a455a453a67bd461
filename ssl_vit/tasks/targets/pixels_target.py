"""`target: pixels`: each patch's raw pixels, p x p x C values (SimMIM; `ssl_vit.targets.pixel_targets`):
RGB in [0, 1], other band counts as the standardised bands the model sees. The picture pastes the
predicted patches into the input."""

from __future__ import annotations

import torch
from torch import Tensor

from ssl_vit import targets
from ssl_vit.tasks.pictures import Scene, masked_rows, pasted
from ssl_vit.tasks.target import Target, register


@register
class Pixels(Target):
    NAME = "pixels"
    NORMALIZE = False  # each patch standardised by its own statistics (`norm_pixels`)

    def shape(self, task) -> torch.Size:
        return torch.Size([task.patch_size**2 * task.bands])

    def make(self, task, images: Tensor) -> Tensor:
        pixels = task.target_images(images)
        return targets.pixel_targets(pixels, task.patch_size, self.NORMALIZE, per_band=task.bands != 3)

    def picture(self, task, scene: Scene) -> list[Tensor]:
        return masked_rows(task, scene, pasted(task, scene, self.drawn(task, scene)))

    def drawn(self, task, scene: Scene) -> Tensor:
        """The predicted patches (n, M, p*p*C), in the input's units."""
        return scene.pred.float()
