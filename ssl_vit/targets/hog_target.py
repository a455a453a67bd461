"""`target: hog`: MaskFeat's histograms of oriented gradients of each patch's cells (`hog`). With no
pixels to paste back, the picture fills each masked patch with the cosine similarity of its predicted
and true histograms as a grey level (white: exact).

Legend: as in `target`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from torch import Tensor

from ssl_vit.targets.masked_picture import Scene, filled, masked_rows
from ssl_vit.targets.patches import check_divisible
from ssl_vit.targets.target import Target, TargetContext, register

HOG_BINS = 9  # unsigned orientations in 20-degree bins (MaskFeat, Wei et al. 2022, sec 4.1; Dalal & Triggs)
HOG_CELL = 8  # pixels per cell side: 2 x 2 cells per 16-pixel patch, MaskFeat's 108 values per patch


def hog_cell_size(patch_size: int) -> int:
    """MaskFeat's 8-pixel cells where they tile the patch; otherwise (the 4-pixel patches of the tiny
    recipes, 14-pixel patches) the patch is one cell."""
    return HOG_CELL if patch_size % HOG_CELL == 0 else patch_size


def hog(images: Tensor, patch_size: int) -> Tensor:
    """MaskFeat's target: per patch, the histograms of oriented gradients of its cells, each band's on
    its own, concatenated -> [B, N, C * 9 * (p/c)^2] in (band, bin, cell row, cell column) order,
    c = `hog_cell_size(p)`. MaskFeat computes it per RGB channel (C = 3: 108 values for a 16-pixel
    patch); any other band count the same way, band after band: 13 Sentinel-2 bands give 13 x 108 =
    1,404 values per 16-pixel patch, 13 x 9 = 117 for the one-cell patches below 8 pixels.

    The recipe of MaskFeat's released code (SlowFast `operators.HOGLayerC`, without its optional
    Gaussian window, which the paper does not use): Sobel gradients of each channel with reflected
    borders; each pixel votes its gradient magnitude into one of 9 unsigned-orientation bins (hard
    assignment); votes are summed per cell and each cell's histogram is L2-normalised on its own
    ("local contrast normalisation", which the paper finds essential), no block normalisation. Angles
    are measured as in Dalal & Triggs and scikit-image (atan2(d/drow, d/dcolumn), bin k covers
    [20k, 20k + 20) degrees); HOGLayerC's atan2(gx, gy) shifts its bin edges by 10 degrees, which
    changes nothing the model learns from. As there, a gradient on a bin edge goes to either side by
    rounding: exactly horizontal gradients of quantised images, whose row component cancels to 0 or
    +-1e-8, fall into bin 0 or bin 8, the same orientation on both sides of 0/180 degrees. A scale and
    offset per band (the model's mean/std normalisation) leaves the target unchanged, up to the
    normalisation's epsilon in flat cells: the same for standardised multispectral bands as for their
    raw units.

    Written here because torchvision, timm and kornia have no batched HOG (scikit-image's runs on the
    CPU, image by image): element-wise work and reductions on the images' device, in float32 (or the
    input's wider type) even under autocast, since bf16 gradients would move votes between bins.
    """
    check_divisible(images, patch_size, "patch size")
    cell = hog_cell_size(patch_size)
    with torch.autocast(images.device.type, enabled=False):
        x = F.pad(images.to(torch.promote_types(images.dtype, torch.float32)), (1, 1, 1, 1), mode="reflect")
        # Sobel as differences and [1, 2, 1] smoothing along the other axis: slices, no kernel tensor.
        dx = x[..., 2:] - x[..., :-2]  # (B, C, H+2, W)
        dy = x[..., 2:, :] - x[..., :-2, :]  # (B, C, H, W+2)
        gx = dx[..., :-2, :] + 2 * dx[..., 1:-1, :] + dx[..., 2:, :]  # (B, C, H, W) d/dcolumn
        gy = dy[..., :-2] + 2 * dy[..., 1:-1] + dy[..., 2:]  # (B, C, H, W) d/drow
        bins = torch.floor(torch.atan2(gy, gx) * (HOG_BINS / math.pi)).long() % HOG_BINS  # unsigned
        levels = torch.arange(HOG_BINS, device=x.device)
        votes = torch.hypot(gx, gy)[..., None] * (bins[..., None] == levels)  # (B, C, H, W, 9)
        cells = reduce(votes, "b c (h c1) (w c2) k -> b c h w k", "sum", c1=cell, c2=cell)
        cells = F.normalize(cells, dim=-1)  # per cell and band, over the 9 bins
    per = patch_size // cell
    return rearrange(cells, "b c (h i) (w j) k -> b (h w) (c k i j)", i=per, j=per)


@register
class Hog(Target):
    NAME = "hog"

    def shape(self, ctx: TargetContext) -> torch.Size:
        cells = (ctx.patch_size // hog_cell_size(ctx.patch_size)) ** 2
        return torch.Size([ctx.bands * HOG_BINS * cells])

    def make(self, ctx: TargetContext, images: Tensor) -> Tensor:
        return hog(ctx.pixels(images), ctx.patch_size)

    def picture(self, ctx: TargetContext, scene: Scene) -> list[Tensor]:
        agreement = F.cosine_similarity(scene.pred.float(), scene.target.float(), dim=-1)  # (n, M)
        return masked_rows(ctx, scene, filled(ctx, scene, agreement.clamp(0, 1)))
