"""Lightning tasks: each wraps a backbone built from a `ViTConfig`, so checkpoints hold it under
`backbone.` with timm's key names.

- `base`: what every task shares (`BackboneTask`, the `Training` group of options);
- `masked`: masked patch prediction (MPP, MAE, SimMIM, MaskFeat, I-JEPA, data2vec 2.0 by preset), with
  its EMA teacher in `teacher` and its targets in `ssl_vit.targets`;
- `supervised`: the supervised baseline; `finetune`: fine-tuning with a new head;
- `frozen_probe`, `linear_probe`, `attentive_probe`, `seg_probe`: probes on a frozen backbone;
- `optim`: weight-decay groups, the schedule, lr scaling; `compile`: `torch.compile` of a task.
"""

from ssl_vit.presets import PRESETS
from ssl_vit.tasks.finetune import FineTune
from ssl_vit.tasks.linear_probe import LinearProbe
from ssl_vit.tasks.masked import MaskedPatchPretraining
from ssl_vit.tasks.optim import WarmupDecay
from ssl_vit.tasks.supervised import SupervisedPretraining

__all__ = [
    "PRESETS", "FineTune", "LinearProbe", "MaskedPatchPretraining", "SupervisedPretraining", "WarmupDecay",
]  # fmt: skip
