"""`ssl-vit fit`, `validate` and `test`: LightningCLI (`SslVitCLI`) with what a run directory needs.

The model and data are chosen in YAML by `class_path`, every constructor argument is an option. Around
Lightning's parsing and run:

- one run directory per job (`trainer.default_root_dir`): config.yaml, checkpoints/, wandb/ and
  pictures/ all land there, a restarted job finds them again, and a fit holds its lock
  (`ssl_vit.storage.lock`) from before it reads anything there to its end;
- `--ckpt_path` resolved (`last`: the newest intact checkpoint) and checked before Lightning reads it,
  and a checkpoint's model never replaced silently by the config's or the command line's (the checks:
  `ssl_vit.run.preflight`, `ssl_vit.checkpoints.store`);
- checks of the values that would fail only after the run directory, config.yaml and the W&B run exist
  (optimizer values, compile options, shard URLs), made before anything is written;
- a mistake in the config (an unknown key, a wrong type, a `class_path` that names no class, a file that
  is not YAML) as one line `KEY: WHAT` with the closest valid key (`ssl_vit.cli.config_errors`).
"""

from __future__ import annotations

import contextlib
import copy
import shutil
import sys
from argparse import ArgumentError
from pathlib import Path

import torch
from pytorch_lightning.callbacks import LearningRateMonitor
from pytorch_lightning.cli import LightningCLI, SaveConfigCallback

from ssl_vit.checkpoints import store
from ssl_vit.cli.config_errors import config_error, import_class
from ssl_vit.cli.moved_options import with_moved_options
from ssl_vit.data import ShardDataModule
from ssl_vit.data.checks import check_shard_urls
from ssl_vit.data.options import check_groups
from ssl_vit.data.skip_log import LogSkippedSamples
from ssl_vit.errors import UserError, user_error_message
from ssl_vit.internals import LightningCLIHooks
from ssl_vit.run.health import HealthMonitor
from ssl_vit.run.last_link import LastLinkCheckpoint
from ssl_vit.run.nonfinite import NonFiniteGuard, check_rollback
from ssl_vit.run.preemption import Preemption
from ssl_vit.run.preflight import (
    DATA_TO_MODEL,
    DEFAULT_ROOT,
    check_ckpt_choice,
    check_run_dir,
    checkpoint_dir,
    follow_run_dir,
    refuse_contradicting_config,
    refuse_contradicting_links,
    refuse_other_bands,
    refuse_overridden_options,
    refuse_unknown_hparams,
    refuse_used_run_dir,
    resumed_checkpoint,
)
from ssl_vit.run.progress import ProgressLines, progress_bar
from ssl_vit.run.resume import RandomState
from ssl_vit.run.rollback import SafeSteps
from ssl_vit.storage.lock import LOCK_NAME, RunLock, job_leader
from ssl_vit.tasks.base import Throughput, upgraded_hparams
from ssl_vit.tasks.compile import CompileTask, check_compile

# What the model takes from the data module once that is built (`link_arguments(..., apply_on=
# "instantiate")`): the per-band normalisation the data module resolved (`auto`: from the manifest's band
# statistics) and the number of classes. Until then the config holds the model's defaults there, not
# values anyone gave: a resumed checkpoint's differing values contradict nothing.
FROM_DATA = {
    "data.mean": "model.init_args.training.mean",
    "data.std": "model.init_args.training.std",
    "data.num_classes": "model.init_args.num_classes",
}


class SaveAndLogConfig(SaveConfigCallback):
    """config.yaml in the run directory (Lightning's), and the whole resolved config, data and
    trainer included, in the W&B run's config under `cli`."""

    def save_config(self, trainer, pl_module, stage) -> None:
        if trainer.logger is not None:  # (W&B's logger hides the credentials in it: `ssl_vit.redact`)
            trainer.logger.log_hyperparams({"cli": self.config.as_dict()})


class SslVitCLI(LightningCLIHooks):
    """LightningCLI with what a run directory needs (the module's docstring lists it)."""

    resumed: dict | None = None  # a resumed fit's checkpoint, memory-mapped, until `before_fit`

    def __init__(self, argv: list[str]) -> None:
        """Parse `argv` (`fit/validate/test ARGS`) and run the command."""
        self.argv = argv
        self._held = contextlib.ExitStack()  # the run directory's lock, released however the command ends
        with self._held:
            super().__init__(
                args=None if argv == sys.argv[1:] else argv,  # None: LightningCLI reads sys.argv itself
                subclass_mode_model=True,
                subclass_mode_data=True,
                auto_configure_optimizers=False,
                save_config_callback=SaveAndLogConfig,
                save_config_kwargs={"overwrite": True},  # a resumed job rewrites its run's config.yaml
                trainer_defaults={
                    "callbacks": [
                        Throughput(),
                        LogSkippedSamples(),
                        LearningRateMonitor("step"),
                        RandomState(),  # exact resume: every rank's RNGs in the checkpoint
                        Preemption(),  # SIGTERM / SLURM's SIGUSR1: save at the step's end (and requeue)
                    ],
                    # Atomic saves, weights-only loads (also of http(s) checkpoints).
                    "plugins": [{"class_path": "ssl_vit.checkpoints.store.SafeCheckpointIO"}],
                },
                # a mistake in the config raises, for `parse_arguments` to say in one line (`config_errors`)
                parser_kwargs={"prog": "ssl-vit", "exit_on_error": False},
            )

    def parse_arguments(self, parser, args) -> None:
        moved = with_moved_options(self.argv)  # a run's own config.yaml written before options moved
        try:
            if moved is None:
                super().parse_arguments(parser, args)
            else:
                self.config = parser.parse_args(moved)
        except ArgumentError as err:
            if user_error_message(err) is not None:  # a value a constructor refused, its own line
                raise
            parser = self.subcommand_parser(self.argv[0])
            raise UserError(config_error(str(err), self.argv, parser, err)) from None
        subcommand = self.config.get("subcommand")
        if subcommand in ("fit", "validate", "test"):  # a run's own config.yaml, where the run now is
            refuse_contradicting_links(self.config[subcommand], self.argv)
            note = follow_run_dir(self.config[subcommand], self.argv)
            if note is not None and job_leader():
                print(f"ssl-vit: warning: {note}", file=sys.stderr, flush=True)

    def subcommands(self) -> dict[str, set[str]]:
        # Only the command being run gets a parser: each is built from the signatures of the
        # Trainer and every class in the config, a few tenths of a second of every start.
        return {self.argv[0]: LightningCLI.subcommands()[self.argv[0]]}

    def add_arguments_to_parser(self, parser) -> None:
        # last.ckpt: a hard link to the newest checkpoint, not a second full write (run/last_link.py).
        parser.add_lightning_class_args(LastLinkCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.save_last": "link",
                "checkpoint.filename": "step{step:07d}",
                "checkpoint.auto_insert_metric_name": False,
                # A resumed run writes last.ckpt and a recomputed step's file again under their own
                # names (atomically), rather than next to them as last-v1.ckpt, stepN-v1.ckpt.
                "checkpoint.enable_version_counter": False,
            }
        )
        # What a NaN or inf loss, or a loss spike, does: `nonfinite.policy` skip (up to `max_skips`), stop or
        # rollback (to the last checkpoint, up to `max_rollbacks`).
        parser.add_lightning_class_args(NonFiniteGuard, "nonfinite")
        # Collapse: feature std and effective rank logged as health/*, and a stop below `health.min_std`.
        parser.add_lightning_class_args(HealthMonitor, "health")
        # torch.compile of the blocks or the step: `compile.enabled`, `.mode`, `.scope`, `.backend`.
        parser.add_lightning_class_args(CompileTask, "compile")
        # Where the fit is: a line every `trainer.log_every_n_steps` steps and at least every
        # `progress.every_minutes` when stdout is not a terminal, and the run directory's progress record.
        parser.add_lightning_class_args(ProgressLines, "progress")
        # The image size and the input bands are given once, on the data side
        for source, target in DATA_TO_MODEL.items():
            parser.link_arguments(source, target)
        for source, target in FROM_DATA.items():
            parser.link_arguments(source, target, apply_on="instantiate")

    def subcommand_parser_ready(self, parser, subcommand: str, method_arguments: list[str]) -> None:
        # `--weights_only` comes from the Trainer method's signature (default None, which Lightning's
        # _load turns into weights_only=False for http(s) checkpoints); it exists only from here on.
        if "weights_only" in method_arguments:
            parser.set_defaults(weights_only=True)

    def parse_ckpt_path(self) -> None:
        """LightningCLI rebuilds the model from a local checkpoint's hyperparameters, over the config.
        Here first: the run directory is checked (and a fit's locked), the file is checked (one line if
        it is not a checkpoint that loads safely), `last` is resolved as Lightning will resolve it so its
        model is rebuilt the same way, the class it names must be an ssl-vit task (a checkpoint is data:
        it never chooses code to run), and a model option given on the command line (or, for a fit, a
        model value of the config) that the checkpoint overrides is refused."""
        if not self.config.get("subcommand"):
            return
        subcommand = self.config.subcommand
        config = self.config[subcommand]
        self._hold_run_dir(subcommand, str(config.trainer.default_root_dir or DEFAULT_ROOT))
        given = check_ckpt_choice(subcommand, config.get("ckpt_path"))
        if given == "scratch":  # validate/test of the freshly initialised model, asked for by name
            config.ckpt_path = given = None
        path = resumed_checkpoint(given, checkpoint_dir(config)) if given == "last" else given
        if path is None or store.local_ckpt_path(path) is None:
            return  # nothing yet to resume, or a URL: the checkpoint IO checks it when loading
        checkpoint = store.check_ckpt_path(path)
        if subcommand == "fit":
            self.resumed = checkpoint
        hparams = checkpoint.get("hyper_parameters", {})
        store.refuse_foreign_model(hparams, path)
        before = copy.deepcopy(config.as_dict()) if hparams else None
        config = self._model_from_checkpoint(path, given)
        refuse_unknown_hparams(config, path)
        refuse_other_bands(hparams, config, path)
        if before is not None:
            refuse_overridden_options(self.argv, before, config, path)
            if subcommand == "fit":  # validate/test evaluate the checkpoint's model
                refuse_contradicting_config(before, config, path, FROM_DATA.values())

    def _hold_run_dir(self, subcommand: str, root: str) -> None:
        """The run directory `root` checked, and a fit's locked until the command ends: the first thing
        done with it, before the checkpoint is read and before the used-directory check, config.yaml,
        W&B and checkpoints: one fit at a time. Only the job's rank 0 locks (every rank of a
        torchrun/srun job runs this command); an object store (s3://...) has no files to check and no
        locks."""
        if "://" in root:
            return
        check_run_dir(root)
        if subcommand == "fit" and job_leader():
            if self._held.enter_context(RunLock(root)).made_run_dir:
                # Unwound before the lock is released (and the emptied directory with it).
                self._held.push(self._remove_if_failed)

    def _model_from_checkpoint(self, path, given):
        """The command's config with the model LightningCLI rebuilt from the checkpoint `path`'s
        hyperparameters; `--ckpt_path` left as `given` (`last` stays `last` for Lightning to resolve)."""
        config = self.config[self.config.subcommand]
        config.ckpt_path = str(path)
        try:
            super().parse_ckpt_path()
            self._upgrade_model()
        except ArgumentError as err:  # the model the checkpoint records, refused by this version's parser
            command = self.config.subcommand
            what = config_error(str(err), [command], self.subcommand_parser(command), err)
            raise store.unparsable_model(path, what) from None
        finally:
            config = self.config[self.config.subcommand]
            config.ckpt_path = given
        return config

    def _upgrade_model(self) -> None:
        """The options of a checkpoint written before they moved into `training` (LightningCLI keeps
        them, unknown, as `dict_kwargs`) read at their new places (`upgraded_hparams`)."""
        model = self.config[self.config.subcommand].model
        old = model.pop("dict_kwargs", None)
        if old:
            moved = {"class_path": model.class_path, "dict_kwargs": upgraded_hparams(old)}
            self.config = self.parser.parse_object({self.config.subcommand: {"model": moved}}, self.config)

    def _remove_if_failed(self, failed: type | None, *_) -> None:
        """After a fit that made its run directory failed before its first training step: what it wrote
        there (config.yaml, W&B's folder and run id) is removed, so that the directory is left as the
        fit found it: absent. A fit that trained keeps everything, its checkpoints and the W&B run that
        shows how it ended (a collapse, a non-finite stop) included."""
        config = self.config[self.config.subcommand]
        trainer = getattr(self, "trainer", None)
        trained = trainer is not None and trainer.global_step > 0
        saved = any(checkpoint_dir(config).glob("*.ckpt"))  # at step 0 too: SIGTERM in the sanity check
        if failed is None or trained or saved:
            return
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:  # finished first: it writes nothing after
            wandb.finish(exit_code=1)
        for path in Path(config.trainer.default_root_dir or DEFAULT_ROOT).iterdir():
            if path.name == LOCK_NAME:  # the lock's to remove, when it is released
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        check_values(self.subcommand, config)
        root = Path(config.trainer.default_root_dir or DEFAULT_ROOT)
        config.trainer.default_root_dir = str(root)
        if config.checkpoint.dirpath is None:
            config.checkpoint.dirpath = str(root / "checkpoints")
        if self.subcommand == "fit" and not config.get("ckpt_path"):
            refuse_used_run_dir(Path(config.checkpoint.dirpath))
        # A job that resumes a checkpoint continues the run directory's W&B run; one that starts
        # afresh in a used run directory starts a new W&B run (its steps start again at 0).
        resumed = resumed_checkpoint(config.get("ckpt_path"), Path(config.checkpoint.dirpath))
        logger = config.trainer.logger
        for spec in logger if isinstance(logger, list) else [logger]:
            init_args = getattr(spec, "init_args", None)
            if getattr(spec, "class_path", None) == "ssl_vit.tracking.WandbLogger":
                init_args.continue_run = resumed is not None
                if self.subcommand == "fit" and resumed is not None:
                    init_args.resume_step = store.checkpoint_step(resumed)
            if (
                init_args is not None
                and "save_dir" in init_args
                and init_args.save_dir in (None, DEFAULT_ROOT)
            ):
                init_args.save_dir = str(root)

    def before_fit(self) -> None:
        # `on_data_change: refuse` before config.yaml, the W&B run or a checkpoint is written; Lightning
        # restores the data module's state (and checks it again) only inside the fit.
        refuse = getattr(self.datamodule, "refuse_changed_data", None)
        resumed, self.resumed = self.resumed, None  # the file's map is let go
        if resumed is not None and refuse is not None:
            refuse(resumed.get(type(self.datamodule).__qualname__, {}), self.trainer.world_size)

    def instantiate_trainer(self, **kwargs):
        # A recipe's `trainer.plugins` replaces the default list (LightningCLI merges only callbacks
        # with trainer_defaults), so the checkpoint IO is (re)added here.
        plugins = self.config_init[self.subcommand].get("trainer", {}).get("plugins")
        trainer = super().instantiate_trainer(plugins=store.with_safe_io(plugins), **kwargs)
        progress_bar(trainer, sys.stdout.isatty())  # a terminal's bar; elsewhere the progress lines
        if not trainer.loggers:  # --trainer.logger false: the LR monitor has nowhere to log, and raises
            trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, LearningRateMonitor)]
        return trainer


def check_values(subcommand: str, config) -> None:
    """The values of `config` that would fail only after the run directory, config.yaml and the W&B run
    exist (Lightning's, torch's and the classes' own checks come later), checked before anything is
    written: weights-only loading, the compile options, the optimizer's values, a rollback's needs
    and the shard URLs."""
    if config.get("weights_only") is False:
        raise UserError(
            "--weights_only false: ssl-vit never unpickles code from a checkpoint; drop the option "
            "(checkpoints written by ssl-vit load with weights only)"
        )
    if config.compile.enabled:  # CompileTask checks again at setup, after the trainer's banner
        strategy = config.trainer.strategy
        strategy = str(getattr(strategy, "class_path", strategy))  # a name, or class_path + init_args
        accumulate = config.trainer.accumulate_grad_batches
        check_compile(config.compile.mode, accumulate, strategy, config.compile.backend)
    check_optimizer(config)
    if subcommand == "fit" and config.nonfinite.policy == "rollback":  # the guard again at setup
        nonfinite = config.nonfinite
        data = getattr(config.get("data"), "class_path", None)
        check_rollback(
            config.trainer.enable_checkpointing is not False,
            import_class(data) if data else None,
            str(config.trainer.precision),
            SafeSteps(nonfinite.safe_steps, nonfinite.safe_fp32, nonfinite.lr_scale),
        )
    data_args = getattr(config.get("data"), "init_args", None)
    if data_args is not None:
        if issubclass(import_class(config.data.class_path), ShardDataModule):
            check_groups(data_args.as_dict())
        check_shard_urls(subcommand, data_args.as_dict())


def check_optimizer(config) -> None:
    """The model's optimizer built once on a dummy parameter (`check_values`): torch checks its values
    (a negative learning rate, betas outside [0, 1), ...) only when the task builds it."""
    spec = config.get("model.init_args.training.optimizer")
    class_path = getattr(spec, "class_path", None)
    if class_path is None:
        return
    init_args = spec.init_args.as_dict() if hasattr(spec.init_args, "as_dict") else dict(spec.init_args or {})
    try:
        optimizer = import_class(class_path)
        optimizer([torch.nn.Parameter(torch.zeros(1))], **init_args)
    except (ValueError, TypeError) as err:
        raise UserError(
            f"model.init_args.training.optimizer ({class_path.rsplit('.', 1)[-1]}): {err}: give a valid "
            "value in the recipe or on the command line "
            "(--model.init_args.training.optimizer.init_args.NAME VALUE)"
        ) from None
