"""Preemption: SIGTERM, and SLURM's requeue signal (SIGUSR1, sent `--signal=USR1@SECONDS` before the
time limit or by `scancel --signal=USR1`), make every rank save `last.ckpt` at the same step boundary;
then the job stops, and after SIGUSR1 under SLURM it is requeued and resumes from that checkpoint.

Lightning does most of this and is wired rather than rewritten: its signal connector turns SIGTERM into
a `SIGTERMException` that every rank raises at the same step (the flag is broadcast from rank 0 before
each batch), its checkpoint connector saves and restores, and `--ckpt_path last` finds the newest
`last*.ckpt`. Only SLURM's requeue handler is replaced: Lightning's saves `hpc_ckpt_N.ckpt` from
inside the signal handler, i.e. at whatever point of the step the signal lands (between backward and
the optimizer update, or with a batch fetched but not trained on), on each rank at a different point,
and a checkpoint there cannot resume exactly. Here the requeue signal only raises the same flag as
SIGTERM; the save happens when the step is over, and rank 0 then runs `scontrol requeue`.

Lightning installs its own SIGUSR1 handler only where none is installed yet, so this one, installed at
`setup`, takes its place. Before `setup` the command notes the requeue signal (`ssl_vit.signals.recorded`)
and a SIGTERM ends it (nothing is trained yet); from `setup` until Lightning installs its handlers (the
checkpoint is restored, the strategy set up) a SIGTERM is noted here. Either note is acted on when
training starts: a save at the first step's end, and the requeue.

A DataLoader worker that dies during training (the kernel's out-of-memory killer, a `kill`) ends the run
too. Its death is reported from a loader's `next`, between two steps (the data module defers torch's
report, which would otherwise come mid-step: `ssl_vit.data.stream.workers.DeadWorkers`), so the state is
saved the same way; not in a job of several processes (the other ranks are not at that boundary).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.utilities.exceptions import SIGTERMException

from ssl_vit.data.stream.workers import stop_all_workers
from ssl_vit.errors import worker_died
from ssl_vit.internals import stop_as_on_sigterm
from ssl_vit.signals import received
from ssl_vit.storage.lock import release_all

log = logging.getLogger("ssl_vit")
REQUEUE_SIGNAL = signal.SIGUSR1  # Lightning's SLURMEnvironment default


class Preemption(pl.Callback):
    """Saves a resumable `last.ckpt` when the job is told to stop, and requeues it under SLURM."""

    def __init__(self) -> None:
        self.requeue_requested = False
        self.sigterm_noted = False
        self._previous: dict[int, object] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.trainer = trainer
        if stage != "fit":
            return
        self.requeue_requested = received(REQUEUE_SIGNAL)  # during the command's start-up
        # Lightning keeps a SIGTERM handler it finds among its own, so this one stays harmless.
        for signum, handler in ((REQUEUE_SIGNAL, self._on_requeue_signal), (signal.SIGTERM, self._note)):
            self._previous[signum] = signal.signal(signum, handler)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _on_requeue_signal(self, signum, frame) -> None:
        log.info("received the requeue signal: saving at the end of this step")
        self.requeue_requested = True
        stop_as_on_sigterm(self.trainer)

    def _note(self, signum, frame) -> None:
        self.sigterm_noted = True

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning clears its flag when it installs its handlers, after `setup` (the module's docstring).
        if self.requeue_requested or self.sigterm_noted:
            stop_as_on_sigterm(self.trainer)

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        boundary = getattr(exception, "at_batch_boundary", False)
        # Training or its validation: either way between two training steps. The death may show in the
        # validation's first fetch when the training epoch's last batch had already come.
        fitting = trainer.state.fn == "fit" and not trainer.sanity_checking
        worker = worker_died(exception) and boundary and fitting and trainer.world_size == 1
        if not worker and not isinstance(exception, SIGTERMException):
            return
        path = last_path(trainer)
        trainer.save_checkpoint(path, weights_only=False)
        if worker:
            exception.saved = str(path)  # the CLI's one line says so
            return
        stop_all_workers()  # saved: nothing is pending, the workers need no grace
        what = "the requeue signal (SIGUSR1)" if self.requeue_requested else "SIGTERM"
        message = f"stopped by {what} after step {trainer.global_step}; saved {path}"
        job = slurm_job_id()
        exception.requeued = self.requeue_requested and job is not None
        if not exception.requeued:
            message += ": resume with the same command and --ckpt_path last"
        elif not trainer.is_global_zero:
            message += f"; rank 0 requeues SLURM job {job}"
        else:
            # Every rank has saved (save_checkpoint ends in a barrier). `scontrol requeue` makes SLURM
            # stop the job at once, so the line is printed before.
            print(
                f"ssl-vit: {message}; requeueing SLURM job {job}: it resumes from there",
                file=sys.stderr,
                flush=True,
            )
            # The checkpoint is saved: the run directory is the requeued job's (`release_all`).
            release_all()
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            message = (
                ""
                if result.returncode == 0
                else f"`scontrol requeue {job}` failed: {result.stderr.strip()[:200]}"
            )
        exception.args = (message,)


def last_path(trainer: pl.Trainer) -> Path:
    """Where a stopping run saves: `last.ckpt` of its checkpoint directory."""
    directory = trainer.checkpoint_callback.dirpath if trainer.checkpoint_callback else None
    return Path(directory or Path(trainer.default_root_dir) / "checkpoints") / "last.ckpt"


def slurm_job_id() -> str | None:
    """The id `scontrol requeue` takes: the array job's `JOBID_TASK` for array jobs (as Lightning)."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    if array_job:
        return f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
    return os.environ.get("SLURM_JOB_ID")
