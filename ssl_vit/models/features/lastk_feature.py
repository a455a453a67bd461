"""`feature: lastk`: the pooled token ([class] token, or normalised mean patch token for GAP backbones)
of each of the last k blocks, each through the final norm, concatenated (B, k x D): DINO's linear
evaluation ("concatenation of the [class] tokens of the last 4 blocks", `eval_linear.py`,
n_last_blocks=4)."""

import torch

from ssl_vit.models.feature import Feature, register

register(Feature("lastk", "last blocks' [class] tokens", lambda r: torch.cat(r.pooled, dim=1), blocks=True))
