"""`feature: cls`: the [class] token after the final norm (ViT paper; MAE's linear probe)."""

from ssl_vit.models.feature import Feature, register

register(Feature("cls", "[class] token", lambda r: r.tokens.cls, needs_cls=True))
