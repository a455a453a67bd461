"""What a ViT's embeddings learned (ViT paper sec 4.5, Figure 7 left and centre): the similarity of
the position embeddings, and the principal components of the patch-embedding filters.

Legend: N = gh x gw patches, D width, p patch size, k components.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ssl_vit.models.vit import ViT


def position_similarity(backbone: ViT) -> Tensor:
    """(N, N) cosine similarity of each patch position's embedding with every other's, patches in
    row-major order (the [class] token's embedding is not a position, and is left out)."""
    patches = backbone.pos_embed[0, -backbone.patch_embed.num_patches :].detach().float()  # (N, D)
    unit = F.normalize(patches, dim=-1)
    return unit @ unit.T


def patch_filter_components(
    backbone: ViT, count: int = 28, display_bands: tuple[int, int, int] = (0, 1, 2)
) -> tuple[Tensor, Tensor] | None:
    """The leading principal components of the patch-embedding filters, as RGB patches.

    The D filters of `patch_embed.proj` (D, C, p, p) are the samples: the components are directions in
    the C x p x p space of pixel patches, all C input bands. Returns (components (k, 3, p, p) in [0, 1]
    for display: for RGB the three bands, for other band counts the `display_bands` of each component
    (its false colour, as the pictures of such images are drawn), each component rescaled to [0, 1] over
    what is shown; and the explained-variance ratio (k,) of each, over all C bands); k = min(count,
    D - 1, C p^2). None for hybrids, whose "patches" are ResNet features rather than pixels.
    """
    if hasattr(backbone.patch_embed, "backbone"):  # a hybrid's ResNet stem (timm's HybridEmbed)
        return None
    weight = backbone.patch_embed.proj.weight.detach()
    filters = weight.flatten(1).double()  # (D, C p^2)
    # The SVD of the centred filters is the PCA: the right singular vectors are the components.
    _, singular, components = torch.linalg.svd(filters - filters.mean(0), full_matrices=False)
    k = min(count, filters.shape[0] - 1, filters.shape[1])
    variance = singular.square()
    ratio = (variance / variance.sum())[:k]
    top = components[:k].view(k, *weight.shape[1:])[:, list(display_bands)].flatten(1)  # (k, 3 p^2)
    low, high = top.min(1, keepdim=True).values, top.max(1, keepdim=True).values
    shown = (top - low) / (high - low).clamp_min(1e-12)
    return shown.view(k, 3, *weight.shape[2:]).float(), ratio.float()
