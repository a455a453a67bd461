"""Lightning tasks: each wraps a backbone built from a `ViTConfig`, so checkpoints hold it under
`backbone.` with timm's key names."""

from ssl_vit.presets import PRESETS
from ssl_vit.tasks.finetune import FineTune
from ssl_vit.tasks.linear_probe import LinearProbe
from ssl_vit.tasks.masked import MaskedPatchPretraining
from ssl_vit.tasks.optim import WarmupDecay
from ssl_vit.tasks.supervised import SupervisedPretraining

__all__ = [
    "PRESETS", "FineTune", "LinearProbe", "MaskedPatchPretraining", "SupervisedPretraining", "WarmupDecay",
]  # fmt: skip
