"""Drawing the analysis: one function per picture, each writing one PNG.

Plots (matplotlib `Figure`s, fixed size: `PLOT_SIZE` inches at `DPI`) for numbers against axes; image
grids (torchvision) for pictures made of pixels, which stay pixel-exact. No pyplot: figures are drawn
straight to files, with no GUI backend to choose or global figure registry to close.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from matplotlib import colormaps
from matplotlib.figure import Figure
from torch import Tensor
from torchvision.utils import make_grid, save_image

DPI = 100
PLOT_SIZE = (6.0, 4.5)  # inches: every matplotlib picture is 600 x 450 pixels
FILTER_COLUMNS = 7  # the ViT paper's Figure 7 (left) shows 28 components in 4 rows of 7
MIN_TILE = 64  # pixels a side: small images and patches are enlarged by a whole factor to at least this


def attention_distance_plot(per_head: Tensor, pixels_per_token: int, path: Path) -> None:
    """ViT paper Figure 7 (right): one dot per head, mean attention distance against block depth.

    per_head: (L, H) pixels."""
    fig = Figure(figsize=PLOT_SIZE)
    ax = fig.subplots()
    layers = torch.arange(1, per_head.shape[0] + 1)
    for head in range(per_head.shape[1]):
        ax.scatter(layers, per_head[:, head], s=14, label=f"head {head + 1}")
    ax.set_xlabel("network depth (block)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(layers.tolist())
    ax.set_ylim(bottom=0)
    ax.set_title(f"mean attention distance per head ({pixels_per_token}-pixel patches)")
    if per_head.shape[1] <= 16:
        ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)
    _save(fig, path)


def attention_distance_curves(curves: dict[str, Tensor], path: Path) -> None:
    """Mean attention distance against depth, one line per checkpoint (mean over heads) with the
    spread of its heads (min to max) shaded. curves: name -> (L, H) pixels."""
    fig = Figure(figsize=PLOT_SIZE)
    ax = fig.subplots()
    for name, per_head in curves.items():
        layers = torch.arange(1, per_head.shape[0] + 1)
        (line,) = ax.plot(layers, per_head.mean(1), marker="o", label=name)
        ax.fill_between(
            layers, per_head.min(1).values, per_head.max(1).values, alpha=0.15, color=line.get_color()
        )
    ax.set_xlabel("network depth (block)")
    ax.set_ylabel("mean attention distance (pixels)")
    ax.set_xticks(range(1, max(len(per_head) for per_head in curves.values()) + 1))
    ax.set_ylim(bottom=0)
    ax.set_title("mean attention distance: mean over heads, shaded min-max")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    _save(fig, path)


def position_similarity_plot(similarity: Tensor, grid: tuple[int, int], path: Path) -> None:
    """ViT paper Figure 7 (centre): for each patch position (r, c), a small gh x gw tile of its
    embedding's cosine similarity to every position, tiles placed at (r, c).

    similarity: (N, N) from `embeddings.position_similarity`."""
    gh, gw = grid
    tiles = similarity.view(gh, gw, gh, gw)  # (row, col) of the position, then of the others
    # One image of all tiles with a one-pixel gap (NaN: drawn blank) between them.
    canvas = torch.full((gh * (gh + 1) - 1, gw * (gw + 1) - 1), float("nan"))
    for r in range(gh):
        for c in range(gw):
            canvas[r * (gh + 1) : r * (gh + 1) + gh, c * (gw + 1) : c * (gw + 1) + gw] = tiles[r, c]
    fig = Figure(figsize=PLOT_SIZE)
    ax = fig.subplots()
    image = ax.imshow(canvas, cmap="viridis", vmin=-1, vmax=1, interpolation="nearest")
    ax.set_xticks([c * (gw + 1) + (gw - 1) / 2 for c in range(gw)], range(1, gw + 1), fontsize=7)
    ax.set_yticks([r * (gh + 1) + (gh - 1) / 2 for r in range(gh)], range(1, gh + 1), fontsize=7)
    ax.set_xlabel("input patch column")
    ax.set_ylabel("input patch row")
    ax.set_title("position embedding similarity")
    fig.colorbar(image, ax=ax, label="cosine similarity")
    _save(fig, path)


def filter_components_grid(components: Tensor, path: Path) -> None:
    """ViT paper Figure 7 (left): the principal components of the patch-embedding filters as RGB
    tiles, `FILTER_COLUMNS` per row. components: (k, 3, p, p) in [0, 1]."""
    save_image(make_grid(_enlarged(components), nrow=FILTER_COLUMNS, padding=2, pad_value=1.0), path)


def rollout_grid(pixels: Tensor, maps: Tensor, path: Path) -> None:
    """The images (top row) and their attention rollout over them (bottom row).

    pixels: (B, 3, H, W) in [0, 1]; maps: (B, gh, gw) from `attention.rollout_maps`, each shown
    rescaled to its own [0, 1], upsampled bilinearly to the image and laid over it as a heat map."""
    heat = F.interpolate(maps[:, None].float(), size=pixels.shape[-2:], mode="bilinear", align_corners=False)
    low = heat.amin((2, 3), keepdim=True)
    heat = (heat - low) / (heat.amax((2, 3), keepdim=True) - low).clamp_min(1e-12)
    coloured = torch.from_numpy(colormaps["inferno"](heat[:, 0].numpy())[..., :3]).permute(0, 3, 1, 2)
    overlay = 0.4 * pixels + 0.6 * coloured.float()
    rows = torch.cat([pixels, overlay])
    save_image(make_grid(_enlarged(rows), nrow=len(pixels), padding=2, pad_value=1.0), path)


def image_grid(grid: Tensor, image_size: int, path: Path) -> None:
    """A picture already laid out (3, H, W) in [0, 1], e.g. `masked_prediction_picture`'s, of images
    `image_size` pixels a side: enlarged as `_enlarged` enlarges them."""
    factor = max(1, -(-MIN_TILE // image_size))
    save_image(F.interpolate(grid[None], scale_factor=factor, mode="nearest")[0], path)


def _enlarged(images: Tensor) -> Tensor:
    """(B, 3, h, w) -> (B, 3, s h, s w) by pixel repetition, s the least whole factor with s h >= MIN_TILE."""
    factor = max(1, -(-MIN_TILE // images.shape[-2]))
    return F.interpolate(images, scale_factor=factor, mode="nearest")


def _save(fig: Figure, path: Path) -> None:
    fig.savefig(path, dpi=DPI)
