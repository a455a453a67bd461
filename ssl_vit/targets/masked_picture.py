"""The masked task's pictures: inputs beside what the model saw and what it predicted, drawn by each
target (`Target.picture`, each target's module says what it draws) with the pieces here. RGB images
are drawn as they are, other band counts in false colour (`displayed`).

Legend: as in `target`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torchvision.utils import make_grid

from ssl_vit.masking import token_index
from ssl_vit.targets.patches import patchify, unpatchify
from ssl_vit.targets.target import Target, TargetContext

# Each band drawn from its 2nd to its 98th percentile: the usual display stretch of multispectral imagery
# (a few saturated or dark pixels, clouds and shadows, do not flatten the rest).
STRETCH = (0.02, 0.98)


class Scene(NamedTuple):
    """What a picture of the first n images of a batch is drawn from."""

    pixels: Tensor  # (n, C, H, W) what the targets are made from (`TargetContext.pixels`), float
    shown: Tensor  # (n, 3, H, W) in [0, 1]: the input as drawn
    display: Callable[[Tensor], Tensor]  # images like `pixels` -> (n, 3, H, W), drawn as the input is
    idx: Tensor  # (n, M) the masked patches
    pred: Tensor  # (n, M, *T) the predictions there
    target: Tensor  # (n, M, *T) the targets there


@torch.no_grad()
def masked_prediction_picture(
    target: Target, ctx: TargetContext, images: Tensor, out, count: int = 8
) -> Tensor:
    """Rows of `count` images: the input, then what the model saw and predicted (`out`, the task's
    output), as `target` draws them (`Target.picture`: its own rows, or `masked_rows` with a
    reconstruction, `pasted` pixels or `filled` grey levels)."""
    pixels = ctx.pixels(images[:count]).float()  # (n, C, H, W)
    display = displayed(pixels, ctx.bands, ctx.display_bands)
    scene = Scene(pixels, display(pixels), display, out.idx[:count], out.pred[:count], out.target[:count])
    rows = target.picture(ctx, scene)
    return make_grid(torch.cat(rows), nrow=pixels.shape[0], padding=1, pad_value=1.0)


def masked_rows(ctx: TargetContext, scene: Scene, recon: Tensor) -> list[Tensor]:
    """The input, the input with its masked patches grey (what the model saw), then `recon` (n, 3, H, W)."""
    return [scene.shown, filled(ctx, scene, scene.shown.new_full(scene.idx.shape, 0.5)), recon]


def pasted(ctx: TargetContext, scene: Scene, pred: Tensor) -> Tensor:
    """Pixel predictions (n, M, p*p*C) pasted into the input at the masked patches (MAE, SimMIM), drawn
    with the input's stretch -> (n, 3, H, W)."""
    patches = patchify(scene.pixels, ctx.patch_size)  # (n, N, p*p*C)
    whole = patches.scatter(1, token_index(scene.idx, patches), pred)
    return scene.display(unpatchify(whole, ctx.patch_size, ctx.grid))


def filled(ctx: TargetContext, scene: Scene, levels: Tensor) -> Tensor:
    """The input with each masked patch filled with one grey level of `levels` (n, M) in [0, 1], for a
    target with no pixels to paste back -> (n, 3, H, W)."""
    patches = patchify(scene.shown, ctx.patch_size)  # (n, N, p*p*3)
    grey = levels[..., None].expand(-1, -1, patches.shape[-1])
    return unpatchify(patches.scatter(1, token_index(scene.idx, patches), grey), ctx.patch_size, ctx.grid)


def displayed(pixels: Tensor, bands: int, display_bands: tuple[int, int, int]) -> Callable[[Tensor], Tensor]:
    """How images like `pixels` (n, C, H, W) are drawn: RGB in [0, 1] as they are (clipped), other band
    counts in false colour with the stretch of `pixels` themselves, so that a reconstruction is drawn
    as its input is."""
    if bands == 3:
        return lambda images: images.clamp(0, 1)
    stretch = band_stretch(pixels[:, list(display_bands)])
    return lambda images: false_colour(images, display_bands, stretch)


def band_stretch(images: Tensor) -> tuple[Tensor, Tensor]:
    """images (n, C, H, W) -> (low, high), each (n, C, 1, 1): every image's bands' 2nd and 98th
    percentiles (`STRETCH`)."""
    levels = torch.tensor(STRETCH, device=images.device)
    low, high = torch.quantile(images.flatten(2).float(), levels, dim=-1)  # each (n, C)
    return low[..., None, None], high[..., None, None]


def false_colour(
    images: Tensor, display_bands: tuple[int, int, int], stretch: tuple[Tensor, Tensor] | None = None
) -> Tensor:
    """images (n, C, H, W) of any band count and units -> (n, 3, H, W) in [0, 1]: `display_bands` as
    red, green and blue, each mapped linearly from its low to its high value and clipped; `stretch`
    (low, high), each (n, 3, 1, 1), defaults to the images' own `band_stretch`."""
    chosen = images[:, list(display_bands)].float()
    low, high = stretch if stretch is not None else band_stretch(chosen)
    return ((chosen - low) / (high - low).clamp_min(1e-12)).clamp(0, 1)
