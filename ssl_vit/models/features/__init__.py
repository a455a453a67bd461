"""The features a backbone gives, one module each (`ssl_vit/models/feature.py` says what a feature is).
Importing this package registers them all (`ssl_vit.models.feature.FEATURES`), in the order messages
list them: pooled ones first."""

# isort: off
from ssl_vit.models.features import cls_feature, mean_feature, lastk_feature  # noqa: F401
from ssl_vit.models.features import tokens_feature, patches_feature, patches_lastk_feature  # noqa: F401

# isort: on
