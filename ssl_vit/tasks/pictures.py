"""The masked task's pictures: inputs beside what the model saw and what it predicted, drawn by each
target (`ssl_vit.tasks.targets`) with the pieces here: mean colours for the ViT paper's MPP, reconstructed
pixels for MAE and SimMIM, how well each masked patch's HOG was predicted for MaskFeat.

RGB images are drawn as they are. Images of any other band count are drawn in false colour
(`false_colour`): three display bands as red, green and blue, each stretched between its 2nd and 98th
percentile in the input image, and the reconstruction with the same stretch as its input.

Legend: n images, C bands, N patches, M masked patches, T a target's shape per patch, p patch size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torchvision.utils import make_grid

from ssl_vit import targets
from ssl_vit.masking import token_index

# Each band drawn from its 2nd to its 98th percentile: the usual display stretch of multispectral imagery
# (a few saturated or dark pixels, clouds and shadows, do not flatten the rest).
STRETCH = (0.02, 0.98)


class Scene(NamedTuple):
    """What a picture of the first n images of a batch is drawn from."""

    pixels: Tensor  # (n, C, H, W) what the targets are made from (`target_images`), float
    shown: Tensor  # (n, 3, H, W) in [0, 1]: the input as drawn
    display: Callable[[Tensor], Tensor]  # images like `pixels` -> (n, 3, H, W), drawn as the input is
    idx: Tensor  # (n, M) the masked patches
    pred: Tensor  # (n, M, *T) the predictions there
    target: Tensor  # (n, M, *T) the targets there


@torch.no_grad()
def masked_prediction_picture(task, images: Tensor, out, count: int = 8) -> Tensor:
    """Rows of `count` images: the input, then what the model saw and predicted, as the task's target
    draws them (`ssl_vit.tasks.target.Target.picture`: `colour_rows`, or `masked_rows` with a
    reconstruction, `pasted` pixels or `filled` grey levels)."""
    pixels = task.target_images(images[:count]).float()  # (n, C, H, W)
    display = displayed(pixels, task.bands, task.display_bands)
    scene = Scene(pixels, display(pixels), display, out.idx[:count], out.pred[:count], out.target[:count])
    rows = task.target.picture(task, scene)
    return make_grid(torch.cat(rows), nrow=pixels.shape[0], padding=1, pad_value=1.0)


def colour_rows(task, scene: Scene, true: Tensor) -> list[Tensor]:
    """Colour classes (ViT-paper MPP): the input, the true mean colours `true` (n, N) or (n, N, 16) of
    every patch, then the predicted ones on the masked patches (true ones elsewhere)."""
    pred = true.clone().scatter_(1, token_index(scene.idx, true), scene.pred.argmax(-1))
    return [
        scene.pixels,
        _colour_image(true, task.patch_size, task.grid),
        _colour_image(pred, task.patch_size, task.grid),
    ]


def masked_rows(task, scene: Scene, recon: Tensor) -> list[Tensor]:
    """The input, the input with its masked patches grey (what the model saw), then `recon` (n, 3, H, W)."""
    patches = targets.patchify(scene.shown, task.patch_size)  # (n, N, p*p*3)
    masked = patches.scatter(1, token_index(scene.idx, patches), 0.5)
    return [scene.shown, targets.unpatchify(masked, task.patch_size, task.grid), recon]


def pasted(task, scene: Scene, pred: Tensor) -> Tensor:
    """Pixel predictions (n, M, p*p*C) pasted into the input at the masked patches (MAE, SimMIM), drawn
    with the input's stretch -> (n, 3, H, W)."""
    patches = targets.patchify(scene.pixels, task.patch_size)  # (n, N, p*p*C)
    whole = patches.scatter(1, token_index(scene.idx, patches), pred)
    return scene.display(targets.unpatchify(whole, task.patch_size, task.grid))


def filled(task, scene: Scene, levels: Tensor) -> Tensor:
    """The input with each masked patch filled with one grey level of `levels` (n, M) in [0, 1], for a
    target with no pixels to paste back -> (n, 3, H, W)."""
    patches = targets.patchify(scene.shown, task.patch_size)  # (n, N, p*p*3)
    grey = levels[..., None].expand(-1, -1, patches.shape[-1])
    return targets.unpatchify(
        patches.scatter(1, token_index(scene.idx, patches), grey), task.patch_size, task.grid
    )


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


def _colour_image(classes: Tensor, patch_size: int, grid: tuple[int, int]) -> Tensor:
    """Colour classes (n, N) or (n, N, 16) -> (n, 3, H, W), each patch (or 4x4 sub-block) filled."""
    colours = targets.decode_mean_color_3bit(classes)  # (n, N[, 16], 3)
    side = 1 if classes.dim() == 2 else 4
    image = colours.view(classes.shape[0], grid[0], grid[1], side, side, 3)
    image = image.permute(0, 5, 1, 3, 2, 4).reshape(classes.shape[0], 3, grid[0] * side, grid[1] * side)
    return torch.nn.functional.interpolate(image, scale_factor=patch_size // side, mode="nearest")
