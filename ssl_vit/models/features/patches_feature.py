"""`feature: patches`: the patch tokens after the final norm (B, N, D, in grid order): what a dense probe
classifies."""

from ssl_vit.models.feature import Feature, register

register(Feature("patches", "patch tokens", lambda r: r.tokens.patches, pooled=False, grid=True))
