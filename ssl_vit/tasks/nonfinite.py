"""A NaN or inf in the loss or the gradients, on any rank: skip the step (up to `max_skips` times) or
stop the run, on every rank at the same step, and never write a non-finite state over a checkpoint.

Under DDP the gradients are all-reduced before the optimizer step, so a NaN on one rank's loss reaches
every rank's gradients; with FSDP each rank holds a shard. Either way the decision is reduced over the
ranks, so they skip or stop together and none waits for the others in a collective.
"""

from __future__ import annotations

from typing import Any, Literal

import pytorch_lightning as pl
import torch

from ssl_vit.errors import BadValue, UserError


class NonFiniteError(UserError):
    """Training stopped on a non-finite loss or gradient; the message names the step and the fix."""


class NonFiniteGuard(pl.Callback):
    """Watches the gradient norm of every optimizer step.

    Args:
        policy: `skip` drops a step whose gradients are not finite (its update is not applied, the
            schedule and the step count move on, as with AMP's loss scaling) and stops after `max_skips`
            of them; deciding before the optimizer step costs one host read per step. `stop` stops at
            the first one, checked every `check_every_n_steps` steps and before every checkpoint save,
            with no host synchronisation in between (the steps after the bad one are wasted, nothing is
            saved from them).
        max_skips: steps `skip` may drop over the whole run before it stops.
        check_every_n_steps: how often `stop` reads the flag (the trainer's log_every_n_steps if unset).

    With `16-mixed` precision, AMP's GradScaler already skips overflowing steps and lowers its scale:
    the guard then leaves the steps to it and only keeps non-finite states out of checkpoints.
    """

    def __init__(
        self,
        policy: Literal["skip", "stop"] = "skip",
        max_skips: int = 10,
        check_every_n_steps: int | None = None,
    ) -> None:
        if policy not in ("skip", "stop"):
            raise BadValue(f"policy must be 'skip' or 'stop', got {policy!r}")
        if max_skips < 0:
            raise BadValue(f"max_skips must be >= 0, got {max_skips}")
        self.policy, self.max_skips, self.check_every = policy, max_skips, check_every_n_steps
        self.skipped = 0
        self._first_bad: torch.Tensor | None = None  # `stop`: first bad step, -1 while none, on the device

    def state_dict(self) -> dict[str, Any]:
        return {"skipped": self.skipped}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.skipped = state_dict["skipped"]

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if "16-mixed" == str(trainer.precision):
            return
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            return
        bad = ~torch.isfinite(torch.nn.utils.get_total_norm(grads))  # one fused pass over the gradients
        step = trainer.global_step
        if self.policy == "stop":
            if self._first_bad is None:
                self._first_bad = torch.full((), -1, dtype=torch.long, device=bad.device)
            self._first_bad = torch.where(bad & (self._first_bad < 0), step, self._first_bad)
            return
        if not trainer.strategy.reduce_boolean_decision(bool(bad), all=False):
            return
        self.skipped += 1
        if self.skipped > self.max_skips:
            self._stop(trainer, step, f"after skipping {self.max_skips} such steps")
        optimizer.zero_grad(set_to_none=True)  # torch optimizers leave parameters without grad untouched
        pl_module.log("train/skipped_steps", float(self.skipped), rank_zero_only=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        every = self.check_every or trainer.log_every_n_steps
        if self.policy == "stop" and trainer.global_step % max(1, every) == 0:
            self._check_stop(trainer)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint) -> None:
        """Refuse to save a non-finite state: it would replace the last good checkpoint."""
        if self.policy == "stop":
            self._check_stop(trainer)
        finite = torch.stack([torch.isfinite(p).all() for p in pl_module.parameters()]).all()
        if trainer.strategy.reduce_boolean_decision(not bool(finite), all=False):
            self._stop(trainer, trainer.global_step, "(the weights are no longer finite)")

    def _check_stop(self, trainer: pl.Trainer) -> None:
        first = int(self._first_bad) if self._first_bad is not None else -1
        first = int(trainer.strategy.reduce(torch.tensor(first, dtype=torch.float64), reduce_op="max"))
        if first >= 0:
            self._stop(trainer, first, "")

    def _stop(self, trainer: pl.Trainer, step: int, why: str) -> None:
        saved = _last_checkpoint(trainer)
        where = f"non-finite loss or gradients at step {step} {why}".rstrip()
        raise NonFiniteError(
            f"{where}; nothing was saved after it (last good checkpoint: {saved or 'none yet'}): lower the "
            "learning rate or check the data, then resume with --ckpt_path last"
        )


def _last_checkpoint(trainer: pl.Trainer) -> str | None:
    callback = trainer.checkpoint_callback
    return getattr(callback, "last_model_path", None) or getattr(callback, "best_model_path", None) or None
