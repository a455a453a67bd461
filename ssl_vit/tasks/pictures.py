"""The masked task's pictures: inputs beside what the model saw and what it predicted (mean colours
for the ViT paper's MPP, reconstructed pixels for MAE and SimMIM, how well each masked patch's HOG was
predicted for MaskFeat)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.utils import make_grid

from ssl_vit import targets
from ssl_vit.masking import token_index


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
    pixels = task.unnormalize(images[:count]).float()
    idx = out.idx[:count]
    if out.target.dtype == torch.long:
        true = task.make_targets(pixels)  # (n, N) or (n, N, 16)
        pred = true.clone().scatter_(1, token_index(idx, true), out.pred[:count].argmax(-1))
        rows = [pixels, _colour_image(true, p, grid), _colour_image(pred, p, grid)]
    else:
        patches = targets.patchify(pixels, p)  # (n, N, p*p*3)
        pred = out.pred[:count].float()
        if task.target_kind == "norm_pixels":  # undo the per-patch normalisation with the true statistics
            true = torch.gather(patches, 1, token_index(idx, patches))
            pred = pred * (true.var(-1, keepdim=True) + 1e-6).sqrt() + true.mean(-1, keepdim=True)
        masked = patches.scatter(1, token_index(idx, patches), 0.5)
        if task.target_kind == "hog":
            agreement = F.cosine_similarity(pred, out.target[:count].float(), dim=-1).clamp(0, 1)  # (n, M)
            pred = agreement[..., None].expand(-1, -1, patches.shape[-1])
        recon = patches.scatter(1, token_index(idx, patches), pred.clamp(0, 1))
        rows = [pixels, targets.unpatchify(masked, p, grid), targets.unpatchify(recon, p, grid)]
    return make_grid(torch.cat(rows), nrow=pixels.shape[0], padding=1, pad_value=1.0)


def _colour_image(classes: Tensor, patch_size: int, grid: tuple[int, int]) -> Tensor:
    """Colour classes (n, N) or (n, N, 16) -> (n, 3, H, W), each patch (or 4x4 sub-block) filled."""
    colours = targets.decode_mean_color_3bit(classes)  # (n, N[, 16], 3)
    side = 1 if classes.dim() == 2 else 4
    image = colours.view(classes.shape[0], grid[0], grid[1], side, side, 3)
    image = image.permute(0, 5, 1, 3, 2, 4).reshape(classes.shape[0], 3, grid[0] * side, grid[1] * side)
    return torch.nn.functional.interpolate(image, scale_factor=patch_size // side, mode="nearest")
