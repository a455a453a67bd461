"""`feature: tokens`: every output token after the final norm, [class] token first (B, 1 + N, D; N
without one): what an attentive probe attends over."""

import torch

from ssl_vit.models.feature import Feature, register


def _tokens(r):
    prefix = [] if r.tokens.cls is None else [r.tokens.cls[:, None]]
    return torch.cat([*prefix, r.tokens.patches], dim=1)


register(Feature("tokens", "all output tokens", _tokens, pooled=False))
