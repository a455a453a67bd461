"""Heads the objectives put on top of the backbone's tokens.

Legend: B batch, N patch tokens, K kept (visible) tokens, D encoder width, E decoder width.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Literal

import torch
from timm.layers import build_sincos2d_pos_embed
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from ssl_vit import masking
from ssl_vit.errors import BadValue
from ssl_vit.models.feature import Tokens
from ssl_vit.models.init import xavier_linears


def zero_linear(in_features: int, out_features: int, bias_init: float = 0.0) -> nn.Linear:
    """A classifier whose weights start at zero: the ViT paper's fine-tuning head ("a zero-initialized
    D x K feedforward layer", sec 3.2); `bias_init`: `SupervisedPretraining`'s `head_bias_init`."""
    layer = nn.Linear(in_features, out_features)
    nn.init.zeros_(layer.weight)
    nn.init.constant_(layer.bias, bias_init)
    return layer


HeadInit = Literal["xavier", "torch"]  # how a `PatchHead` starts


class PatchHead(nn.Module):
    """One linear map per patch token to `out_shape` values: the per-patch classifier of masked patch
    prediction (512 mean-colour classes, or 16 x 512 for the 4x4-downsized target) or the pixel head of
    SimMIM (p*p*3 values; SimMIM's 1x1 conv + pixel shuffle is the same map).

    `init`: `xavier` (xavier-uniform weights, zero bias) or `torch` (PyTorch's own start of a linear
    layer, as SimMIM's code leaves its 1x1 convolution: weights and bias uniform within 1/sqrt(D))."""

    def __init__(self, dim: int, out_shape: tuple[int, ...], init: HeadInit = "xavier") -> None:
        super().__init__()
        self.out_shape = tuple(out_shape)
        self.proj = nn.Linear(dim, math.prod(self.out_shape))
        if init not in HeadInit.__args__:
            raise BadValue(f"head init {init!r}: give {' or '.join(HeadInit.__args__)}")
        if init == "xavier":  # "torch" keeps the start nn.Linear gave it
            nn.init.xavier_uniform_(self.proj.weight)
            nn.init.zeros_(self.proj.bias)

    def forward(self, patches: Tensor) -> Tensor:
        """patches: (B, N, D) -> (B, N, *out_shape)."""
        return self.proj(patches).unflatten(-1, self.out_shape)


class MAEDecoder(nn.Module):
    """MAE's light decoder (He et al. 2021, sec 3 "MAE decoder"; defaults 8 blocks x 512 wide, 16 heads).

    The encoded visible tokens are projected to the decoder width, a shared learned mask token fills
    every masked position, fixed 2-D sin-cos position embeddings are added, and timm Blocks predict
    `out_dim` values (p*p*3 pixels) for every patch. The [class] token, when the encoder has one, goes
    through the decoder too, as in MAE, and is dropped from the output.
    """

    def __init__(
        self,
        encoder_dim: int,
        grid_size: tuple[int, int],
        out_dim: int,
        dim: int = 512,
        depth: int = 8,
        heads: int = 16,
        mlp_ratio: float = 4.0,
    ) -> None:
        super().__init__()
        if dim % 4:
            raise BadValue(f"decoder width {dim} must be divisible by 4 (2-D sin-cos position embedding)")
        self.embed = nn.Linear(encoder_dim, dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dim))
        # Fixed, not learned (MAE uses fixed sin-cos for both encoder and decoder); not saved, rebuilt.
        self.register_buffer(
            "pos_embed", build_sincos2d_pos_embed(list(grid_size), dim).unsqueeze(0), persistent=False
        )
        # LayerNorm eps 1e-6 as MAE's decoder (models_mae.py), so its weights compute the same here.
        norm = partial(nn.LayerNorm, eps=1e-6)
        self.blocks = nn.Sequential(
            *[Block(dim, heads, mlp_ratio, qkv_bias=True, norm_layer=norm) for _ in range(depth)]
        )
        self.norm = norm(dim)
        self.pred = nn.Linear(dim, out_dim)
        # MAE's init: xavier-uniform linears (following the official JAX ViT), N(0, 0.02) mask token.
        nn.init.normal_(self.mask_token, std=0.02)
        xavier_linears(self)

    def forward(self, encoded: Tokens, idx_keep: Tensor) -> Tensor:
        """encoded: the encoder's Tokens for the visible patches, patches (B, K, D); idx_keep: (B, K)
        their positions -> predictions for every patch (B, N, out_dim), in patch order."""
        visible = self.embed(encoded.patches)  # (B, K, E)
        batch, num_patches, dim = visible.shape[0], self.pos_embed.shape[1], visible.shape[-1]
        # Under autocast `visible` comes out of a linear in bf16/fp16; the filler must match it.
        x = self.mask_token.to(visible.dtype).expand(batch, num_patches, dim)
        x = x.scatter(1, idx_keep.unsqueeze(-1).expand(-1, -1, dim), visible)  # (B, N, E), patch order
        x = x + self.pos_embed
        if encoded.cls is not None:
            x = torch.cat([self.embed(encoded.cls).unsqueeze(1), x], dim=1)  # (B, 1+N, E), cls position 0
        x = self.norm(self.blocks(x))
        return self.pred(x[:, -num_patches:])

    def predict_at(self, encoded: Tokens, idx_keep: Tensor, idx_predict: Tensor) -> Tensor:
        """Predictions at each of T groups of positions `idx_predict` (B, T, M) -> (B, T, M, out_dim), in
        that order: for each group, one sequence of the visible tokens at `idx_keep` (B, K) and mask
        tokens at the group's positions; the other masked positions take no part. I-JEPA's predictor,
        run once per target block, conditioned on where its targets are (sec 3 "Prediction")."""
        batch, groups = idx_predict.shape[:2]
        visible = self.embed(encoded.patches)  # (B, K, E), once per image, then copied per group
        pos = self.pos_embed.expand(batch, -1, -1)  # (B, N, E)
        context = visible + masking.gather_tokens(pos, idx_keep)
        if encoded.cls is not None:
            context = torch.cat([self.embed(encoded.cls).unsqueeze(1), context], dim=1)  # cls position 0
        queries = self.mask_token.to(visible.dtype) + masking.gather_tokens(pos, idx_predict.flatten(1))
        queries = queries.unflatten(1, (groups, -1)).flatten(0, 1)  # (B*T, M, E), sample-major
        x = torch.cat([context.repeat_interleave(groups, 0), queries], dim=1)  # (B*T, [1+]K+M, E)
        x = self.norm(self.blocks(x))
        return self.pred(x[:, -idx_predict.shape[2] :]).unflatten(0, (batch, groups))
