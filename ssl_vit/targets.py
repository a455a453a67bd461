"""What masked-patch objectives predict, computed for a whole batch on the images' device.

RGB images are `[B, 3, H, W]` floats in [0, 1]: callers undo the input normalisation first. Images of
any other band count C (multispectral data, 16-bit or float) are given as the model sees them, each band
standardised by its own mean and std: their raw units (reflectances in the thousands) would make a pixel
loss of 1e7, and the targets that work for them (`pixel_targets` per band, `hog`) are what they are on
any per-band scale. The colour targets quantise three RGB bands and refuse others (`check_colour_bands`).
Patches are numbered row-major, the order of timm's patch embedding (conv -> flatten(2) -> transpose).

Legend: B batch, C bands, N patches (H/p * W/p), p patch size.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange, reduce
from torch import Tensor

from ssl_vit.errors import BadValue

LEVELS = 8  # per channel: 3 bits, so 8**3 = 512 colour classes (ViT paper, appendix B.1.2)


def _check_divisible(images: Tensor, size: int, what: str) -> None:
    height, width = images.shape[-2:]
    if height % size or width % size:
        raise BadValue(f"image size {height}x{width} is not divisible by the {what} {size}")


def check_colour_bands(images: Tensor) -> None:
    """One line unless `images` (B, C, H, W) have the 3 bands the colour targets quantise."""
    if images.shape[1] != 3:
        raise BadValue(
            f"the 3-bit colour targets quantise 3 RGB bands; these images have {images.shape[1]}: "
            "use pixel or HOG targets"
        )


def _quantise(colours: Tensor) -> Tensor:
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
    _check_divisible(images, patch_size, "patch size")
    means = reduce(images, "b c (h p1) (w p2) -> b (h w) c", "mean", p1=patch_size, p2=patch_size)
    return _quantise(means)


def mean_color_3bit_4x4(images: Tensor, patch_size: int) -> Tensor:
    """ViT paper's variant: each patch downsized to 4x4 by average pooling, the 16 colours quantised
    as in `mean_color_3bit` -> LongTensor [B, N, 16], sub-blocks row-major within the patch."""
    if patch_size % 4:
        raise BadValue(f"the 4x4 target needs a patch size divisible by 4, got {patch_size}")
    check_colour_bands(images)
    _check_divisible(images, patch_size, "patch size")
    s = patch_size // 4
    means = reduce(images, "b c (h i s1) (w j s2) -> b (h w) (i j) c", "mean", i=4, j=4, s1=s, s2=s)
    return _quantise(means)


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
    _check_divisible(images, patch_size, "patch size")
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


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """Images [B, C, H, W] -> patches [B, N, p*p*C], pixels in MAE's (row, column, band) order."""
    _check_divisible(images, patch_size, "patch size")
    return rearrange(images, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch_size, p2=patch_size)


def unpatchify(patches: Tensor, patch_size: int, grid: tuple[int, int]) -> Tensor:
    """Inverse of `patchify`: patches [B, N, p*p*C] over a (rows, columns) `grid` -> images [B, C, H, W]."""
    return rearrange(
        patches, "b (h w) (p1 p2 c) -> b c (h p1) (w p2)", h=grid[0], w=grid[1], p1=patch_size, p2=patch_size
    )


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


def patch_moments(patches: Tensor, bands: int | None = None) -> tuple[Tensor, Tensor]:
    """The mean and (unbiased) variance of each patch [B, N, p*p*C] over its values, or with `bands` (C)
    of each band of each patch over its pixels: (mean, var), each [B, N, 1] or [B, N, p*p*C]."""
    if bands is None:
        return patches.mean(dim=-1, keepdim=True), patches.var(dim=-1, keepdim=True)
    values = patches.unflatten(-1, (-1, bands))  # (B, N, p*p, C)
    mean, var = values.mean(dim=-2, keepdim=True), values.var(dim=-2, keepdim=True)  # (B, N, 1, C)
    return mean.expand_as(values).flatten(-2), var.expand_as(values).flatten(-2)
