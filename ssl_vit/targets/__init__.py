"""What masked-prediction models predict: one module per target, with its math, its shape and its
picture. Importing this package registers the built-in ones (`TARGETS`) in the order messages list them.

- `target`: what a target is (`Target`), what it knows of the task (`TargetContext`), the registry;
- `patches`: images to patches and back, patch statistics;
- `masked_picture`: the masked task's pictures, from the pieces each target draws with;
- `color3bit_target`, `color3bit_4x4_target`: the ViT paper's 3-bit mean colours;
- `pixels_target`, `norm_pixels_target`: raw and per-patch normalised (MAE) pixels;
- `seen_pixels_target`: the pixels as the encoder sees them, standardised (SimMIM);
- `hog_target`: MaskFeat's histograms of oriented gradients;
- `teacher_target`: an EMA teacher's features (I-JEPA, data2vec 2.0).
"""

# isort: off
from ssl_vit.targets.target import TARGETS, Target, TargetContext, register
from ssl_vit.targets import color3bit_target, color3bit_4x4_target, pixels_target  # noqa: F401
from ssl_vit.targets import norm_pixels_target, seen_pixels_target, hog_target, teacher_target  # noqa: F401

# isort: on

__all__ = ["TARGETS", "Target", "TargetContext", "register"]
