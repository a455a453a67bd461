"""Where a fit is, for a person reading its log: `ProgressLines`, and the training bar of a terminal.

When stdout is not a terminal (`> run.log`, SLURM's `.out` file) Lightning's bar shows nothing until the
run ends; instead rank 0 prints one line every `trainer.log_every_n_steps` steps, and at least every
`progress.every_minutes`:

    fit: step 150/330 (45%), epoch 2/15, loss 2.431, lr 9.1e-04, 812 images/s, ETA 0:03:41,
    skipped 0 samples, 0 rollbacks, last checkpoint runs/mpp/checkpoints/step0000150.ckpt

(one line), and when the job ends, however it ends, one line saying where the run is: its last checkpoint,
its W&B run and the command that resumes it. The same values go to the run directory's progress record
(`ssl_vit.run.record`), which `ssl-vit status` reads, whatever stdout is.

The loss is read from the device only on the steps that print (a host-device sync there, as logging
has); the skipped-sample count is summed on the device and read with it, reduced over the ranks on the
steps every rank reaches together (`log_every_n_steps`); a line a clock asks for shows rank 0's
reading as of the last such step.

In a terminal Lightning's bar stays (`EpochBar`), without the `/-2` it shows for an unbounded fit.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import RichProgressBar
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ssl_vit.internals import RichProgressBarHooks, accumulating
from ssl_vit.progress import clock
from ssl_vit.run import record
from ssl_vit.run.nonfinite import NonFiniteGuard
from ssl_vit.run.preflight import DEFAULT_ROOT
from ssl_vit.tracking import where


class ProgressLines(pl.Callback):
    """A fit's progress lines on stdout when it is not a terminal, its final line, and its progress
    record in the run directory.

    Args:
        every_minutes: the longest time between two lines (and records), whatever
            `trainer.log_every_n_steps` says: a slow step still shows the run is alive.
    """

    def __init__(self, every_minutes: float = 5.0) -> None:
        if not every_minutes > 0:
            raise ValueError(f"progress.every_minutes {every_minutes}: give a positive number of minutes")
        self.every_s = every_minutes * 60
        self.lines = not sys.stdout.isatty()
        self.run_dir: Path | None = None  # where the record goes (rank 0 of a fit with a local run dir)
        self._reset()

    def _reset(self) -> None:
        self.total: float = float("inf")
        self.first_step, self.start, self.last_time = 0, 0.0, 0.0
        self.guard: NonFiniteGuard | None = None  # the fit's, found at the start
        self.images, self.images_at_last = 0, 0
        self.skipped: torch.Tensor | None = None  # this rank's bad samples, on the device
        self.skipped_total = 0  # over the ranks, as of the last step every rank reduced at
        self.rollbacks_seen, self.skips_seen = 0, 0
        self.started = self.ended = False  # a job that never trained (a refusal at setup) records nothing

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        root = str(trainer.default_root_dir or DEFAULT_ROOT)
        local = "://" not in root
        self.run_dir = Path(root) if stage == "fit" and trainer.is_global_zero and local else None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._reset()
        self.started = True
        self.total = _total_steps(trainer)
        self.first_step = trainer.global_step
        self.start = self.last_time = time.monotonic()
        self.guard = next((c for c in trainer.callbacks if isinstance(c, NonFiniteGuard)), None)
        if self.guard is not None:
            self.rollbacks_seen, self.skips_seen = len(self.guard.rollbacks), self.guard.skipped
        self._record(
            "start", step=trainer.global_step, host=socket.gethostname(), pid=os.getpid(),
            resumed=trainer.ckpt_path,
        )  # fmt: skip

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module, outputs, batch, batch_idx) -> None:
        if isinstance(batch, dict):
            if "image" in batch:
                self.images += batch["image"].shape[0]
            if "skipped" in batch:  # summed on the device: read only when a line is printed
                count = batch["skipped"].detach().sum()
                self.skipped = count if self.skipped is None else self.skipped + count
        self._record_decisions(trainer)
        if accumulating(trainer):
            return
        step = trainer.global_step
        by_step = step > self.first_step and step % max(1, trainer.log_every_n_steps) == 0
        due = by_step or time.monotonic() - self.last_time >= self.every_s
        if self.skipped is not None and (by_step or due and trainer.world_size == 1):
            total = (
                trainer.strategy.reduce(self.skipped.clone(), reduce_op="sum") if by_step else self.skipped
            )
            self.skipped_total = int(total.item())
        if trainer.is_global_zero and due:
            self._line(trainer, _loss(outputs))

    def _record_decisions(self, trainer: pl.Trainer) -> None:
        """The non-finite guard's new rollbacks and skipped steps, in the record (host values: no sync)."""
        guard = self.guard
        if guard is None:
            return
        for rollback in guard.rollbacks[self.rollbacks_seen :]:
            self._record(
                "rollback", step=rollback["step"], to_step=rollback["to_step"], loss=rollback["loss"],
                reason=rollback["reason"],
            )  # fmt: skip
        if guard.skipped > self.skips_seen:
            self._record("skipped_step", step=trainer.global_step, count=guard.skipped - self.skips_seen)
        self.rollbacks_seen, self.skips_seen = len(guard.rollbacks), guard.skipped

    def _line(self, trainer: pl.Trainer, loss: float | None) -> None:
        now = time.monotonic()
        step, done = trainer.global_step, trainer.global_step - self.first_step
        rate = (self.images - self.images_at_last) * trainer.world_size / max(now - self.last_time, 1e-9)
        eta = (
            (self.total - step) * (now - self.start) / done
            if done > 0 and self.total < float("inf")
            else None
        )
        guard = self.guard
        values = {
            "step": step, "total": None if self.total == float("inf") else int(self.total),
            "epoch": trainer.current_epoch, "loss": loss, "lr": _lr(trainer), "images_per_s": round(rate, 1),
            "eta_s": None if eta is None else round(eta, 1), "skipped_samples": self.skipped_total,
            "skipped_steps": guard.skipped if guard is not None else 0,
            "rollbacks": len(guard.rollbacks) if guard is not None else 0,
            "checkpoint": _last_checkpoint(trainer),
        }  # fmt: skip
        self.last_time, self.images_at_last = now, self.images
        self._record("progress", **values)
        if self.lines:
            print(f"fit: {describe(values, trainer.max_epochs)}", flush=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._end(trainer, "ended")

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if isinstance(exception, SIGTERMException):
            # `Preemption.on_exception` (before this callback) says whether a requeue was asked for
            self._end(trainer, "preempted", requeued=bool(getattr(exception, "requeued", False)))
        else:
            why = str(exception).strip().splitlines()
            self._end(trainer, "failed", why=f"{type(exception).__name__}: {why[0][:300] if why else ''}")

    def _end(self, trainer: pl.Trainer, event: str, **fields: Any) -> None:
        if self.ended or not self.started or not trainer.is_global_zero:
            return
        self.ended = True
        checkpoint = _last_checkpoint(trainer)
        self._record(
            event, step=trainer.global_step, epoch=trainer.current_epoch, checkpoint=checkpoint, **fields
        )
        if self.run_dir is None:
            return
        saved = f"last checkpoint {checkpoint}" if checkpoint else "no checkpoint saved"
        resume = shlex.join(
            ["ssl-vit", "fit", "--config", str(self.run_dir / "config.yaml"), "--ckpt_path", "last"]
        )
        print(
            f"fit: run {self.run_dir} at step {trainer.global_step}: {saved}; "
            f"W&B {_wandb_run()}; resume: {resume}",
            flush=True,
        )

    def _record(self, event: str, **fields: Any) -> None:
        if self.run_dir is None:
            return
        try:
            record.append(self.run_dir, event, **fields)
        except OSError:  # the record is for reading the run; a disk that refuses it must not end the run
            self.run_dir = None


def describe(values: dict[str, Any], max_epochs: int | None = None) -> str:
    """A progress record's values as the line says them."""
    step, total = values["step"], values.get("total")
    parts = [f"step {step}/{total} ({100 * step / total:.0f}%)" if total else f"step {step}"]
    epochs = f"/{max_epochs}" if max_epochs is not None and max_epochs > 0 else ""
    parts.append(f"epoch {values['epoch'] + 1}{epochs}")
    if values.get("loss") is not None:
        parts.append(f"loss {values['loss']:.4g}")
    if values.get("lr") is not None:
        parts.append(f"lr {values['lr']:.2g}")
    parts.append(f"{values['images_per_s']:,.0f} images/s")
    parts.append(f"ETA {clock(values['eta_s'])}" if values.get("eta_s") is not None else "ETA ?")
    parts.append(f"skipped {values['skipped_samples']} samples")
    if values.get("skipped_steps"):
        parts.append(f"{values['skipped_steps']} non-finite steps skipped")
    parts.append(f"{values['rollbacks']} rollbacks")
    parts.append(f"last checkpoint {values['checkpoint'] or 'none yet'}")
    return ", ".join(parts)


class EpochBar(RichProgressBarHooks):
    """Lightning's bar, whose training description is `Epoch N/LAST` only when the fit has a last epoch
    (`Epoch N` for `max_epochs: -1`, where Lightning's reads `Epoch N/-2`)."""

    def epoch_description(self, epoch: int) -> str:
        description = super().epoch_description(epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs < 1:
            description = description.replace(f"/{max_epochs - 1}", "", 1)
        return description


def progress_bar(trainer: pl.Trainer, stdout_is_terminal: bool) -> None:
    """Lightning's default bar (added when no callback is one) on `trainer`: replaced by `EpochBar` in a
    terminal; removed elsewhere, where it would print only its last state at the end (the lines
    replace it)."""
    bars = [c for c in trainer.callbacks if type(c) is RichProgressBar]
    if not bars:
        return
    if stdout_is_terminal:
        trainer.callbacks = [EpochBar() if c in bars else c for c in trainer.callbacks]
    else:
        trainer.callbacks = [c for c in trainer.callbacks if c not in bars]


def _total_steps(trainer: pl.Trainer) -> float:
    """The optimizer steps the fit runs to, as Lightning counts them (max_steps and max_epochs both);
    inf for an unbounded one (Lightning's -1 or inf, or a loader whose length it cannot tell)."""
    try:
        total = float(trainer.estimated_stepping_batches)
    except Exception:
        return float("inf")
    return total if 0 < total < float("inf") else float("inf")


def _loss(outputs: Any) -> float | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return float(loss.detach().float().item()) if isinstance(loss, torch.Tensor) else None


def _lr(trainer: pl.Trainer) -> float | None:
    for optimizer in trainer.optimizers[:1]:
        lr = optimizer.param_groups[0].get("lr")
        return float(lr) if lr is not None else None
    return None


def _last_checkpoint(trainer: pl.Trainer) -> str | None:
    """The newest checkpoint saved: without a monitor the checkpoint callback's newest step file
    (`best_model_path`; last.ckpt is a link to it), with one its last.ckpt."""
    callback = trainer.checkpoint_callback
    names = ("last_model_path", "best_model_path")
    if getattr(callback, "monitor", None) is None:
        names = names[::-1]
    path = next((getattr(callback, name) for name in names if getattr(callback, name, None)), None)
    return str(path) if path else None


def _wandb_run() -> str:
    """Where the job's W&B run is, or that it has none."""
    wandb = sys.modules.get("wandb")
    run = getattr(wandb, "run", None) if wandb is not None else None
    return "none" if run is None else where(run)
