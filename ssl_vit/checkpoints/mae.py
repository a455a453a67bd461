"""MAE's checkpoint names (facebookresearch/mae, models_mae.py and models_vit.py) onto ssl-vit's.

The encoder already has timm's names (`cls_token`, `pos_embed`, `patch_embed.proj.*`, `blocks.N.*`,
`norm.*`); the global-pool fine-tuned models normalise after pooling (`fc_norm.*`, no `norm.*`). The
decoder is `mask_token`, `decoder_embed.*`, `decoder_pos_embed`, `decoder_blocks.N.*`, `decoder_norm.*`,
`decoder_pred.*`, which map onto `MAEDecoder`'s `mask_token`, `embed`, `blocks`, `norm`, `pred`.

Legend: N patches, E decoder width.
"""

from __future__ import annotations

import math
import re

import torch
from timm.layers import build_sincos2d_pos_embed
from torch import Tensor

from ssl_vit.errors import UserError

DECODER_RENAMES = {"decoder_embed.": "embed.", "decoder_blocks.": "blocks.", "decoder_norm.": "norm.",
                   "decoder_pred.": "pred.", "mask_token": "mask_token"}  # fmt: skip
# Tensors of MAEDecoder whose rows (or last dim) live in the E-wide residual stream, and those that
# read it along their columns; everything else (qkv/fc1 biases, pred.bias) never touches it.
_STREAM_ROWS = re.compile(
    r"^(?:embed\.|blocks\.\d+\.(?:norm[12]|attn\.proj|mlp\.fc2)\.|norm\.)(?:weight|bias)$"
)
_STREAM_COLUMNS = re.compile(r"^(?:blocks\.\d+\.(?:attn\.qkv|mlp\.fc1)|pred)\.weight$")


def is_mae_decoder_key(key: str) -> bool:
    return key.startswith(tuple(DECODER_RENAMES)) or key == "decoder_pos_embed"


def encoder_state(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """MAE's encoder keys as the [class]-token backbone's. A global-pool fine-tuned model has only
    `fc_norm` (applied after pooling); it becomes the final norm on every token, which gives the
    [class] token and patch tokens a norm but is not MAE's pooled feature (mean, then fc_norm)."""
    encoder = {k: v for k, v in state.items() if not is_mae_decoder_key(k)}
    if "cls_token" in encoder and "norm.weight" not in encoder and "fc_norm.weight" in encoder:
        for part in ("weight", "bias"):
            encoder[f"norm.{part}"] = encoder.pop(f"fc_norm.{part}")
    return encoder


def decoder_state(state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """MAE's decoder tensors -> `MAEDecoder`'s state dict ({} when `state` has no decoder).

    MAE's fixed position embedding orders its E channels (sin x, cos x, sin y, cos y) and ours, timm's
    `build_sincos2d_pos_embed`, (sin y, sin x, cos y, cos x). Both are fixed, so instead the decoder's
    residual stream is permuted to our order: every weight writing into it permuted along its rows,
    every weight reading it along its columns. LayerNorm and attention are equivariant to such a
    permutation, so the decoder computes exactly what MAE's did. MAE's stored `decoder_pos_embed`
    (1, 1+N, E) checks that the permutation is right.
    """
    if "decoder_pos_embed" not in state:
        return {}
    pos = state["decoder_pos_embed"][0, 1:].float()  # (N, E); MAE's [class] position is all zeros
    side, dim = math.isqrt(pos.shape[0]), pos.shape[1]
    order = _stream_order(dim)
    if (
        side * side != pos.shape[0]
        or dim % 4
        or not torch.allclose(pos[:, order], build_sincos2d_pos_embed([side, side], dim), atol=1e-4)
    ):
        raise UserError(
            f"{source}: decoder_pos_embed is not MAE's fixed 2-D sin-cos embedding of a square grid, so its "
            "decoder cannot be mapped; start the decoder from scratch (init_from a backbone-only export)"
        )
    decoder = {}
    for key, value in state.items():
        prefix = next((p for p in DECODER_RENAMES if key.startswith(p)), None)
        if prefix is None:
            continue
        name = DECODER_RENAMES[prefix] + key.removeprefix(prefix)
        if name == "mask_token" or _STREAM_ROWS.match(name):
            value = value[..., order] if name == "mask_token" else value[order]
        elif _STREAM_COLUMNS.match(name):
            value = value[:, order]
        decoder[name] = value
    return decoder


def _stream_order(dim: int) -> Tensor:
    """Indices into MAE's channels, (sin x, cos x, sin y, cos y) in quarters, giving timm's order
    (sin y, sin x, cos y, cos x)."""
    quarter = dim // 4
    return torch.cat([torch.arange(q * quarter, (q + 1) * quarter) for q in (2, 0, 3, 1)])


__all__ = ["decoder_state", "encoder_state", "is_mae_decoder_key"]
