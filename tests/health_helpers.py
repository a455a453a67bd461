"""Callbacks tests add to `ssl-vit fit` (`--trainer.callbacks+=health_helpers.ConstantFeatures`) to
make a run collapse on purpose."""

import pytorch_lightning as pl


class ConstantFeatures(pl.Callback):
    """Zeroes and freezes the backbone's final LayerNorm scale before training: every token leaves the
    encoder as the norm's bias, so every image gets the same pooled features, however the rest trains."""

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.backbone.norm.weight.data.zero_()
        pl_module.backbone.norm.weight.requires_grad_(False)
