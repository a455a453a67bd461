"""`target: color3bit`: each patch's mean colour, 3 bits per RGB channel: one of 512 classes, learnt with
softmax cross-entropy (the ViT paper's masked patch prediction, appendix B.1.2). It quantises 3 RGB
bands: images of other band counts are refused. The picture draws the true and predicted mean colours."""

from __future__ import annotations

import torch
from einops import reduce
from torch import Tensor

from ssl_vit.errors import BadValue
from ssl_vit.masking import token_index
from ssl_vit.targets.masked_picture import Scene
from ssl_vit.targets.patches import check_divisible
from ssl_vit.targets.target import Target, TargetContext, register

LEVELS = 8  # per channel: 3 bits, so 8**3 = 512 colour classes (ViT paper, appendix B.1.2)
COLOR_CLASSES = LEVELS**3


def check_colour_bands(images: Tensor) -> None:
    """One line unless `images` (B, C, H, W) have the 3 bands the colour targets quantise."""
    if images.shape[1] != 3:
        raise BadValue(
            f"the 3-bit colour targets quantise 3 RGB bands; these images have {images.shape[1]}: "
            "use pixel or HOG targets"
        )


def quantise(colours: Tensor) -> Tensor:
    """Colours [..., 3] in [0, 1] -> class r + 8 g + 64 b [...], each channel in 8 equal bins."""
    bins = (colours * LEVELS).floor().clamp(0, LEVELS - 1).long()
    return bins[..., 0] + LEVELS * bins[..., 1] + LEVELS**2 * bins[..., 2]


def decode_mean_color_3bit(classes: Tensor) -> Tensor:
    """Classes [...] in [0, 512) -> colours [..., 3] at the centres of their bins."""
    bins = torch.stack([classes % LEVELS, classes // LEVELS % LEVELS, classes // LEVELS**2], dim=-1)
    return (bins.float() + 0.5) / LEVELS


def mean_color_3bit(images: Tensor, patch_size: int) -> Tensor:
    """ViT paper's masked-patch target: each patch's mean colour, 3 bits per channel -> LongTensor [B, N]."""
    check_colour_bands(images)
    check_divisible(images, patch_size, "patch size")
    means = reduce(images, "b c (h p1) (w p2) -> b (h w) c", "mean", p1=patch_size, p2=patch_size)
    return quantise(means)


@register
class MeanColour(Target):
    NAME = "color3bit"
    BANDS = 3
    REFUSES = "quantises the mean colour of 3 RGB bands"

    def shape(self, ctx: TargetContext) -> torch.Size:
        return torch.Size([COLOR_CLASSES])

    classes = staticmethod(mean_color_3bit)  # (pixels (B, 3, H, W) in [0, 1], p) -> (B, N) class ids

    def make(self, ctx: TargetContext, images: Tensor) -> Tensor:
        return self.classes(ctx.pixels(images), ctx.patch_size)

    def picture(self, ctx: TargetContext, scene: Scene) -> list[Tensor]:
        """The input, the true mean colours of every patch, then the predicted ones on the masked patches
        (true ones elsewhere)."""
        true = self.classes(scene.pixels, ctx.patch_size)  # (n, N) or (n, N, 16)
        pred = true.clone().scatter_(1, token_index(scene.idx, true), scene.pred.argmax(-1))
        return [scene.pixels, *(_colour_image(classes, ctx.patch_size, ctx.grid) for classes in (true, pred))]


def _colour_image(classes: Tensor, patch_size: int, grid: tuple[int, int]) -> Tensor:
    """Colour classes (n, N) or (n, N, 16) -> (n, 3, H, W), each patch (or 4x4 sub-block) filled."""
    colours = decode_mean_color_3bit(classes)  # (n, N[, 16], 3)
    side = 1 if classes.dim() == 2 else 4
    image = colours.view(classes.shape[0], grid[0], grid[1], side, side, 3)
    image = image.permute(0, 5, 1, 3, 2, 4).reshape(classes.shape[0], 3, grid[0] * side, grid[1] * side)
    return torch.nn.functional.interpolate(image, scale_factor=patch_size // side, mode="nearest")
