"""Initialisations the objectives choose beside timm's own (timm's ViT: truncated normals of std 0.02,
learned position embeddings).

MAE's (facebookresearch/mae, models_mae.py `initialize_weights`, "following the official JAX ViT"):
`mae_weights` and `fixed_sincos_positions`. timm has the pieces (`build_sincos2d_pos_embed`) but no
mode of `VisionTransformer.init_weights` that does this ('jax' keeps learned, truncated-normal position
embeddings), so it is assembled here.
"""

from __future__ import annotations

import torch
from timm.layers import build_sincos2d_pos_embed
from torch import nn

from ssl_vit.errors import BadValue
from ssl_vit.models.vit import ViT


def xavier_linears(module: nn.Module) -> None:
    """Every linear layer in `module`: xavier-uniform weights, zero biases (its layer norms start at 1 and 0
    as built, which MAE's code sets again)."""
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


def mae_init(vit: ViT) -> None:
    """MAE's encoder initialisation, in place: `mae_weights` and `fixed_sincos_positions`."""
    mae_weights(vit)
    fixed_sincos_positions(vit)


def mae_weights(vit: ViT) -> None:
    """MAE's weights: xavier-uniform linears and patch projection (initialised as the linear layer it
    is), [class] N(0, 0.02), drawn in the order of MAE's code (and lightly's)."""
    weight = vit.patch_embed.proj.weight.data
    nn.init.xavier_uniform_(weight.view(weight.shape[0], -1))
    if vit.cls_token is not None:
        nn.init.normal_(vit.cls_token, std=0.02)
    xavier_linears(vit)


def fixed_sincos_positions(vit: ViT) -> None:
    """MAE's position embeddings: 2-D sin-cos (timm's `build_sincos2d_pos_embed`), zeros at [class], no
    longer taking gradients; they stay in the state dict, so a fine-tune loads them and trains them as
    timm's learned ones."""
    if vit.embed_dim % 4:
        raise BadValue(
            f"MAE's initialisation needs a width divisible by 4 (2-D sin-cos position embeddings), got "
            f"{vit.embed_dim}: pick another width or encoder_init: timm"
        )
    with torch.no_grad():
        vit.pos_embed.zero_()
        vit.pos_embed[0, vit.num_prefix_tokens :] = build_sincos2d_pos_embed(
            list(vit.grid_size), vit.embed_dim
        ).to(vit.pos_embed)
    vit.pos_embed.requires_grad_(False)
