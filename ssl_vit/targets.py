"""What masked-patch objectives predict, computed for a whole batch on the images' device.

Images are `[B, 3, H, W]` floats in [0, 1]: callers undo the input normalisation first. Patches are
numbered row-major, the order of timm's patch embedding (conv -> flatten(2) -> transpose).

Legend: B batch, N patches (H/p * W/p), p patch size.
"""

from __future__ import annotations

import torch
from einops import rearrange, reduce
from torch import Tensor

from ssl_vit.errors import BadValue

LEVELS = 8  # per channel: 3 bits, so 8**3 = 512 colour classes (ViT paper, appendix B.1.2)


def _check_divisible(images: Tensor, size: int, what: str) -> None:
    height, width = images.shape[-2:]
    if height % size or width % size:
        raise BadValue(f"image size {height}x{width} is not divisible by the {what} {size}")


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
    _check_divisible(images, patch_size, "patch size")
    means = reduce(images, "b c (h p1) (w p2) -> b (h w) c", "mean", p1=patch_size, p2=patch_size)
    return _quantise(means)


def mean_color_3bit_4x4(images: Tensor, patch_size: int) -> Tensor:
    """ViT paper's variant: each patch downsized to 4x4 by average pooling, the 16 colours quantised
    as in `mean_color_3bit` -> LongTensor [B, N, 16], sub-blocks row-major within the patch."""
    if patch_size % 4:
        raise BadValue(f"the 4x4 target needs a patch size divisible by 4, got {patch_size}")
    _check_divisible(images, patch_size, "patch size")
    s = patch_size // 4
    means = reduce(images, "b c (h i s1) (w j s2) -> b (h w) (i j) c", "mean", i=4, j=4, s1=s, s2=s)
    return _quantise(means)


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """Images [B, 3, H, W] -> patches [B, N, p*p*3], pixels in MAE's (row, column, channel) order."""
    _check_divisible(images, patch_size, "patch size")
    return rearrange(images, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch_size, p2=patch_size)


def unpatchify(patches: Tensor, patch_size: int, grid: tuple[int, int]) -> Tensor:
    """Inverse of `patchify`: patches [B, N, p*p*3] over a (rows, columns) `grid` -> images [B, 3, H, W]."""
    return rearrange(
        patches, "b (h w) (p1 p2 c) -> b c (h p1) (w p2)", h=grid[0], w=grid[1], p1=patch_size, p2=patch_size
    )


def pixel_targets(images: Tensor, patch_size: int, normalize: bool = False, eps: float = 1e-6) -> Tensor:
    """Pixel regression targets [B, N, p*p*3]: raw patches, or with `normalize` each patch standardised
    by its own mean and (unbiased) variance, exactly MAE's `forward_loss` with norm_pix_loss
    (He et al. 2021, sec 3 "Reconstruction target"; models_mae.py)."""
    target = patchify(images, patch_size)
    if normalize:
        mean = target.mean(dim=-1, keepdim=True)
        var = target.var(dim=-1, keepdim=True)
        target = (target - mean) / (var + eps) ** 0.5
    return target
