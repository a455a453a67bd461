"""The masked task's pictures: inputs beside what the model saw and what it predicted (mean colours
for the ViT paper's MPP, reconstructed pixels for MAE and SimMIM, how well each masked patch's HOG was
predicted for MaskFeat).

RGB images are drawn as they are. Images of any other band count are drawn in false colour
(`false_colour`): three display bands as red, green and blue, each stretched between its 2nd and 98th
percentile in the input image, and the reconstruction with the same stretch as its input.

Legend: n images, C bands, N patches, p patch size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.utils import make_grid

from ssl_vit import targets
from ssl_vit.masking import token_index

# Each band drawn from its 2nd to its 98th percentile: the usual display stretch of multispectral imagery
# (a few saturated or dark pixels, clouds and shadows, do not flatten the rest).
STRETCH = (0.02, 0.98)


@torch.no_grad()
def masked_prediction_picture(task, images: Tensor, out, count: int = 8) -> Tensor:
    """Rows of `count` images: the input, then what the model saw and predicted.

    Colour targets (ViT-paper MPP): true mean colours per patch, then the predicted colours on the
    masked patches (true ones elsewhere). Pixel targets (MAE, SimMIM): the input with masked patches
    grey, then the reconstruction pasted into the visible patches. HOG targets (MaskFeat), which have no
    pixels to paste back: the input with masked patches grey, then each masked patch filled with the
    cosine similarity of its predicted and true histograms as a grey level (white: exact).
    """
    p, grid = task.patch_size, task.grid
    pixels = task.target_images(images[:count]).float()  # (n, C, H, W)
    display = displayed(pixels, task.bands, task.display_bands)
    shown = display(pixels)  # (n, 3, H, W) in [0, 1]
    idx = out.idx[:count]
    if out.target.dtype == torch.long:
        true = task.make_targets(pixels)  # (n, N) or (n, N, 16)
        pred = true.clone().scatter_(1, token_index(idx, true), out.pred[:count].argmax(-1))
        rows = [pixels, _colour_image(true, p, grid), _colour_image(pred, p, grid)]
    else:
        shown_patches = targets.patchify(shown, p)  # (n, N, p*p*3)
        at_masked = token_index(idx, shown_patches)
        masked = shown_patches.scatter(1, at_masked, 0.5)
        pred = out.pred[:count].float()
        if task.target_kind == "hog":
            agreement = F.cosine_similarity(pred, out.target[:count].float(), dim=-1).clamp(0, 1)  # (n, M)
            grey = agreement[..., None].expand(-1, -1, shown_patches.shape[-1])
            recon = targets.unpatchify(shown_patches.scatter(1, at_masked, grey), p, grid)
        else:
            patches = targets.patchify(pixels, p)  # (n, N, p*p*C)
            if task.target_kind == "norm_pixels":  # undo the per-patch normalisation with the true statistics
                true = torch.gather(patches, 1, token_index(idx, patches))
                mean, var = targets.patch_moments(true, None if task.bands == 3 else task.bands)
                pred = pred * (var + 1e-6).sqrt() + mean
            pasted = patches.scatter(1, token_index(idx, patches), pred)
            recon = display(targets.unpatchify(pasted, p, grid))
        rows = [shown, targets.unpatchify(masked, p, grid), recon]
    return make_grid(torch.cat(rows), nrow=pixels.shape[0], padding=1, pad_value=1.0)


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
