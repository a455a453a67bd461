"""`feature: mean`: the mean of the patch tokens after the final norm. A global-average-pooling backbone
normalises after pooling instead (timm's `fc_norm`): its `pooled` output, the feature it was trained
with."""

from ssl_vit.models.feature import Feature, register


def _mean(r):
    return r.tokens.pooled if r.tokens.cls is None else r.tokens.patches.mean(1)


register(Feature("mean", "mean patch token", _mean))
