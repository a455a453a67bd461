"""Callbacks tests add to `ssl-vit fit` (`--trainer.callbacks+=health_helpers.ConstantFeatures`) to
make a run collapse on purpose."""

import pytorch_lightning as pl


class ConstantFeatures(pl.Callback):
    """Zeroes and freezes the backbone's final LayerNorm scale before training: every token leaves the
    encoder as the norm's bias, so every image gets the same pooled features, however the rest trains."""

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.backbone.norm.weight.data.zero_()
        pl_module.backbone.norm.weight.requires_grad_(False)


class ConstantTargets(pl.Callback):
    """A collapsed teacher beside a healthy student: zeroes the EMA teacher's final LayerNorm (scale and
    bias) before training, so every patch of every image gets the same target (zero, after the target's
    own LayerNorm), and freezes the predictor (its lr in effect 0: AdamW skips a parameter without a
    gradient). The teacher stays so only with `--model.init_args.ema_momentum 1` and `ema_momentum_end 1`:
    momentum 1 leaves it where it is. The student's own weights, final norm included, train as usual."""

    def on_train_start(self, trainer, pl_module) -> None:
        pl_module.teacher.norm.weight.data.zero_()
        pl_module.teacher.norm.bias.data.zero_()
        pl_module.decoder.requires_grad_(False)
