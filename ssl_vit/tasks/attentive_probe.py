"""Attentive probing: learned queries cross-attend over a frozen backbone's tokens, a linear head
classifies what they gather; one such probe per (learning rate, weight decay) of a grid, all trained
on the same frozen tokens.

The pooling is AIM's (El-Nouby et al. 2024, sec 4 and `AttentionPoolingClassifier` of apple/ml-aim),
which CAPI (Darcet et al. 2025) and Web-SSL read their models with: a BatchNorm without affine
parameters, `AttentivePooling`, then a linear layer; no MLP and no output projection. The lightest of
the published variants (V-JEPA's and SigLIP's add an MLP block), so that what it measures is what the
tokens hold, not what a second network on top of them can compute.

Legend: B batch, T tokens, D width, K classes, H probes (one per candidate), Q queries.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.optim import AdamW, Optimizer

from ssl_vit.errors import BadValue
from ssl_vit.models.feature import FEATURES
from ssl_vit.models.heads import zero_linear
from ssl_vit.models.vit import ViTConfig
from ssl_vit.tasks.base import Training
from ssl_vit.tasks.frozen_probe import FrozenProbe

# What the queries attend over: the per-token features of the final layer (`feature`).
TokenFeature = FEATURES.choice("TokenFeature", pooled=False, blocks=False)


def adamw(params) -> Optimizer:
    """The default attentive-probe optimizer (AIM's and CAPI's: AdamW); each probe's group sets its lr
    and weight decay."""
    return AdamW(params, lr=1e-3, weight_decay=0.0)


class AttentivePooling(nn.Module):
    """(B, T, D) tokens, already normalised -> (B, D): `queries` learned queries attend over the tokens
    with `heads` heads through key and value projections without bias (AIM's `AttentionPoolingClassifier`),
    their outputs averaged.

    Hand-written rather than timm's `AttentionPoolLatent` (the same function without its output
    projection, norm and MLP): timm projects every token through the key and value matrices, 2 T D^2
    multiply-adds per image, while with learned queries the query can be folded into the key matrix
    (q . W_k x = (W_k^T q) . x) and the value matrix applied once after pooling (sum_t a_t W_v x_t =
    W_v sum_t a_t x_t): 2 T D heads + D^2, about D / heads times fewer (48x for B/16 with 12 heads,
    20x for the study's ViT, counted by FlopCounterMode). A grid of a few dozen probes then costs little
    more than one.
    `test_the_folded_pooling_is_the_attention_of_projected_keys_and_values` checks the two agree."""

    def __init__(self, width: int, heads: int, queries: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.latent = nn.Parameter(torch.zeros(queries, width))  # the queries, AIM's `cls_token`
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        nn.init.trunc_normal_(self.latent, std=0.02)  # AIM: randn * 0.02

    def forward(self, tokens: Tensor) -> Tensor:
        h, d = self.heads, self.head_dim
        queries = self.latent.view(-1, h, d)  # (Q, h, d)
        folded = torch.einsum("qhe,hex->qhx", queries, self.k.weight.view(h, d, -1)) * d**-0.5  # (Q, h, D)
        attention = torch.einsum("btx,qhx->bqht", tokens, folded).softmax(-1)  # (B, Q, h, T)
        pooled = torch.einsum("bqht,btx->bqhx", attention, tokens)  # (B, Q, h, D): tokens per head's weights
        out = torch.einsum("bqhx,hex->bqhe", pooled, self.v.weight.view(h, d, -1))  # (B, Q, h, d)
        return out.flatten(2).mean(1)  # (B, D), the queries averaged


class AttentiveProbe(FrozenProbe):
    """Attentive probes on a frozen backbone, one per candidate (`lrs[i]`, `weight_decays[i]`).

    Args:
        num_classes: as `LinearProbe`.
        feature: `tokens` (every output token, the [class] token included) or `patches`.
        queries: learned queries per probe (AIM: 1), their outputs averaged.
        heads: attention heads (the width must divide by them).
        lrs, weight_decays: one probe per pair (the same length), each its own param group.
        training: as `LinearProbe`'s, the optimizer AdamW by default.
    """

    def __init__(
        self,
        backbone: ViTConfig,
        num_classes: int,
        feature: TokenFeature = "tokens",
        queries: int = 1,
        heads: int = 8,
        lrs: tuple[float, ...] = (1e-3,),
        weight_decays: tuple[float, ...] = (0.0,),
        training: Training = Training(optimizer=adamw),
    ) -> None:
        if queries < 1:
            raise BadValue(f"queries must be at least 1, got {queries}")
        super().__init__(
            backbone, num_classes, list(lrs), list(weight_decays), training,
            hparams=dict(feature=feature, queries=queries, heads=heads, weight_decays=list(weight_decays)),
        )  # fmt: skip
        self.backbone.check_feature(feature, kinds=TokenFeature.valid())
        width = self.backbone.embed_dim
        if heads < 1 or width % heads:
            raise BadValue(f"heads must divide the backbone's width {width}, got {heads}")
        self.feature = feature
        # AIM: BatchNorm1d(affine=False, eps=1e-6) over the tokens' channels; shared, as it learns nothing.
        self.norm = nn.BatchNorm1d(width, affine=False, eps=1e-6)
        self.heads.extend(
            nn.Sequential(AttentivePooling(width, heads, queries), zero_linear(width, num_classes))
            for _ in self.lrs
        )
        prefix = self.backbone.num_prefix_tokens if feature == "tokens" else 0
        self.tokens_per_image = prefix + self.backbone.grid_size[0] * self.backbone.grid_size[1]

    def classify(self, features: Tensor, head: int | None = None) -> Tensor:
        """tokens (B, T, D) -> logits of every probe (H, B, K), or of probe `head` only (1, B, K)."""
        tokens = self.norm(features.transpose(1, 2)).transpose(1, 2)
        return torch.stack([h(tokens) for h in self.chosen(head)])


__all__ = ["AttentivePooling", "AttentiveProbe", "TokenFeature"]
