"""`target: seen_pixels`: each patch of the image as the encoder sees it, standardised by the data's mean
and std, p x p x C values (SimMIM's code regresses its ImageNet-standardised input; stable-pretraining's
SimMIM too), where `pixels` maps RGB back to [0, 1] first. Other band counts than 3 are standardised
bands either way, so there it equals `pixels`. The picture maps the prediction back to RGB before
pasting it into the input."""

from __future__ import annotations

from torch import Tensor

from ssl_vit.targets.masked_picture import Scene
from ssl_vit.targets.patches import patchify, unpatchify
from ssl_vit.targets.pixels_target import Pixels
from ssl_vit.targets.target import TargetContext, register


@register
class SeenPixels(Pixels):
    NAME = "seen_pixels"

    def make(self, ctx: TargetContext, images: Tensor) -> Tensor:
        return patchify(images, ctx.patch_size)

    def drawn(self, ctx: TargetContext, scene: Scene) -> Tensor:
        # Each predicted patch as a one-patch image, so that the task's own map from model inputs to
        # pixels (`TargetContext.pixels`: the standardisation undone for RGB) applies to it unchanged.
        n, masked = scene.pred.shape[:2]
        cells = scene.pred.float().flatten(0, 1)[:, None]  # (n*M, 1, p*p*C)
        cells = unpatchify(cells, ctx.patch_size, (1, 1))  # (n*M, C, p, p)
        return patchify(ctx.pixels(cells), ctx.patch_size).view(n, masked, -1)
