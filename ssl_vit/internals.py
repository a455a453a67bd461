"""Every private attribute of Lightning, LightningCLI, torch and timm that ssl-vit reaches, behind one door.

A library's private attribute can change in any release without a deprecation. Each one ssl-vit needs is
reached here only: one small function per touch, or, where a private method must be overridden, one base
class whose public hooks the rest of the package overrides instead. Each says why no public API serves,
and is registered in `TOUCHES` with the library and the attributes it reaches. tests/test_internals.py
holds a canary per touch, run against the installed libraries: an upgrade that moves one fails there,
naming the attribute, the library's version and the function here, rather than deep inside a fit. It
also greps the package: no other module of ssl_vit reaches a private attribute of these libraries.
docs/INTERNALS.md lists the touches and the Lightning versions the canaries pass on.

Where a public API serves, the package uses it instead: docs/INTERNALS.md, "Replaced by public APIs".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint, RichProgressBar
from pytorch_lightning.cli import LightningCLI
from pytorch_lightning.loggers import WandbLogger
from pytorch_lightning.plugins.io.wrapper import _WrappingCheckpointIO
from torch import Tensor


@dataclass(frozen=True)
class Touch:
    """What one function or class here reaches: `library` (its import name) and the private
    `attributes` of it, as a reader finds them in the library's source."""

    library: str
    attributes: tuple[str, ...]


TOUCHES: dict[str, Touch] = {}


def _touch(library: str, *attributes: str):
    """Registers the decorated function or class as reaching `attributes` of `library`."""

    def register(obj):
        TOUCHES[obj.__name__] = Touch(library, attributes)
        return obj

    return register


# --- Lightning's training loop -----------------------------------------------------------------------


@_touch("pytorch_lightning", "Trainer.fit_loop._should_accumulate")
def accumulating(trainer: pl.Trainer) -> bool:
    """Whether the current training batch only accumulates gradients (no optimizer step at its end);
    valid from `on_train_batch_start` to `on_train_batch_end`."""
    # Lightning decides it from its loop's batch counters, the epoch's length and the strategy (DeepSpeed
    # accumulates by itself); no public property of the Trainer says it.
    return trainer.fit_loop._should_accumulate()


@_touch("pytorch_lightning", "Trainer.fit_loop._data_fetcher", "_DataFetcher.fetched")
def restart_fetcher(trainer: pl.Trainer, fetched: int) -> None:
    """A new iterator over the training loader for Lightning's fetcher, whose count of the epoch's
    batches fetched (which tells it the epoch's last batch) becomes `fetched`, as Lightning sets it
    when a pass starts."""
    # Lightning makes the iterator as each epoch starts (`_FitLoop.setup_data`); nothing public restarts
    # it in the middle of one.
    fetcher = trainer.fit_loop._data_fetcher
    iter(fetcher)
    fetcher.fetched = fetched


@_touch("pytorch_lightning", "Trainer.fit_loop.epoch_loop._batches_that_stepped")
def logging_step(trainer: pl.Trainer) -> int:
    """The step to log at now, in training: the one Lightning gives the current batch's metrics.

    Lightning moves on to the next step only after it has logged a batch's metrics, after
    `on_train_batch_end`: there the batch's optimizer update is done (`trainer.global_step` is k) but
    its metrics still go to step k - 1. A value logged at k first would make W&B, whose steps only go
    forward, drop that batch's loss, throughput and learning rate.
    """
    # Lightning's own LearningRateMonitor and DeviceStatsMonitor read this counter too; it has no public
    # name (`trainer.global_step` counts optimizer steps, which differ from it inside a batch's hooks).
    return trainer.fit_loop.epoch_loop._batches_that_stepped


@_touch("pytorch_lightning", "Trainer.fit_loop.epoch_loop.total_batch_idx")
def total_batch_idx(trainer: pl.Trainer) -> int:
    """The current training batch, counted from the run's first (0-based, across epochs)."""
    # A counter of Lightning's private training-epoch loop; `trainer` shows only the epoch's batch index.
    return trainer.fit_loop.epoch_loop.total_batch_idx


@_touch(
    "pytorch_lightning",
    "Trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress",
    "Trainer.fit_loop.epoch_loop._batches_that_stepped",
    'checkpoint["loops"]["fit_loop"]["epoch_loop.automatic_optimization.optim_progress"]',
    'checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]',
)
def restore_step_counters(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> int:
    """Sets Lightning's optimizer-step counters (`trainer.global_step` with them) as the Lightning
    `checkpoint` recorded them, in the middle of a fit; returns the batches of the training stream read
    when it was saved (which this leaves as they are: the data only move on)."""
    # Nothing public restores Lightning's loops mid-fit (`ssl_vit.run.rollback`); these count its steps.
    loops = checkpoint["loops"]["fit_loop"]
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop.automatic_optimization.optim_progress.load_state_dict(
        loops["epoch_loop.automatic_optimization.optim_progress"]
    )
    # The step the next batch logs at is the optimizer step (`logging_step`); Lightning adds the current
    # batch's one after the hooks that called this.
    epoch_loop._batches_that_stepped = checkpoint["global_step"] - 1
    return loops["epoch_loop.batch_progress"]["total"]["ready"]


@_touch("pytorch_lightning", "Trainer.fit_loop.epoch_loop.batch_progress")
def count_skipped(trainer: pl.Trainer, batches: int) -> None:
    """Lightning's count of the epoch's (and the run's) batches moves with the data stream past
    `batches` it skipped: it ends the epoch when the stream does, and numbers the batches after."""
    # The progress trackers of Lightning's private training-epoch loop; nothing public moves them.
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for tracker in (progress.total, progress.current):
        tracker.ready += batches
        tracker.started += batches
        tracker.processed += batches
        tracker.completed += batches


@_touch("pytorch_lightning", "Trainer._signal_connector.received_sigterm")
def stop_as_on_sigterm(trainer: pl.Trainer) -> None:
    """Raises the flag Lightning's own SIGTERM handler raises: its training loop then raises
    `SIGTERMException` at the end of the current step (on every rank: rank 0's flag is broadcast)."""
    # `Trainer.received_sigterm` is a read-only property over this flag. `trainer.should_stop` would end
    # the fit quietly, without the exception whose `on_exception` hooks save the state and requeue.
    trainer._signal_connector.received_sigterm = True


@_touch("pytorch_lightning", "pytorch_lightning.plugins.io.wrapper._WrappingCheckpointIO")
def wraps_checkpoint_io(io: Any) -> bool:
    """Whether the CheckpointIO `io` wraps another one (AsyncCheckpointIO does), held in its
    `checkpoint_io` (None until the strategy fills it with its default)."""
    # AsyncCheckpointIO is public, but the base class of every wrapper (a user's own among them) is not.
    return isinstance(io, _WrappingCheckpointIO)


@_touch(
    "pytorch_lightning",
    "ModelCheckpoint._save_checkpoint",
    "ModelCheckpoint._save_none_monitor_checkpoint",
    "ModelCheckpoint._find_last_checkpoints",
    "ModelCheckpoint._link_checkpoint",
    "ModelCheckpoint._get_metric_interpolated_filepath_name",
    "ModelCheckpoint._should_remove_checkpoint",
    "ModelCheckpoint._remove_checkpoint",
    "ModelCheckpoint._should_skip_saving_checkpoint",
    "ModelCheckpoint._monitor_candidates",
    "ModelCheckpoint._save_topk_checkpoint",
    "ModelCheckpoint._save_last_checkpoint",
    "ModelCheckpoint._enable_version_counter",
)
class ModelCheckpointHooks(ModelCheckpoint):
    """Lightning's ModelCheckpoint with its private steps as public hooks and helpers.

    ModelCheckpoint's public surface is its constructor and the callback hooks; how it names, writes,
    links, rotates and finds checkpoints is private. A subclass that changes those steps overrides the
    hooks below (calling `super()` for Lightning's own) and calls the helpers, never the private names.
    Each hook is called by Lightning where it calls the private method just above it, which forwards to
    it; each helper is one private method under a public name.
    """

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        self.write_checkpoint(trainer, filepath)

    def write_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Writes the checkpoint `filepath` and records it as the last one saved (Lightning's)."""
        ModelCheckpoint._save_checkpoint(self, trainer, filepath)

    def _save_none_monitor_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict) -> None:
        self.save_unmonitored(trainer, monitor_candidates)

    def save_unmonitored(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> None:
        """A periodic save without a monitor: Lightning's sets `best_model_path`, writes the file and, with
        `save_top_k: 1`, removes the previous one."""
        ModelCheckpoint._save_none_monitor_checkpoint(self, trainer, candidates)

    def _find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        return self.find_last_checkpoints(trainer)

    def find_last_checkpoints(self, trainer: pl.Trainer) -> set[str]:
        """The checkpoints `ckpt_path="last"` chooses among (Lightning's: every `last*.ckpt` of the
        directory; it resumes the most recently modified)."""
        return ModelCheckpoint._find_last_checkpoints(self, trainer)

    def _link_checkpoint(self, trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        # Lightning's is a staticmethod, always called as `self._link_checkpoint(...)`.
        self.link_checkpoint(trainer, filepath, linkpath)

    def link_checkpoint(self, trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        """Makes `linkpath` (last.ckpt) point to `filepath` (Lightning's: a relative symlink on rank 0,
        then a barrier)."""
        ModelCheckpoint._link_checkpoint(trainer, filepath, linkpath)

    def interpolated_name(self, candidates: dict[str, Tensor], trainer: pl.Trainer, del_filepath: str) -> str:
        """The file name of the next checkpoint, versioned (`-v1`) past existing files unless the file
        is `del_filepath` (which the save replaces)."""
        return self._get_metric_interpolated_filepath_name(candidates, trainer, del_filepath)

    def should_remove(self, trainer: pl.Trainer, previous: str, current: str) -> bool:
        """Whether `previous` may be deleted now that `current` is saved (not when it is the same file,
        lies outside the directory, or is the checkpoint the fit resumed from)."""
        return self._should_remove_checkpoint(trainer, previous, current)

    def remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Deletes `filepath` through the strategy (rank 0)."""
        self._remove_checkpoint(trainer, filepath)

    def skips_saving(self, trainer: pl.Trainer) -> bool:
        """Whether nothing may be saved now (fast_dev_run, sanity check, a step already saved...)."""
        return self._should_skip_saving_checkpoint(trainer)

    def monitor_candidates(self, trainer: pl.Trainer) -> dict[str, Tensor]:
        """The logged metrics plus `epoch` and `step`, from which file names are formatted."""
        return self._monitor_candidates(trainer)

    def save_topk(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> None:
        """The periodic save (top-k or, without a monitor, `save_unmonitored`)."""
        self._save_topk_checkpoint(trainer, candidates)

    def save_last_checkpoint(self, trainer: pl.Trainer, candidates: dict[str, Tensor]) -> None:
        """last.ckpt: a link to the newest checkpoint or a full save (`save_last`)."""
        self._save_last_checkpoint(trainer, candidates)

    @property
    def version_counter(self) -> bool:
        """The constructor's `enable_version_counter`: names of existing files get `-vN` appended."""
        return self._enable_version_counter


# --- Lightning's loggers ------------------------------------------------------------------------------


@_touch("pytorch_lightning", "WandbLogger._wandb_init", "WandbLogger._experiment", "WandbLogger._prefix")
class WandbLoggerHooks(WandbLogger):
    """Lightning's WandbLogger with public names for the state a subclass must change: the options the
    run is started with, the run once started, and the metric prefix."""

    @property
    def init_options(self) -> dict[str, Any]:
        """The keyword arguments Lightning gives `wandb.init` when `experiment` starts the run: changes
        apply to the next start."""
        # Lightning copies its constructor's arguments into this dict; it exposes none of them after.
        return self._wandb_init

    @property
    def started_run(self) -> Any:
        """The W&B run if one was started (else None); `experiment` starts one."""
        # `experiment` would start a run; Lightning keeps the started one only here.
        return self._experiment

    def forget_run(self) -> None:
        """The next `experiment` starts a run anew (with `init_options`)."""
        self._experiment = None

    @property
    def metric_prefix(self) -> str:
        """The constructor's `prefix`, put before every metric's name."""
        return self._prefix


# --- Lightning's progress bar -------------------------------------------------------------------------


@_touch("pytorch_lightning", "RichProgressBar._get_train_description")
class RichProgressBarHooks(RichProgressBar):
    """Lightning's RichProgressBar with its training bar's description as a public hook,
    `epoch_description(epoch)`: no option changes Lightning's own (see `ssl_vit.run.progress.EpochBar`)."""

    def _get_train_description(self, current_epoch: int) -> str:
        return self.epoch_description(current_epoch)

    def epoch_description(self, epoch: int) -> str:
        """The training bar's description in `epoch` (Lightning's)."""
        return RichProgressBar._get_train_description(self, epoch)


# --- LightningCLI and jsonargparse --------------------------------------------------------------------


@_touch(
    "pytorch_lightning",
    "LightningCLI._prepare_subcommand_parser",
    "LightningCLI._subcommand_method_arguments",
    "LightningCLI._parse_ckpt_path",
    "LightningCLI._parser",
)
class LightningCLIHooks(LightningCLI):
    """LightningCLI with public hooks (below) where ssl-vit must step into its private steps."""

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any):
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        self.subcommand_parser_ready(parser, subcommand, list(self._subcommand_method_arguments[subcommand]))
        return parser

    def subcommand_parser_ready(self, parser, subcommand: str, method_arguments: list[str]) -> None:
        """Called with the complete parser of `subcommand`; `method_arguments`: the options that come
        from the Trainer method's signature (`ckpt_path`, `weights_only`). Lightning adds them after
        `add_arguments_to_parser`, so only here can their defaults change."""

    def _parse_ckpt_path(self) -> None:
        self.parse_ckpt_path()

    def parse_ckpt_path(self) -> None:
        """Lightning's: the model's hyperparameters of a local `--ckpt_path` file, over the config, which
        LightningCLI's constructor runs between parsing and the seed. Override it to check the checkpoint
        first (no public hook runs before it), and call `super().parse_ckpt_path()`."""
        LightningCLI._parse_ckpt_path(self)

    def subcommand_parser(self, subcommand: str | None):
        """The parser of `subcommand`, or the main parser for None."""
        return self._parser(subcommand)


# The key under which LightningCLI finds the model's class among a checkpoint's hyperparameters: its
# `_parse_ckpt_path` rebuilds the model of a `--ckpt_path` from the class named there, with the other
# hyperparameters as its arguments. LightningCLI records it for a model it builds from a class path (its
# `_InstantiatorFn`: "a special key `_class_path` to clarify its internal use"); ssl-vit's tasks save it
# themselves, so a task built in Python resumes too, and its checks read it. Checkpoints hold it.
CLASS_PATH_KEY = "_class_path"
TOUCHES["CLASS_PATH_KEY"] = Touch("pytorch_lightning", ('checkpoint["hyper_parameters"]["_class_path"]',))


@_touch("jsonargparse", "ArgumentParser._actions")
def option_names(parser) -> list[str]:
    """The destinations of every option of an (argparse or jsonargparse) parser, nested ones dotted."""
    # argparse keeps a parser's actions in this list and has no public accessor of it; jsonargparse's
    # parser is an argparse one.
    return [action.dest for action in parser._actions]


# --- torch --------------------------------------------------------------------------------------------


@_touch("torch", "GradScaler._get_scale_async")
def loss_scale(scaler) -> Tensor:
    """The gradient scaler's current scale, a tensor on its device (None before its first `scale`)."""
    # The public `get_scale()` returns a Python float: a device-to-host sync at every step.
    return scaler._get_scale_async()


@_touch("torch", "torch._dynamo.utils.counters")
def inductor_cudagraph_skips() -> int:
    """How many compiled graphs inductor has run without CUDA graphs in this process so far."""
    # Dynamo and inductor count what they do in this process-wide table; `torch.compiler` has no public
    # reader of it. Imported here: importing torch._dynamo takes a second, and only the benchmark asks.
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


@_touch("torch", "torch.utils.data._utils.signal_handling")
def is_dataloader_sigchld_handler(handler: Any) -> bool:
    """Whether `handler` (from `signal.getsignal(SIGCHLD)`) is the one torch's DataLoader sets with its
    first iterator that has workers (it raises a dead worker's error)."""
    # torch sets it from a private module and keeps no public reference to it: its module tells it.
    return getattr(handler, "__module__", "") == "torch.utils.data._utils.signal_handling"


__all__ = [
    "CLASS_PATH_KEY", "TOUCHES", "LightningCLIHooks", "ModelCheckpointHooks", "Touch", "WandbLoggerHooks",
    "accumulating", "count_skipped", "inductor_cudagraph_skips", "is_dataloader_sigchld_handler",
    "logging_step", "loss_scale", "option_names", "restart_fetcher", "restore_step_counters",
    "stop_as_on_sigterm", "total_batch_idx", "wraps_checkpoint_io",
]  # fmt: skip
