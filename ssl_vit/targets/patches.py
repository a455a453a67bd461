"""Images to patches and back, and each patch's statistics: what the pixel targets, the pictures and a
plugin's targets are made of. Patches are numbered row-major, the order of timm's patch embedding
(conv -> flatten(2) -> transpose)."""

from __future__ import annotations

from einops import rearrange
from torch import Tensor

from ssl_vit.errors import BadValue


def check_divisible(images: Tensor, size: int, what: str) -> None:
    height, width = images.shape[-2:]
    if height % size or width % size:
        raise BadValue(f"image size {height}x{width} is not divisible by the {what} {size}")


def patchify(images: Tensor, patch_size: int) -> Tensor:
    """Images [B, C, H, W] -> patches [B, N, p*p*C], pixels in MAE's (row, column, band) order."""
    check_divisible(images, patch_size, "patch size")
    return rearrange(images, "b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch_size, p2=patch_size)


def unpatchify(patches: Tensor, patch_size: int, grid: tuple[int, int]) -> Tensor:
    """Inverse of `patchify`: patches [B, N, p*p*C] over a (rows, columns) `grid` -> images [B, C, H, W]."""
    return rearrange(
        patches, "b (h w) (p1 p2 c) -> b c (h p1) (w p2)", h=grid[0], w=grid[1], p1=patch_size, p2=patch_size
    )


def patch_moments(patches: Tensor, bands: int | None = None) -> tuple[Tensor, Tensor]:
    """The mean and (unbiased) variance of each patch [B, N, p*p*C] over its values, or with `bands` (C)
    of each band of each patch over its pixels: (mean, var), each [B, N, 1] or [B, N, p*p*C]."""
    if bands is None:
        return patches.mean(dim=-1, keepdim=True), patches.var(dim=-1, keepdim=True)
    values = patches.unflatten(-1, (-1, bands))  # (B, N, p*p, C)
    mean, var = values.mean(dim=-2, keepdim=True), values.var(dim=-2, keepdim=True)  # (B, N, 1, C)
    return mean.expand_as(values).flatten(-2), var.expand_as(values).flatten(-2)
