"""Callbacks tests add to `ssl-vit fit` (`--trainer.callbacks+=resume_helpers.StepRecorder`): one JSON
line per training step with what the resume tests compare; NaN gradients on one rank; a hold before
training."""

import json
import os
import time

import pytorch_lightning as pl


class StepRecorder(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = {
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "loss": float(outputs["loss"]),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
            "keys": list(batch["key"]),
            "rank": trainer.global_rank,
        }
        with open(self.path, "a") as f:  # one write per line: a SIGKILL leaves whole lines
            f.write(json.dumps(record) + "\n")


class PoisonGradients(pl.Callback):
    """Makes the gradients of optimizer steps `steps` NaN on `rank` only, after DDP has averaged them:
    one rank sees a non-finite gradient, the others do not (an overflow in one rank's backward)."""

    def __init__(self, steps: list[int], rank: int = 0) -> None:
        self.steps, self.rank = set(steps), rank

    def on_after_backward(self, trainer, pl_module) -> None:
        if trainer.global_step in self.steps and trainer.global_rank == self.rank:
            next(p for p in pl_module.parameters() if p.grad is not None).grad.fill_(float("nan"))


class HoldBeforeTraining(pl.Callback):
    """Holds the fit before its first training step until the file `release` exists or a SIGTERM came,
    after creating `release + ".reached"`: a test decides when the fit may go on (while it holds its run
    directory), with no timing of its own."""

    def __init__(self, release: str) -> None:
        self.release = release

    def on_train_start(self, trainer, pl_module) -> None:
        open(self.release + ".reached", "w").close()
        while not os.path.exists(self.release) and not trainer.received_sigterm:
            time.sleep(0.02)


class HoldAt(pl.Callback):
    """Holds the fit at a moment a test chooses (`where`: `build`, as the CLI builds the trainer's
    callbacks, before any hook runs; `sanity`, the first validation batch of the sanity check; `step`,
    the end of training step `step`), after creating `release + ".reached"`, until the file `release`
    exists or a SIGTERM came: the test acts (a signal, a kill) while the fit is there."""

    def __init__(self, release: str, where: str = "step", step: int = 1) -> None:
        self.release, self.where, self.step = release, where, step
        if where == "build":
            self._hold(None)

    def _hold(self, trainer) -> None:
        open(self.release + ".reached", "w").close()
        while not os.path.exists(self.release) and not (trainer and trainer.received_sigterm):
            time.sleep(0.02)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.where == "sanity" and trainer.sanity_checking and batch_idx == 0:
            self._hold(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.where == "step" and trainer.global_step == self.step:
            self._hold(trainer)


def read_steps(path) -> list[dict]:
    """The recorded steps, in the order they were written (a resumed run appends after the first)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]


def fit_args(
    shards, run_dir, record, *extra: str, epochs: int = 2, batches: int = 6, small_monitor: bool = True
) -> list[str]:
    """`ssl-vit fit` of the quickstart MPP recipe, small: `epochs` x `batches` steps, two DataLoader
    workers, a checkpoint every 4 steps, every step logged and recorded in `record`. `small_monitor`:
    its few-shot probe on 800 of the digits (`cli_helpers.small_fewshot_monitor`), not the data's own."""
    from cli_helpers import small_fewshot_monitor  # here: the callbacks above run in fits, without pytest

    return [
        "fit", "--config", str(ROOT / "recipes/quickstart/mpp.yaml"),
        *(small_fewshot_monitor(shards) if small_monitor else []),
        "--data.init_args.train_urls", f"{shards}/train-{{000000..000004}}.tar",
        "--data.init_args.val_urls", f"{shards}/val-{{000000..000003}}.tar",
        "--data.init_args.num_workers", "2",
        "--data.init_args.batch_size", "32",
        "--data.init_args.train_batches", str(batches),
        "--trainer.max_epochs", str(epochs),
        "--checkpoint.every_n_train_steps", "4",
        "--trainer.log_every_n_steps", "1",
        "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(run_dir),
        "--model.init_args.picture_every_n_steps", "0",
        "--trainer.callbacks+=resume_helpers.StepRecorder", "--trainer.callbacks.path", str(record),
        *extra,
    ]  # fmt: skip
