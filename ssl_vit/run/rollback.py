"""Rolling a fit back, inside its own process, to a checkpoint it saved: the learner (model and EMA
teacher, optimizer, schedule, gradient scaler, RNG states, step count) as `--ckpt_path` restores it,
while the data stream only moves on; and the steps after a rollback, optionally made safer.

Lightning restores a checkpoint only when a fit starts (its checkpoint connector, before the loops run);
nothing public restores one mid-run, and starting the fit again would tear the strategy down (with
Lightning's own DDP launcher, the other ranks with it), shard an FSDP2 model a second time and end the
W&B run. So the pieces are called here as the connector calls them at a resume, through the strategy's
public methods (`load_checkpoint`, `load_model_state_dict`, `load_optimizer_state_dict`; FSDP2's
ModelParallelStrategy loads the model and optimizer shards in `load_checkpoint` itself), and only the
loops' step counters are set by hand (`ssl_vit.internals.restore_step_counters`).

Not rolled back, by design: the data position (the stream moves past the batches that led to the spike,
`ShardDataModule.skip_batches`) and with it Lightning's count of batches and epochs; the task's cost
counters (the compute of the rolled-back steps was spent: `BackboneTask.cost`, which the task's
`on_load_checkpoint` would restore, so it is not called); and the callbacks' own states but the RNGs'
(the non-finite guard's history of rollbacks among them).
"""

from __future__ import annotations

import os
import re
from functools import partial

import pytorch_lightning as pl
import torch
from pytorch_lightning.plugins.precision import MixedPrecision

from ssl_vit.errors import BadValue, UserError
from ssl_vit.internals import restore_step_counters
from ssl_vit.run.resume import RandomState


def restore_learner(trainer: pl.Trainer, path: str) -> tuple[int, int]:
    """Restores the learner of the checkpoint `path` on this rank (every rank calls it at the same
    step); returns the checkpoint's optimizer step and the batches of the stream read when it was saved."""
    strategy = trainer.strategy
    try:
        checkpoint = strategy.load_checkpoint(path)  # through SafeCheckpointIO: checksums verified
        strategy.load_model_state_dict(checkpoint, strict=trainer.lightning_module.strict_loading)
    except RuntimeError as err:  # (FSDP2's load_checkpoint loads the model itself)
        if "Error(s) in loading state_dict" not in str(err):
            raise
        raise another_model(path, str(err)) from None
    if strategy.lightning_restore_optimizer:  # else the strategy's load_checkpoint did (FSDP2)
        strategy.load_optimizer_state_dict(checkpoint)
    for config, state in zip(trainer.lr_scheduler_configs, checkpoint["lr_schedulers"]):
        config.scheduler.load_state_dict(state)
    plugin = trainer.precision_plugin
    if type(plugin).__qualname__ in checkpoint:  # AMP's gradient scaler: its scale
        plugin.load_state_dict(checkpoint[type(plugin).__qualname__])
    for callback in trainer.callbacks:
        if isinstance(callback, RandomState) and callback.state_key in checkpoint.get("callbacks", {}):
            callback.restore(trainer, checkpoint["callbacks"][callback.state_key])
    return checkpoint["global_step"], restore_step_counters(trainer, checkpoint)


def another_model(path: str, error: str) -> UserError:
    """One line for torch's report (tens of lines, one per tensor) that the checkpoint a rollback returns
    to holds another model than the run's: a file another run left in the run's checkpoint directory.
    The run stops before anything is saved: its own checkpoints stay as they were."""
    found = re.search(
        r"size mismatch for (\S+): copying a param with shape torch.Size\((\[.*?\])\) from checkpoint, the "
        r"shape in current model is torch.Size\((\[.*?\])\)",
        error,
    )
    lines = [line.strip() for line in error.splitlines()[1:] if line.strip()]
    what = f"{found[1]} is {found[2]} there, {found[3]} in this run" if found else (lines or [error])[0][:200]
    return UserError(
        f"{path}, the checkpoint a rollback returns to, holds another model than this run's ({what}): "
        f"nothing was saved after it; move it out of {os.path.dirname(path)} and resume with --ckpt_path last"
    )


class SafeSteps:
    """The optimizer steps after a rollback (`NonFiniteGuard`'s safe_steps, safe_fp32 and lr_scale).

    Lightning has no per-step precision switch: its precision plugin opens autocast around every training
    step (`train_step_context`), so for these steps the plugin's context is replaced by one that turns
    autocast off. The learning rate is scaled by hooks on the optimizer's `step` (torch's
    `register_step_pre_hook`/`register_step_post_hook`) and put back right after it, before the schedule
    takes its next step from it."""

    def __init__(self, steps: int, fp32: bool, lr_scale: float) -> None:
        if steps < 0:
            raise BadValue(f"safe_steps must be >= 0, got {steps}")
        if lr_scale <= 0:
            raise BadValue(f"lr_scale must be > 0, got {lr_scale}")
        if steps and not fp32 and lr_scale == 1:
            raise BadValue(
                f"safe_steps {steps} changes nothing by itself: also set safe_fp32 true (those steps in "
                "32-bit) or an lr_scale below 1 (those steps at a lower learning rate)"
            )
        self.steps, self.fp32, self.lr_scale = steps, fp32, lr_scale
        self.left = 0  # safe steps still to take
        self._hooks: list = []
        self._saved_lrs: list[float] | None = None

    def check(self, precision: str) -> None:
        """One line when the trainer's `precision` cannot give these steps in 32-bit."""
        if self.steps and self.fp32 and precision in ("bf16-true", "16-true"):
            raise BadValue(
                f"nonfinite.safe_fp32 runs steps with autocast off, but --trainer.precision {precision} "
                "keeps the weights themselves in 16 bits: use bf16-mixed (or 16-mixed), or safe_fp32 false"
            )

    def attach(self, trainer: pl.Trainer) -> None:
        if self.steps and self.lr_scale != 1:
            for optimizer in trainer.optimizers:
                self._hooks.append(optimizer.register_step_pre_hook(self._scale_lr))
                self._hooks.append(optimizer.register_step_post_hook(self._restore_lr))

    def detach(self, trainer: pl.Trainer) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._autocast(trainer, on=True)

    def start(self) -> None:
        self.left = self.steps

    def before_batch(self, trainer: pl.Trainer) -> None:
        self._autocast(trainer, on=not (self.left and self.fp32))

    def after_step(self, trainer: pl.Trainer) -> None:
        if self.left:
            self.left -= 1
            if not self.left:
                self._autocast(trainer, on=True)

    def _autocast(self, trainer: pl.Trainer, on: bool) -> None:
        plugin = trainer.precision_plugin
        if not isinstance(plugin, MixedPrecision):
            return
        if on:
            vars(plugin).pop("train_step_context", None)  # the class's own again
        else:
            plugin.train_step_context = partial(torch.autocast, plugin.device, enabled=False)

    def _scale_lr(self, optimizer, args, kwargs) -> None:
        if self.left:
            self._saved_lrs = [group["lr"] for group in optimizer.param_groups]
            for group in optimizer.param_groups:
                group["lr"] = group["lr"] * self.lr_scale

    def _restore_lr(self, optimizer, args, kwargs) -> None:
        if self._saved_lrs is not None:
            for group, lr in zip(optimizer.param_groups, self._saved_lrs):
                group["lr"] = lr
            self._saved_lrs = None
