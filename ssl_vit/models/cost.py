"""Parameters and forward FLOPs per image of a ViT variant, and of MAE's encoder + decoder: what `ssl-vit
info` tabulates and `ssl-vit bench scaling` compares measured step times against.

FLOPs are counted by torch's own `FlopCounterMode` on the meta device (shapes only, no memory, no
time): matmuls, convolutions and attention, as 2 x multiply-adds, the convention of the MAE and ViT
papers' FLOP figures. Element-wise ops (norms, GELU) are not counted.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.utils.flop_counter import FlopCounterMode

from ssl_vit.models.heads import MAEDecoder
from ssl_vit.models.vit import build_vit

META = "meta"


class Cost(NamedTuple):
    params: int
    flops: int  # forward FLOPs for one image


def _count_flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def vit_cost(variant: str, img_size: int = 224) -> Cost:
    """Parameters (no head) and forward FLOPs per image of the plain backbone."""
    vit = build_vit(variant, img_size, device=META)
    images = torch.empty(1, 3, img_size, img_size, device=META)
    return Cost(sum(p.numel() for p in vit.parameters()), _count_flops(lambda: vit(images)))


def mae_cost(
    variant: str,
    img_size: int = 224,
    mask_ratio: float = 0.75,
    decoder_dim: int = 512,
    decoder_depth: int = 8,
) -> Cost:
    """Parameters and forward FLOPs per image of MAE: the encoder on the visible tokens only, the
    decoder on all of them (He et al. 2021, sec 3)."""
    vit = build_vit(variant, img_size, device=META)
    pixels = vit.pixels_per_token**2 * 3
    with torch.device(META):
        decoder = MAEDecoder(vit.embed_dim, vit.grid_size, pixels, dim=decoder_dim, depth=decoder_depth)
    num_patches = vit.grid_size[0] * vit.grid_size[1]
    num_keep = num_patches - round(mask_ratio * num_patches)
    images = torch.empty(1, 3, img_size, img_size, device=META)
    idx_keep = torch.arange(num_keep, device=META).unsqueeze(0)

    def forward():
        decoder(vit.encode(vit.embed_patches(images), idx_keep), idx_keep)

    params = sum(p.numel() for m in (vit, decoder) for p in m.parameters())
    return Cost(params, _count_flops(forward))
